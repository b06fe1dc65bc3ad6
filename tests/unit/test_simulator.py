"""The rollout simulator (real scheduler core + engine models) and the workload traces."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest

from seer.config import SchedulerConfig
from seer.controlplane.policies import POLICIES
from seer.controlplane.policies.base import Assignment
from seer.controlplane.policies.group import GroupRoundRobinPolicy
from seer.controlplane.state import EngineView, Request, RequestState
from seer.sim.engine_model import CostModel
from seer.sim.simulator import Simulation, SimulationStalled, simulate
from seer.sim.workloads import (
    PAPER_WORKLOADS,
    Trace,
    TraceGroup,
    generate_trace,
    length_icc,
    load_rollout_jsonl,
    paper_trace,
)

UNIT = CostModel(a=1.0, b=0.0, c=0.0, p=0.0, pool_s_per_token=0.0)
SMALL = CostModel(a=1.0, b=0.0625, c=0.001, p=0.01, pool_s_per_token=0.001)


class AlternatingChunksPolicy(GroupRoundRobinPolicy):
    """Test policy: chunks of ``CHUNK`` tokens, each on the other engine than the last
    (the group baseline's request buffer, its own assignment)."""

    name = "test-alternating"
    uses_kv_pool = True  # it chunks and migrates: its chunks' KV goes through the pool
    CHUNK = 16

    def assign(self, engines: list[EngineView], limit: int = sys.maxsize) -> list[Assignment]:
        out = []
        for request in list(self._buffer.requests()):
            self._buffer.remove(request)
            engine = engines[(request.sample_index + request.num_chunks) % len(engines)]
            out.append(Assignment(request, engine.engine_id, min(self.CHUNK, request.remaining_tokens)))
        return out


class NeverPolicy(AlternatingChunksPolicy):
    """Test policy that holds every request forever."""

    name = "test-never"

    def assign(self, engines: list[EngineView], limit: int = sys.maxsize) -> list[Assignment]:
        return []


def small_trace(seed: int = 7) -> Trace:
    return generate_trace("small", num_groups=12, group_size=4, max_tokens=200, mean_tokens=60,
                          prompt_tokens=20, icc=0.5, seed=seed)


# ---------------------------------------------------------------------------- simulator


def test_hand_computed_schedule_is_reproduced_exactly():
    """1 engine, 1 s per step, 1-sample groups of 3 and 5 tokens: finishes at 3 s and 5 s, 8 tokens in 5 s."""
    trace = Trace("tiny", (TraceGroup(prompt_tokens=1, max_tokens=10, output_tokens=(3,)),
                           TraceGroup(prompt_tokens=1, max_tokens=10, output_tokens=(5,))))

    result = simulate(trace, "group", num_engines=1, cost=UNIT, kv_capacity_tokens=100)

    assert result.sample_finish_s == [[3.0], [5.0]]
    assert result.makespan_s == 5.0
    assert result.throughput_tokens_per_s == 8 / 5
    assert result.num_output_tokens == 8 and result.num_requests == 2
    assert (result.num_chunks, result.num_migrations, result.num_preemptions) == (2, 0, 0)
    assert result.engine_busy_pct == [100.0] and result.engine_idle_pct == [0.0]
    assert result.timeline == {0: [(0.0, 3.0, 0), (0.0, 5.0, 1)]}


def test_group_policy_deals_groups_round_robin_and_idles_the_engine_with_short_groups():
    """Under `group`, engine 0 gets groups 0, 2, 4 and engine 1 groups 1, 3; the short engine then idles."""
    lengths = [(10, 4), (2, 2), (6, 1), (3, 3), (5, 5)]
    trace = Trace("rr", tuple(TraceGroup(1, 100, group) for group in lengths))

    result = simulate(trace, "group", num_engines=2, cost=UNIT, kv_capacity_tokens=1000)

    assert result.sample_finish_s == [[float(n) for n in group] for group in lengths]  # all run from t=0
    groups_by_engine = {e: sorted({g for _, _, g in spans}) for e, spans in result.timeline.items()}
    assert groups_by_engine == {0: [0, 2, 4], 1: [1, 3]}
    assert result.engine_busy_pct == [100.0, 30.0]
    assert result.tail_time_s == 10.0 - 6.0  # 90 % of 10 samples: from the 9th finish to the 10th


def test_every_request_finishes_exactly_once_with_its_true_length():
    """Across chunks, migrations and preemptions each sample ends once, with its trace length and reason."""
    trace = small_trace()
    capacity = 2 * max(g.prompt_tokens + g.max_tokens for g in trace.groups)  # tight: forces preemption
    sim = Simulation(trace, "group", 2, SMALL, capacity, None, 0, 256)

    result = sim.run()

    requests = [r for g in sim.rollout.groups for r in g.requests]
    assert len(requests) == trace.num_requests == result.num_requests
    assert sim.rollout.num_samples_done == len(requests) and sim.rollout.done
    for group, trace_group in zip(sim.rollout.groups, trace.groups, strict=True):
        for request, length in zip(group.requests, trace_group.output_tokens, strict=True):
            assert request.state is RequestState.FINISHED
            assert request.num_generated_tokens == length
            assert request.finish_reason == ("length" if length == trace_group.max_tokens else "stop")
    assert result.num_output_tokens == trace.num_output_tokens
    assert result.num_preemptions > 0
    assert sum(len(spans) for spans in result.timeline.values()) == result.num_chunks == len(requests)


def test_chunked_policy_migrates_and_pulls_kv_from_the_pool_instead_of_reprefilling(monkeypatch):
    """Alternating engines per 16-token chunk: true lengths kept, migrations counted, no re-prefill."""
    monkeypatch.setitem(POLICIES, AlternatingChunksPolicy.name, AlternatingChunksPolicy)
    trace = small_trace()
    sim = Simulation(trace, AlternatingChunksPolicy.name, 2, SMALL, 100_000, None, 0, 256)

    result = sim.run()

    chunks = [math.ceil(n / AlternatingChunksPolicy.CHUNK) for g in trace.groups for n in g.output_tokens]
    assert result.num_chunks == sum(chunks)
    assert result.num_migrations == sum(c - 1 for c in chunks)
    assert [r.num_generated_tokens for g in sim.rollout.groups for r in g.requests] == [
        n for g in trace.groups for n in g.output_tokens]
    # Each group's prompt is prefilled once per engine (siblings share it), never re-prefilled.
    assert sum(e.num_prefill_tokens for e in sim.engines) == sum(2 * g.prompt_tokens for g in trace.groups)
    assert sum(e.num_pool_tokens for e in sim.engines) > 0
    assert result.num_preemptions == 0


def test_same_inputs_give_the_same_result_and_the_seed_changes_the_trace():
    """Two runs of one seeded trace are equal in every field; another seed gives another trace and result."""
    capacity = 600
    first = simulate(small_trace(seed=1), "group", 3, SMALL, capacity, seed=5)
    second = simulate(small_trace(seed=1), "group", 3, SMALL, capacity, seed=5)
    other = simulate(small_trace(seed=2), "group", 3, SMALL, capacity, seed=5)

    assert first == second
    assert first.num_preemptions > 0  # the runs exercised the preemption path too
    assert small_trace(seed=1) != small_trace(seed=2) and other != first


def test_a_policy_that_dispatches_nothing_is_reported_not_looped_on(monkeypatch):
    """No engine running and nothing dispatched while work remains raises SimulationStalled."""
    monkeypatch.setitem(POLICIES, NeverPolicy.name, NeverPolicy)
    with pytest.raises(SimulationStalled, match="48 requests wait"):
        simulate(small_trace(), NeverPolicy.name, 2, SMALL, 10_000)


def test_kv_capacity_below_the_longest_sequence_is_refused_up_front():
    """A capacity that cannot hold prompt + max_tokens is a ValueError that names the number needed."""
    with pytest.raises(ValueError, match="raise it above 220"):
        simulate(small_trace(), "group", 2, SMALL, 200)


def test_requests_carry_their_oracle_length_when_the_state_has_that_field():
    """If Request has `oracle_length`, every request carries its true length there; else nothing is added."""
    trace = small_trace()
    sim = Simulation(trace, "group", 1, SMALL, 10_000, None, 0, 256)
    has_field = "oracle_length" in {f.name for f in dataclasses.fields(Request)}
    requests = [r for g in sim.rollout.groups for r in g.requests]
    lengths = [n for g in trace.groups for n in g.output_tokens]
    if has_field:
        assert [r.oracle_length for r in requests] == lengths
    else:
        assert not any(hasattr(r, "oracle_length") for r in requests)


# ---------------------------------------------------------------------------- workloads


def test_generated_lengths_respect_the_budget_and_roughly_the_mean():
    """Lengths stay in [1, max_tokens], the mean is within 10 % of the target, and the tail is heavy."""
    trace = generate_trace("t", num_groups=500, group_size=8, max_tokens=65536, mean_tokens=22386,
                           prompt_tokens=100, icc=0.5, seed=0)
    lengths = sorted(n for g in trace.groups for n in g.output_tokens)

    assert trace.num_requests == 4000 and trace.max_tokens == 65536
    assert 1 <= lengths[0] and lengths[-1] <= 65536
    assert trace.mean_output_tokens == pytest.approx(22386, rel=0.10)
    assert lengths[len(lengths) // 2] < trace.mean_output_tokens  # median below mean: right-skewed
    assert all(g.prompt_tokens == 100 for g in trace.groups)


def test_icc_knob_controls_how_alike_a_groups_lengths_are():
    """Intra-class correlation of the lengths is high with icc=0.8 and near zero with icc=0.0."""
    def icc_of(icc: float) -> float:
        return length_icc(generate_trace("t", 300, 8, 10_000, 2_000, 10, icc=icc, seed=3))

    low, high = icc_of(0.0), icc_of(0.8)
    assert high > 0.5 and abs(low) < 0.1 and high > low + 0.4


def test_paper_presets_scale_requests_and_lengths_together():
    """moonlight at scale 0.1 is 40 groups x 8 with lengths up to 6,554 and a mean near 2,239."""
    full = PAPER_WORKLOADS["moonlight"]
    trace = paper_trace("moonlight", scale=0.1, seed=1)

    assert (full.num_groups, full.group_size) == (400, 8)
    assert len(trace.groups) == 40 and trace.num_requests == 320
    assert trace.max_tokens == 6554
    assert trace.mean_output_tokens == pytest.approx(2238.6, rel=0.2)
    assert paper_trace("moonlight", scale=0.1, seed=1) == trace
    with pytest.raises(ValueError, match="available"):
        paper_trace("llama")


def test_rollout_jsonl_becomes_a_trace_ordered_by_group(tmp_path):
    """Result rows give groups by group_index, lengths = len(token_ids), max_tokens observed or given."""
    path = tmp_path / "rollout.jsonl"
    rows = [
        {"id": "b", "group_index": 1, "meta": {}, "samples": [
            {"token_ids": [5] * 7, "num_prompt_tokens": 12, "finish_reason": "length",
             "logprobs": [0.0] * 7}]},
        {"id": "a", "group_index": 0, "meta": {}, "samples": [
            {"token_ids": [5, 6, 2], "num_prompt_tokens": 9, "finish_reason": "stop"},
            {"token_ids": [7], "num_prompt_tokens": 9, "finish_reason": "stop"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")

    trace = load_rollout_jsonl(path)
    assert trace.name == "rollout"
    assert trace.groups == (TraceGroup(9, 7, (3, 1)), TraceGroup(12, 7, (7,)))
    assert load_rollout_jsonl(path, max_tokens=256).max_tokens == 256
    with pytest.raises(ValueError, match="more than max_tokens=5"):
        load_rollout_jsonl(path, max_tokens=5)
    (tmp_path / "bad.jsonl").write_text('{"group_index": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_rollout_jsonl(tmp_path / "bad.jsonl")


def test_hand_computed_chunked_schedules_are_reproduced_exactly():
    """1 engine that admits one 2-token chunk at a time, 1 s per step; groups (3, 1) and (2, 4).
    context: probes' first chunks first, then the highest remaining-length quantile (capped by
    the budget of 10 here, so max_tokens - generated; ties: lower group); divided: FCFS with
    returning chunks at the back. Finish times worked out by hand."""
    trace = Trace("tiny", (TraceGroup(prompt_tokens=1, max_tokens=10, output_tokens=(3, 1)),
                           TraceGroup(prompt_tokens=1, max_tokens=10, output_tokens=(2, 4))))

    def run(policy: str):
        config = SchedulerConfig(policy=policy, chunk_size_tokens=2, starvation_interval=0)
        return simulate(trace, policy, num_engines=1, cost=UNIT, kv_capacity_tokens=12, scheduler_config=config)

    context = run("context")
    # probes' first chunks g0/0 0-2, g1/0 2-4 (stop). Left: g0/1 and g1/1 10, g0/0 8:
    # g0/1 4-5 (stop), g1/1 5-7; then g0/0 and g1/1 8 each, group 0 first: g0/0 7-8 (stop), g1/1 8-10
    assert context.sample_finish_s == [[8.0, 5.0], [4.0, 10.0]]
    divided = run("divided")
    # g0/0 0-2, g0/1 2-3, g1/0 3-5, g1/1 5-7, g0/0 7-8, g1/1 8-10
    assert divided.sample_finish_s == [[8.0, 3.0], [5.0, 10.0]]
    for result in (context, divided):
        assert (result.num_chunks, result.num_output_tokens, result.makespan_s) == (6, 10, 10.0)
        assert result.num_preemptions == 0 and result.engine_busy_pct == [100.0]


def test_iterations_share_the_scheduler_and_the_prior_learns_from_the_first():
    """simulate_iterations runs rollouts of the same prompts on one scheduler; with the
    length prior the second rollout's groups start from the first one's lengths."""
    from seer.sim.simulator import placeholder_prompt, simulate_iterations
    from seer.sim.workloads import generate_iterations

    traces = generate_iterations("it", 2, num_groups=6, group_size=4, max_tokens=200, mean_tokens=60,
                                 prompt_tokens=20, icc=0.5, seed=3, persistence=0.8)
    config = SchedulerConfig(policy="context", chunk_size_tokens=32)
    results = simulate_iterations(traces, "context", 2, SMALL, 2000, config, length_prior=True)
    assert [r.num_output_tokens for r in results] == [t.num_output_tokens for t in traces]
    assert placeholder_prompt(5, 20) != placeholder_prompt(6, 20) and len(placeholder_prompt(5, 20)) == 20
    with pytest.raises(ValueError, match="no length prior"):
        simulate_iterations(traces, "divided", 2, SMALL, 2000, config, length_prior=True)
