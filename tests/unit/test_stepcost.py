"""The step-cost model's online fit (seer/stepcost.py): it follows the engines' step records,
and bad records cannot swing it."""

from __future__ import annotations

import math
import random

import pytest

from seer.config import SchedulerConfig
from seer.controlplane.scheduler import Scheduler
from seer.protocol import EngineCapabilities, pack_steps, unpack_steps
from seer.stepcost import MAX_RATIO, REFIT_EVERY, WINDOW, CostModel, StepCostFit

TRUE = CostModel(a=0.2, b=4e-3, c=2e-5, p=3e-3, pool_s_per_token=8e-6)
PRIOR = CostModel.cpu_smollm2()


def records(n: int, cost: CostModel = TRUE, seed: int = 0, noise: float = 0.05) -> list[tuple[float, ...]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        batch, kv, prefill = rng.randint(1, 48), rng.randint(100, 30_000), rng.choice([0] * 6 + [rng.randint(1, 400)])
        out.append((cost.step_s(batch, kv, prefill) * (1 + rng.uniform(-noise, noise)), batch, kv, prefill))
    return out


def close(model: CostModel, cost: CostModel, rel: float) -> bool:
    return all(abs(getattr(model, k) / getattr(cost, k) - 1) <= rel for k in "abcp")


def test_the_fit_recovers_the_step_cost_from_clean_records():
    """From the prior, a window of records of another engine's steps moves every coefficient
    to within 15 % of that engine's."""
    fit = StepCostFit(PRIOR)
    assert fit.model == PRIOR
    fit.add(records(WINDOW))
    assert close(fit.model, TRUE, 0.15), fit.model
    assert fit.num_records == WINDOW and fit.num_refused == 0


def test_records_outside_physical_bounds_are_refused_and_counted():
    """NaN, negative or zero seconds, a step of more than a minute, a batch of 0 and
    negative token counts are refused: the fit is what the good records alone give."""
    good = records(REFIT_EVERY * 2)
    bad = [(math.nan, 4, 100, 0), (-0.1, 4, 100, 0), (0.0, 4, 100, 0), (3600.0, 4, 100, 0), (0.2, 0, 100, 0),
           (0.2, 4, -5, 0), (0.2, 4, 100, -1), (math.inf, 4, 100, 0), (0.2, math.nan, 100, 0)]
    clean, dirty = StepCostFit(PRIOR), StepCostFit(PRIOR)
    clean.add(good)
    assert dirty.add(bad + good) == len(good)
    assert dirty.num_refused == len(bad)
    assert dirty.model == clean.model


def test_a_stalled_engine_cannot_swing_the_fit():
    """One record in ten from an engine that stalled (each step 40 times its cost, still
    under a minute) moves no coefficient by more than 15 % against the clean fit."""
    clean, stalled = StepCostFit(PRIOR), StepCostFit(PRIOR)
    good = records(WINDOW)
    clean.add(good)
    mixed = [(s * 40, b, kv, p) if i % 10 == 0 else (s, b, kv, p) for i, (s, b, kv, p) in enumerate(good)]
    stalled.add(mixed)
    assert close(stalled.model, clean.model, 0.15), (stalled.model, clean.model)


def test_nonsense_within_bounds_stays_within_the_prior_ratio():
    """Records claiming every step takes 50 s whatever the batch: the fit is clamped to
    MAX_RATIO times the prior, never beyond."""
    fit = StepCostFit(PRIOR)
    fit.add([(50.0, b, 1000 * b, 0) for b in range(1, WINDOW + 1)])
    for k in "abcp":
        assert getattr(fit.model, k) <= getattr(PRIOR, k) * MAX_RATIO * (1 + 1e-9)
        assert getattr(fit.model, k) >= getattr(PRIOR, k) / MAX_RATIO * (1 - 1e-9)


def test_a_feature_that_never_varies_keeps_its_prior():
    """A pure decode phase (no prefill in any record) says nothing about p: it stays the prior's."""
    fit = StepCostFit(PRIOR)
    fit.add([(s, b, kv, 0) for s, b, kv, _ in records(WINDOW)])
    assert fit.model.p == pytest.approx(PRIOR.p, rel=1e-6)


def test_the_fit_follows_an_engine_that_changed():
    """The fit covers the last WINDOW records: an engine that became twice as slow is
    followed once a window of its new steps arrived."""
    fit = StepCostFit(PRIOR)
    fit.add(records(WINDOW, seed=1))
    slower = CostModel(a=TRUE.a * 2, b=TRUE.b * 2, c=TRUE.c * 2, p=TRUE.p * 2, pool_s_per_token=8e-6)
    fit.add(records(WINDOW, slower, seed=2))
    assert close(fit.model, slower, 0.15), fit.model


def test_step_records_travel_as_packed_float32_and_the_scheduler_takes_them():
    """An engine's heartbeat carries its steps packed; the scheduler feeds them to its fit,
    ignores an engine it does not know, and a frame of broken length is refused."""
    recs = records(REFIT_EVERY)
    back = unpack_steps(pack_steps(recs))
    assert len(back) == len(recs) and all(abs(x[0] / y[0] - 1) < 1e-6 for x, y in zip(back, recs))
    with pytest.raises(ValueError, match="whole number"):
        unpack_steps(pack_steps(recs)[:-3])
    sched = Scheduler(SchedulerConfig(policy="context"), lambda: 0.0)
    assert sched.step_cost.prior == CostModel.cpu_smollm2()
    assert sched.engine_steps(7, back) == 0  # unknown engine
    sched.engine_joined(0, EngineCapabilities(backend="sim", model="m", dtype="none", max_model_len=4096,
                                              vocab_size=259, kv_capacity_tokens=100_000, block_size=16))
    assert sched.engine_steps(0, back) == len(back)
    assert sched.policy("context").cost == sched.step_cost.model  # the policy decides by the fit
    gpu = Scheduler(SchedulerConfig(policy="context", cost_prior="gpu"), lambda: 0.0)
    assert gpu.step_cost.prior == CostModel.gpu_h800_like()
