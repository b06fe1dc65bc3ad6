"""Trajectories in the simulator (``sim/agentic.py``): the environment's tool waits in
virtual time, the KV a trajectory's next turn finds (its engine's prefix cache, the host
pool) or recomputes, ``sticky`` against ``request``, and every trajectory running exactly
its traced turns."""

from __future__ import annotations

import random

import pytest

from seer.config import SchedulerConfig
from seer.sim.agentic import (AgenticGroup, AgenticSimulation, AgenticTrace, Turn, agentic_trace, alone_s,
                              scale_trace)
from seer.sim.engine_model import CostModel

# One second per decode step, whatever the batch; prefill and pool loads priced per token.
STEP = CostModel(a=1.0, b=0.0, c=0.0, p=0.01, pool_s_per_token=0.001)


def sim(trace: AgenticTrace, policy: str = "request", engines: int = 1, kv: int = 100_000, **kw) -> AgenticSimulation:
    return AgenticSimulation(trace, policy, engines, kw.pop("cost", STEP), kv, SchedulerConfig(policy=policy), 0,
                             block_tokens=kw.pop("block_tokens", 1), **kw)


def two(a: tuple[Turn, ...], b: tuple[Turn, ...], prompt: int = 4, max_context: int = 1000) -> AgenticTrace:
    """Trajectory a (group 0) and b (group 1), one sample each."""
    return AgenticTrace("t", (AgenticGroup(prompt, (a,)), AgenticGroup(prompt, (b,))), max_context)


def spans_of(s: AgenticSimulation, group: int) -> list[tuple[float, float]]:
    return [(x.start_s, x.end_s) for x in s.spans if x.group_id.endswith(f"/{group}")]


def test_a_tool_wait_leaves_the_engine_to_another_trajectory():
    """A waits 5 s after its first turn; B (a 0.1 s tool) runs its long second turn in that
    wait; A's answer is appended and its second turn joins the running batch at the next step."""
    s = sim(two((Turn(10, 5.0, 20), Turn(10, 0.0, 0)), (Turn(10, 0.1, 20), Turn(400, 0.0, 0))))
    r = s.run()
    a, b = spans_of(s, 0), spans_of(s, 1)
    assert a[0] == b[0] == (0.0, pytest.approx(10.08))  # both prompts prefilled (8 x 0.01 s), then 10 steps
    assert b[1][0] == pytest.approx(10.18)  # B's second turn starts in A's tool wait
    # B's steps end at 10.18 + 0.21 (its answer + last token prefilled) + k: A's answer (at
    # 15.08) joins at the next boundary, prefills its 21 new tokens and decodes 10.
    assert a[1] == (pytest.approx(15.39), pytest.approx(15.39 + 0.21 + 10))
    assert r.makespan_s == pytest.approx(b[1][1])
    assert alone_s(s.trace, STEP) == pytest.approx(0.04 + 10 + 0.1 + 0.21 + 400)  # B alone, A not prefilled with it
    [qa], [qb] = (g.requests for g in s.rollout.groups)
    assert qa.trajectory.turns[0].tool_s == 5.0 and qa.trajectory.turns[0].appended_tokens == 20
    assert qa.finished_s == pytest.approx(a[1][1]) and qa.finish_reason == "stop"
    assert [(t.prefilled_tokens, t.reused_tokens) for t in qa.trajectory.turns] == [(4, 0), (21, 14 - 1)]
    # The engine idled only while both waited (10.08 -> 10.18): its KV stayed, nothing was recomputed.
    assert r.engine_idle_frac == pytest.approx(0.1 / r.makespan_s)
    assert r.recomputed_tokens == 0 and r.sampled_tokens == 10 + 10 + 10 + 400


@pytest.mark.parametrize("policy,pool", [("request", False), ("divided", True), ("request", True)])
def test_a_turn_whose_kv_was_evicted_recomputes_it_unless_the_pool_kept_it(policy, pool):
    """A's first turn (104 tokens of context) ends and its tool takes 500 s; B's long second
    turn fills the engine's 500 tokens of KV, so A's cached KV is evicted. A's next turn
    then prefills its whole context (without the pool) or loads it from the pool. A
    baseline (``request``) runs without the pool whether the cluster has one or not."""
    trace = two((Turn(100, 500.0, 20), Turn(10, 0.0, 0)), (Turn(10, 0.1, 20), Turn(400, 0.0, 0)), max_context=450)
    s = sim(trace, policy, kv=500, pool=pool)
    pool = pool and policy != "request"
    r = s.run()
    qa = s.rollout.groups[0].requests[0]
    first, second = qa.trajectory.turns
    new = first.appended_tokens + 1  # the answer and A's last sampled token: computed by no engine yet
    assert second.prefilled_tokens - second.recomputed_tokens == new
    if pool:
        assert second.recomputed_tokens == 0 and r.pool_loaded_tokens == 100 - 1  # its own KV but its last token
    else:
        # Its own 100 tokens are recomputed (its 4-token prompt stayed cached: the LRU evicted A's own KV first).
        assert second.recomputed_tokens == 100 - 1 and r.pool_loaded_tokens == 0
    assert r.recomputed_tokens == s.rollout.num_recomputed_tokens == sum(
        t.recomputed_tokens for g in s.rollout.groups for q in g.requests for t in q.trajectory.turns)
    kept = sim(trace, policy, kv=100_000, pool=False).run()  # room for both: the engine's cache keeps A's KV
    assert kept.recomputed_tokens == 0 and kept.pool_loaded_tokens == 0
    if policy == "request":  # one whole request per turn: the same schedule but for A's recompute or load
        assert kept.makespan_s <= r.makespan_s


def test_partly_filled_blocks_are_recomputed():
    """With 16-token blocks a kept context counts only its full blocks: the rest of the last
    one is prefilled again (as vLLM's prefix cache does), and counted as recomputed."""
    s = sim(AgenticTrace("t", (AgenticGroup(4, ((Turn(30, 1.0, 20), Turn(10, 0.0, 0)),)),), 1000), block_tokens=16)
    r = s.run()
    second = s.rollout.groups[0].requests[0].trajectory.turns[1]
    context_before = 4 + 30  # cached: 32 of them (two blocks); the last 2 are computed again
    assert second.recomputed_tokens == context_before - 32 - 1 == r.recomputed_tokens
    assert second.prefilled_tokens == 20 + 1 + 1


def random_trace(seed: int, groups: int = 3, group_size: int = 2, template: int = 3) -> AgenticTrace:
    rng = random.Random(seed)
    data = {"trajectories": [[[{"decode": rng.randint(5, 40), "tool_s": round(rng.uniform(0.1, 4.0), 3),
                                "tool_tokens": rng.randint(5, 60)} for _ in range(rng.randint(1, 5))]
                              for _ in range(group_size)] for _ in range(groups)],
            "prompt_tokens": 12, "template_tokens": template, "max_context": 1024}
    for group in data["trajectories"]:
        for turns in group:
            turns[-1]["tool_s"], turns[-1]["tool_tokens"] = 0.0, 0
    return agentic_trace(data)


def test_sticky_keeps_every_turn_on_its_first_engine_request_moves_them():
    """A and C start on engine 0, B on engine 1. A's tool answers at once, B's after 100 s:
    when A goes on, engine 0 still runs C and engine 1 is free. ``request`` sends A's next
    turn to engine 1 (and, without a pool, recomputes its context there); ``sticky`` keeps it
    on engine 0, where its KV is."""
    a, b, c = (Turn(5, 0.1, 10), Turn(5, 0.0, 0)), (Turn(5, 100.0, 10), Turn(5, 0.0, 0)), (Turn(300, 0.0, 0),)
    trace = AgenticTrace("t", tuple(AgenticGroup(4, (x,)) for x in (a, b, c)), 1000)
    engines_of = {}
    for policy in ("sticky", "request"):
        s = sim(trace, policy, engines=2, pool=False)
        r = s.run()
        qa = s.rollout.groups[0].requests[0]
        engines_of[policy] = [t.engine_ids for t in qa.trajectory.turns]
        assert r.engine_switches == (0 if policy == "sticky" else 1)
        assert r.recomputed_tokens == (0 if policy == "sticky" else 4 + 5 - 1)  # moved: its prompt and first turn again
    assert engines_of == {"sticky": [[0], [0]], "request": [[0], [1]]}
    trace = random_trace(1, groups=4, group_size=2)
    s = sim(trace, "sticky", engines=2)
    r = s.run()
    assert r.engine_switches == 0
    for q in (q for g in s.rollout.groups for q in g.requests):
        assert len({e for t in q.trajectory.turns for e in t.engine_ids}) == 1 and len(q.engine_history) == 1
    assert {q.engine_history[0] for g in s.rollout.groups for q in g.requests} == {0, 1}


@pytest.mark.parametrize("policy", ["sticky", "request", "divided", "context", "group"])
@pytest.mark.parametrize("pool", [True, False])
def test_every_trajectory_runs_exactly_its_traced_turns(policy, pool):
    trace = random_trace(7)
    s = sim(trace, policy, engines=2, kv=3000, pool=pool, block_tokens=16,
            cost=CostModel.cpu_smollm2())
    r = s.run()
    assert r.num_trajectories == 6 and r.off_trace == 0 and r.finish_reasons == {"stop": 6}
    assert r.num_turns == trace.num_turns
    for group, trace_group in zip(s.rollout.groups, trace.groups):
        for q, turns in zip(group.requests, trace_group.samples):
            records = q.trajectory.turns
            assert [t.end - t.start for t in records] == [t.decode for t in turns]
            assert [t.appended_tokens for t in records] == [t.tool_tokens + 3 if t.tool_tokens else 0 for t in turns]
            assert [t.tool_s for t in records] == [t.tool_s for t in turns]
            assert [t.outcome for t in records] == ["continue"] * (len(turns) - 1) + ["done"]
            assert q.context_tokens == 12 + sum(t.decode + (t.tool_tokens + 3 if t.tool_tokens else 0) for t in turns)
    assert r.sampled_tokens == sum(t.decode for tr in trace.trajectories for t in tr)
    assert r.makespan_s >= alone_s(trace, CostModel.cpu_smollm2()) > max(sum(t.tool_s for t in tr)
                                                                         for tr in trace.trajectories)
    again = sim(trace, policy, engines=2, kv=3000, pool=pool, block_tokens=16, cost=CostModel.cpu_smollm2()).run()
    assert (again.makespan_s, again.recomputed_tokens, again.engine_switches) == \
        (r.makespan_s, r.recomputed_tokens, r.engine_switches)


def test_scaling_and_reading_a_trace():
    trace = random_trace(3)
    big = scale_trace(trace, tokens=4, seconds=10)
    assert big.max_context == 4 * trace.max_context and big.template_tokens == trace.template_tokens
    assert [t.decode for t in big.trajectories[0]] == [4 * t.decode for t in trace.trajectories[0]]
    assert [t.tool_s for t in big.trajectories[0]] == pytest.approx([10 * t.tool_s for t in trace.trajectories[0]])
    with pytest.raises(ValueError, match="tool_tokens >= 1"):
        agentic_trace({"trajectories": [[[{"decode": 3, "tool_s": 1.0, "tool_tokens": 0},
                                          {"decode": 3, "tool_s": 0.0, "tool_tokens": 0}]]]})
    with pytest.raises(ValueError, match="non-empty"):
        agentic_trace({"trajectories": []})


def test_the_pool_gives_back_a_partial_block_when_min_load_tokens_allows():
    """Back on its own engine, a turn finds its context in the prefix cache in whole blocks
    only. With ``min_load_tokens`` at a block (the default) it computes the partly filled
    last block again; with 1 the pool gives those tokens back and nothing is recomputed."""
    trace = two((Turn(100, 1.0, 20), Turn(10, 0.0, 0)), (Turn(10, 0.0, 0),))
    by_block = sim(trace, "divided", block_tokens=32).run()
    to_token = sim(trace, "divided", block_tokens=32, min_load_tokens=1).run()
    assert by_block.recomputed_tokens > 0 and by_block.pool_loaded_tokens == 0
    assert to_token.recomputed_tokens == 0 and to_token.pool_loaded_tokens == by_block.recomputed_tokens
