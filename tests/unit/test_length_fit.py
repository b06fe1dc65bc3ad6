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
            model.progress(g, 0, length, finished=True)
        else:
            model.progress(g, 0, chunk, finished=False)


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
    probes = [(math.log(s[0][0]), s[0][1]) for s in model.samples.values()]
    naive_mean, naive_sd = censored_normal_fit([y for y, done in probes if done], [y for y, done in probes if not done])
    assert naive_sd < 0.85  # the scenario does bias a fit without the horizon


def test_no_fit_before_enough_probes_finished_or_while_many_have_not_reported():
    model = RolloutLengths(max_tokens=100_000, num_groups=100)
    for g in range(FIT_MIN_PROBES - 1):
        model.progress(g, 0, 50 + g, finished=True)
    for g in range(FIT_MIN_PROBES - 1, 95):
        model.progress(g, 0, 4096, finished=False)
    assert not model.refit()  # too few finished
    model.progress(95, 0, 70, finished=True)
    assert model.refit()
    late = RolloutLengths(max_tokens=100_000, num_groups=100)
    for g in range(80):  # 20 probes have not returned a chunk yet: they may be the long ones
        late.progress(g, 0, 50 + g, finished=True)
    assert not late.refit()
    assert (late.sb, late.sw) == (PRIOR_SB, PRIOR_SW)


def test_a_probe_cut_by_the_budget_counts_as_censored_there():
    model = RolloutLengths(max_tokens=1000, num_groups=1)
    model.progress(0, 0, 1000, finished=True)
    assert model.samples[0][0] == (1000, True, False)


def test_the_within_group_spread_reads_each_group_up_to_its_own_horizon():
    """Groups whose short samples finished while their long ones still read their last
    chunk's end: the fit, each group read up to its least-advanced running sample, finds
    the true spread; the groups whose samples all finished (the short ones) read it short."""
    rng = random.Random(9)
    model = RolloutLengths(max_tokens=1 << 30, num_groups=300, group_size=8)
    complete = []
    for g in range(300):
        mean = rng.gauss(8.0, 0.5)
        logs = [rng.gauss(mean, 0.6) for _ in range(8)]
        progress = rng.uniform(1000, 3000)  # into the second chunk of 2,048 tokens
        for i, y in enumerate(logs):
            length = round(math.exp(y))
            done = length <= 2048 + progress
            model.progress(g, i, length if done else 2048 if length > 2048 else length, finished=done)
        if all(round(math.exp(y)) <= 2048 + progress for y in logs):
            complete.append(logs)
    assert abs(model.within() - 0.6) < 0.05
    pooled = sum(sum((y - sum(c) / 8) ** 2 for y in c) for c in complete) / (7 * len(complete))
    assert math.sqrt(pooled) < 0.55  # what the complete groups alone say


def test_no_within_group_spread_until_enough_groups_have_reported_every_sample():
    model = RolloutLengths(max_tokens=100_000, num_groups=20, group_size=4)
    for g in range(20):
        for i in range(3):  # one sample of every group has not reported yet
            model.progress(g, i, 100 * (i + 1), finished=True)
    assert model.within() is None


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
    # Chunks throughout: whole samples (``chunking = "auto"`` once the KV holds the rest)
    # report nothing until they finish, and the fit reads running samples at chunk edges too.
    config = SchedulerConfig(policy="context", chunk_size_tokens=512, chunking="always")
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
