"""The rollout summary's baseline estimate: the simulator replays a finished rollout's
real lengths under its policy and under ``group`` (seer/sim/estimate.py)."""

from __future__ import annotations

from seer.client import RolloutResult
from seer.config import SchedulerConfig
from seer.protocol import GroupResult, RolloutStats, SampleResult
from seer.sim.estimate import against_baseline, trace_of


def result(policy: str, lengths: list[list[int]], prompt: int = 60) -> RolloutResult:
    groups = [GroupResult(group_index=gi, prompt_id=str(gi), samples=[
        SampleResult(sample_index=si, token_ids=[1] * n, logprobs=[0.0] * n, text="", finish_reason="stop",
                     num_prompt_tokens=prompt, first_scheduled_s=0.0, finished_s=1.0, engine_ids=[0])
        for si, n in enumerate(row)])
        for gi, row in enumerate(lengths)]
    n = sum(map(sum, lengths))
    stats = RolloutStats(policy=policy, num_groups=len(lengths), num_samples=sum(map(len, lengths)),
                         num_output_tokens=n, wall_time_s=1.0, throughput_tokens_per_s=float(n), tail_time_s=0.0,
                         num_preemptions=0, num_chunks=0, per_engine_output_tokens={})
    return RolloutResult(rollout_id="r", groups=groups, stats=stats, weights_version=0)


HEAVY = [[40] * 7 + [1000], [30] * 8, [900, 950, 20, 20, 20, 20, 20, 20], [25] * 8] * 2


def test_the_trace_carries_the_real_lengths_and_the_budget():
    """Group order, prompt lengths and every sample's length go into the trace; the budget
    is max_tokens, or the longest sample if one is longer."""
    trace = trace_of(result("context", [[3, 5], [7, 2]], prompt=11), max_tokens=6)
    assert [g.output_tokens for g in trace.groups] == [(3, 5), (7, 2)]
    assert {g.prompt_tokens for g in trace.groups} == {11} and {g.max_tokens for g in trace.groups} == {7}


def test_a_seer_policy_gets_a_ratio_against_group_from_the_same_lengths():
    """For context and divided the estimate is the simulated throughput ratio over group,
    positive and finite, computed with the cpu cost model; the same inputs give the same
    number (the simulator is deterministic)."""
    for policy in ("context", "divided"):
        args = dict(num_engines=2, kv_capacity_tokens=23_000, max_tokens=1024,
                    scheduler=SchedulerConfig(policy="context"))
        first = against_baseline(result(policy, HEAVY), **args)
        assert first is not None and first.baseline == "group" and first.cost_model == "cpu"
        assert 0.2 < first.ratio < 5.0
        assert against_baseline(result(policy, HEAVY), **args) == first


def test_no_estimate_for_the_baseline_itself_or_without_engines():
    """A group rollout has nothing to compare with; without engines there is no replay."""
    args = dict(kv_capacity_tokens=23_000, max_tokens=1024, scheduler=SchedulerConfig())
    assert against_baseline(result("group", HEAVY), num_engines=2, **args) is None
    assert against_baseline(result("context", HEAVY), num_engines=0, **args) is None
