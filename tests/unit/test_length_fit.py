"""The ``context`` length model's online fit (``RolloutLengths.refit``): population
parameters read from the probes (censored, up to a common horizon) and complete groups."""

from __future__ import annotations

import math
import random

from seer.config import SchedulerConfig
from seer.controlplane.policies.lengths import (FIT_MIN_PROBES, PRIOR_SB, PRIOR_SW, RolloutLengths,
                                                censored_normal_fit)
from seer.sim.simulator import Simulation
from seer.sim.workloads import _solve_log_mean, generate_trace
from tests.unit.test_decision_digest import SMALL


def test_a_censored_normal_fit_recovers_what_the_exact_values_alone_read_short():
    rng = random.Random(3)
    values = [rng.gauss(8.0, 1.0) for _ in range(4000)]
    cut = 8.3
    exact = [v for v in values if v <= cut]
    mean, sd = censored_normal_fit(exact, [cut] * (len(values) - len(exact)))
    assert abs(mean - 8.0) < 0.06 and abs(sd - 1.0) < 0.06
    assert sum(exact) / len(exact) < 7.6  # what ignoring the censored ones would say


def _probes_mid_chunk(model: RolloutLengths, logs: list[float], chunk: int, progress: int) -> None:
    """Every probe ran a first chunk of ``chunk`` tokens; those longer are ``progress``
    tokens into their second, and the ones that ended there have reported, the rest read
    only their first chunk's end (the engine reports a chunk when it returns)."""
    for g, y in enumerate(logs):
        length = round(math.exp(y))
        if length <= chunk + progress:
            model.probe(g, length, finished=True)
        else:
            model.probe(g, chunk, finished=False)


def test_the_fit_reads_the_probes_up_to_a_common_horizon_not_short():
    """Mid-chunk, the short probes of the second chunk have finished and their long peers
    still read the first chunk's end: a fit of those values as they stand reads the spread
    short; the horizon's fit does not."""
    rng = random.Random(5)
    logs = [rng.gauss(8.5, 1.0) for _ in range(400)]
    model = RolloutLengths(max_tokens=200_000, num_groups=400)
    _probes_mid_chunk(model, logs, 4096, 3000)
    assert model.refit()
    total = math.hypot(model.sb, model.sw)
    assert abs(model.m0 - 8.5) < 0.15 and abs(total - 1.0) < 0.15
    naive_mean, naive_sd = censored_normal_fit([y for y, done, _ in model.probes.values() if done],
                                               [y for y, done, _ in model.probes.values() if not done])
    assert naive_sd < 0.85  # the scenario does bias a fit without the horizon


def test_no_fit_before_enough_probes_finished_or_while_many_have_not_reported():
    model = RolloutLengths(max_tokens=100_000, num_groups=100)
    for g in range(FIT_MIN_PROBES - 1):
        model.probe(g, 50 + g, finished=True)
    for g in range(FIT_MIN_PROBES - 1, 95):
        model.probe(g, 4096, finished=False)
    assert not model.refit()  # too few finished
    model.probe(95, 70, finished=True)
    assert model.refit()
    late = RolloutLengths(max_tokens=100_000, num_groups=100)
    for g in range(80):  # 20 probes have not returned a chunk yet: they may be the long ones
        late.probe(g, 50 + g, finished=True)
    assert not late.refit()
    assert (late.sb, late.sw) == (PRIOR_SB, PRIOR_SW)


def test_a_probe_cut_by_the_budget_counts_as_censored_there():
    model = RolloutLengths(max_tokens=1000, num_groups=1)
    model.probe(0, 1000, finished=True)
    assert model.probes[0] == (math.log(1000), True, False)


def test_the_within_group_spread_comes_from_complete_groups_only():
    model = RolloutLengths(max_tokens=100_000, num_groups=20)
    for g in range(20):
        model.observe(g, 100, group_size=4)
        model.observe(g, 400, group_size=4)  # incomplete groups: not counted
    assert model.num_complete == 0
    for g in range(20):
        model.observe(g, 100, group_size=4)
        model.observe(g, 400, group_size=4)
    assert model.num_complete == 20
    spread = math.sqrt(model.within[0] / model.within[1])
    assert abs(spread - math.log(4) / math.sqrt(3)) < 1e-9  # sample sd of (a, b, a, b) in logs


def _simulate(policy: str, icc: float, log_sigma: float) -> tuple[Simulation, float]:
    trace = generate_trace("fit", num_groups=160, group_size=8, max_tokens=8192, mean_tokens=1500,
                           prompt_tokens=64, icc=icc, seed=11, log_sigma=log_sigma)
    sim = Simulation(trace, policy, 4, SMALL, 400_000, SchedulerConfig(policy=policy, chunk_size_tokens=512), 3, 64)
    sim.run()
    return sim, _solve_log_mean(1500, 8192, log_sigma)


def test_the_context_policy_fits_its_model_to_the_rollout_it_schedules(monkeypatch):
    """A seeded simulation: the last refit's parameters land near the trace's own, far
    from the priors (sw 0.8 and sb 0.6 against 0.27 and 0.54 here)."""
    fits: list[RolloutLengths] = []
    refit = RolloutLengths.refit

    def recording(self: RolloutLengths) -> bool:
        changed = refit(self)
        if changed:
            fits.append(self)
        return changed

    monkeypatch.setattr(RolloutLengths, "refit", recording)
    trace = generate_trace("fit", num_groups=160, group_size=8, max_tokens=8192, mean_tokens=1500,
                           prompt_tokens=64, icc=0.8, seed=11, log_sigma=0.6)
    config = SchedulerConfig(policy="context", chunk_size_tokens=512)
    Simulation(trace, "context", 4, SMALL, 400_000, config, 3, 64).run()
    assert fits
    model = fits[-1]
    assert abs(model.m0 - _solve_log_mean(1500, 8192, 0.6)) < 0.1
    assert abs(model.sw - math.sqrt(0.2) * 0.6) < 0.08 and abs(model.sb - math.sqrt(0.8) * 0.6) < 0.12


def test_oracle_group_learns_nothing(monkeypatch):
    """It is told each group's distribution: it keeps no length model and never refits."""
    monkeypatch.setattr(RolloutLengths, "refit", lambda self: (_ for _ in ()).throw(AssertionError("refit")))
    trace = generate_trace("fit", num_groups=40, group_size=8, max_tokens=8192, mean_tokens=1500,
                           prompt_tokens=64, icc=0.8, seed=11, log_sigma=0.6)
    sim = Simulation(trace, "oracle-group", 4, SMALL, 400_000,
                     SchedulerConfig(policy="oracle-group", chunk_size_tokens=512), 3, 64)
    sim.run()
    assert all(g.done for g in sim.rollout.groups)
