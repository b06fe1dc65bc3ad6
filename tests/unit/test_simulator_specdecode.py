"""Speculative decoding in the simulator: the engine model at fractional rates, the
acceptance profiles, the planner's sibling counting, and whole simulated rollouts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel, SimEngineModel, SpecRowInfo
from seer.sim.specdecode import PROFILES, STUDY_SAME, SimSpecConfig, SimSpecPlanner, alpha_for_tokens
from seer.sim.simulator import simulate
from seer.specdecode import expected_tokens
from seer.sim.workloads import generate_trace, paper_trace

GPU = CostModel.gpu_h800_like()


class FixedRate:
    """A planner stub: every row at ``rate`` tokens per step, ``drafts`` per row."""

    def __init__(self, rate: float, drafts: int, replan_steps: int = 1000) -> None:
        self.rate, self.drafts, self.replan_steps = rate, drafts, replan_steps
        self.plans = 0

    def plan(self, engine_id: int, now: float, rows: Sequence[SpecRowInfo], cost: CostModel,
             context_tokens: float) -> tuple[list[float], int, float]:
        self.plans += 1
        return [self.rate] * len(rows), self.drafts * len(rows), 0.0


def run(engine: SimEngineModel) -> list[tuple[float, int, int, str]]:
    now, out = 0.0, []
    while not engine.idle:
        end = engine.begin(now)
        assert end is not None
        now = end
        out += [(now, f.task_id, f.num_tokens, f.finish_reason) for f in engine.commit()]
    return out


def test_engine_at_a_fractional_rate_finishes_on_the_right_step_with_exact_tokens() -> None:
    """100 tokens at 2.5 per step take 40 steps, each verifying 1 + 4 tokens; a chunk cut
    by max_tokens at 2.5 per step stops at exactly max_tokens."""
    cost = CostModel(a=1.0, b=0.25, c=0.0, p=0.0, pool_s_per_token=0.0)
    engine = SimEngineModel(0, cost, 10_000, spec=FixedRate(2.5, 4))
    engine.add(1, "r1", context_tokens=10, max_tokens=500, true_remaining_tokens=100)
    assert run(engine) == [(pytest.approx(40 * (1.0 + 0.25 * 5)), 1, 100, "stop")]
    engine = SimEngineModel(0, cost, 10_000, spec=FixedRate(2.5, 4))
    engine.add(1, "r1", context_tokens=10, max_tokens=33, true_remaining_tokens=100)
    ((_, _, tokens, reason),) = run(engine)
    assert (tokens, reason) == (33, "length")  # 14 steps reach 35: verification stops at 33
    assert engine.num_output_tokens == pytest.approx(33)
    assert engine.num_draft_tokens == 14 * 4 and engine.num_seq_steps == 14


def test_engine_replans_at_most_every_replan_steps() -> None:
    """Segments are capped so acceptance can move: 100 steps at replan 16 need 7 plans."""
    planner = FixedRate(1.0, 0, replan_steps=16)
    engine = SimEngineModel(0, GPU, 10_000, spec=planner)
    engine.add(1, "r1", context_tokens=10, max_tokens=500, true_remaining_tokens=100)
    ((_, _, tokens, _),) = run(engine)
    assert tokens == 100 and planner.plans == 7


def test_gamma_zero_reproduces_the_plain_simulation() -> None:
    """With speculation on but no drafts (rates of exactly one token) the rollout is the
    plain one: same tokens, chunks, preemptions; same makespan up to float rounding."""
    trace = generate_trace("t", num_groups=12, group_size=4, max_tokens=4096, mean_tokens=900,
                           prompt_tokens=256, icc=0.5, seed=3)
    for policy in ("group", "context"):
        config = SchedulerConfig(policy=policy, chunk_size_tokens=512)  # type: ignore[arg-type]
        plain = simulate(trace, policy, 3, GPU, 20_000, config)
        spec = simulate(trace, policy, 3, GPU, 20_000, config,
                        spec=SimSpecConfig(mode="fixed", gamma=0))
        assert spec.num_output_tokens == plain.num_output_tokens
        assert (spec.num_chunks, spec.num_preemptions) == (plain.num_chunks, plain.num_preemptions)
        assert spec.makespan_s == pytest.approx(plain.makespan_s, rel=1e-9)
        assert spec.tokens_per_seq_step == pytest.approx(1.0)


def test_profiles_reproduce_their_points_and_rise_with_siblings() -> None:
    """The profile returns its published points, interpolates between them, holds flat
    past the last, and α inverts E(α, 8)."""
    assert STUDY_SAME.tokens_per_step(0) == 1.69
    assert STUDY_SAME.tokens_per_step(3) == pytest.approx(1.82)
    assert 1.74 < STUDY_SAME.tokens_per_step(2) < 1.82
    assert STUDY_SAME.tokens_per_step(15) == 1.88
    assert STUDY_SAME.tokens_per_step(7, multipath=True) == 2.11
    for profile in PROFILES.values():
        values = [profile.tokens_per_step(k) for k in range(16)]
        assert values == sorted(values)
        assert all(profile.tokens_per_step(k, True) > profile.tokens_per_step(k) for k in range(16))
    alpha = alpha_for_tokens(1.88, 8)
    assert expected_tokens(alpha, 8) == pytest.approx(1.88)


def test_planner_counts_siblings_ahead() -> None:
    """A row's acceptance uses the siblings that are finished or further along."""
    planner = SimSpecPlanner(SimSpecConfig(mode="fixed", gamma=8), probes=set())
    planner.chunk_finished("g/0", "g", 300, complete=True)
    planner.chunk_finished("g/1", "g", 500, complete=False)
    planner.chunk_finished("g/2", "g", 100, complete=False)
    rows = [SpecRowInfo("g/3", "g", 200.0), SpecRowInfo("g/1", "g", 500.0), SpecRowInfo("h/0", "h", 50.0)]
    rates, drafts, _ = planner.plan(0, 0.0, rows, GPU, 10_000)
    assert drafts == 24
    # g/3 at 200: g/0 (complete) and g/1 (at 500) ahead; g/1: only g/0; h/0: alone.
    assert rates == [pytest.approx(expected_tokens(planner.alpha(k), 8)) for k in (2, 1, 0)]
    self_only = SimSpecPlanner(SimSpecConfig(mode="fixed", gamma=8, grouped=False), probes=set())
    self_only.chunk_finished("g/0", "g", 300, complete=True)
    rates, _, _ = self_only.plan(0, 0.0, rows, GPU, 10_000)
    assert rates == [pytest.approx(expected_tokens(self_only.alpha(0), 8))] * 3


def test_adaptive_switches_speculation_off_where_a_fixed_gamma_loses() -> None:
    """On a compute-bound engine (every token costs as much as the fixed step) a fixed
    γ = 4 slows the rollout down; the adaptive choice drafts almost nothing and does not."""
    compute_bound = CostModel(a=0.002, b=1e-3, c=0.0, p=1e-5, pool_s_per_token=0.0)
    trace = generate_trace("t", num_groups=16, group_size=8, max_tokens=4096, mean_tokens=1000,
                           prompt_tokens=128, icc=0.5, seed=1)
    config = SchedulerConfig(policy="context", chunk_size_tokens=1024)  # type: ignore[arg-type]
    plain = simulate(trace, "context", 2, compute_bound, 200_000, config)
    fixed = simulate(trace, "context", 2, compute_bound, 200_000, config, spec=SimSpecConfig(mode="fixed", gamma=4))
    adaptive = simulate(trace, "context", 2, compute_bound, 200_000, config, spec=SimSpecConfig())
    assert fixed.throughput_tokens_per_s < plain.throughput_tokens_per_s
    assert adaptive.throughput_tokens_per_s >= plain.throughput_tokens_per_s * 0.99
    assert adaptive.drafts_per_seq_step < 0.5 < fixed.drafts_per_seq_step


def test_speculation_ablation_order_on_a_small_paper_shaped_trace() -> None:
    """Memory-bound engines (the GPU preset): self-only SD beats none, grouped drafting
    accepts more than self-only, and every variant generates exactly the trace's tokens."""
    trace = paper_trace("moonlight", scale=0.05, seed=0)
    config = SchedulerConfig(policy="context", chunk_size_tokens=8192)  # type: ignore[arg-type]
    runs = {name: simulate(trace, "context", 2, GPU, 50_000, config, spec=spec) for name, spec in (
        ("none", None), ("vanilla", SimSpecConfig(mode="fixed", gamma=4, grouped=False)),
        ("grouped", SimSpecConfig(mode="fixed", gamma=4)), ("adaptive", SimSpecConfig()),
        ("multipath", SimSpecConfig(multipath=True)))}
    for r in runs.values():
        assert r.num_output_tokens == trace.num_output_tokens
    assert runs["vanilla"].throughput_tokens_per_s > runs["none"].throughput_tokens_per_s
    assert runs["grouped"].tokens_per_seq_step > runs["vanilla"].tokens_per_seq_step
    assert runs["grouped"].throughput_tokens_per_s > runs["vanilla"].throughput_tokens_per_s
    assert runs["multipath"].tokens_per_seq_step > runs["adaptive"].tokens_per_seq_step


def test_spec_config_rejects_unknown_profiles() -> None:
    """A typo in the profile name is an error naming the choices."""
    with pytest.raises(ValueError, match="study-same"):
        SimSpecConfig(profile="study")
