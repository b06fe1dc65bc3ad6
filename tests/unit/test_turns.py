"""Trajectories on the pure scheduler core (``controlplane/turns.py``): a turn end parks the
request until its environment answers, the answer is appended with loss mask 0, the
limits end a trajectory with their own reasons, and the ``sticky`` baseline keeps a
trajectory's later turns on its first engine while ``request`` re-routes every turn."""

from __future__ import annotations

import pytest

from seer.controlplane import turns
from seer.controlplane.scheduler import SchedulerError
from seer.controlplane.state import RequestState
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import ChatMessage, TrajectorySpec, TurnInput
from tests.unit.chunks import finished
from tests.unit.test_chunked_policies import rollout, scheduler

TOK = ByteTokenizer()


def trajectory_rollout(policy: str, samples: int = 1, max_turns: int = 4, max_total: int | None = None,
                       rid: str = "r"):
    r = rollout(policy, [[10] * samples], max_tokens=8, rid=rid)
    for q in r.groups[0].requests:
        q.trajectory = turns.new_trajectory(TrajectorySpec(max_turns=max_turns, max_total_tokens=max_total), 512)
    return r


def reply(request, outcome: str = "continue", content: str = "out", **kw) -> TurnInput:
    t = request.trajectory
    return TurnInput(call_id="c", rollout_id=request.group.rollout.rollout_id, group_index=0,
                     sample_index=request.sample_index, turn=len(t.turns) - 1, outcome=outcome,
                     messages=[ChatMessage(role="tool", content=content)] if outcome == "continue" else [], **kw)


def end_turn(sched, d, tokens: list[int], reason: str = "stop"):
    return sched.chunk_finished(finished(d.engine_id, d.task.task_id, tokens, [-0.5] * len(tokens), reason))


def test_a_turn_end_waits_for_the_environment_then_goes_on_with_the_answer_appended():
    sched = scheduler("request")
    r = trajectory_rollout("request")
    sched.submit(r)
    [d] = sched.schedule()
    q = d.request
    done = end_turn(sched, d, [7, 8, TOK.EOS])
    assert done.turn_ended and not done.sample_finished and q.state is RequestState.TOOL_WAIT
    assert sched.schedule() == []  # nothing to run while it waits
    assert turns.answer(q, reply(q), TOK, TOK.vocab_size) is None
    appended = TOK.encode_turn_suffix([ChatMessage(role="tool", content="out")], ended_with_eos=True)
    assert q.generated_token_ids == [7, 8, TOK.EOS] + appended
    assert turns.loss_mask(q) == [1, 1, 1] + [0] * len(appended)
    assert q.logprobs[3:] == [0.0] * len(appended)
    sched.resume(q)
    [d2] = sched.schedule()
    assert d2.request is q and d2.task.sampling.max_tokens == 8  # a fresh turn budget
    end_turn(sched, d2, [9] * 8, "length")  # the turn's whole budget
    turns.answer(q, reply(q, "done", reward=1.0), TOK, TOK.vocab_size)
    done = sched.end_trajectory(q, "stop")
    assert done.rollout_finished is r
    assert [(t.start, t.end, t.outcome) for t in q.trajectory.turns] == [(0, 3, "continue"),
                                                                       (3 + len(appended), 11 + len(appended), "done")]
    assert q.trajectory.reward == 1.0


def test_sticky_keeps_later_turns_on_their_engine_request_reroutes_them():
    """Sample 0's first turn ran on engine 0; while it waited, engine 0 took two more
    samples and engine 1 has one: its next turn stays on engine 0 under ``sticky`` and
    goes to the less loaded engine 1 under ``request``."""
    for policy, expected in (("sticky", 0), ("request", 1)):
        sched = scheduler(policy)
        r = trajectory_rollout(policy, samples=2, rid=policy)
        sched.submit(r)
        d0, d1 = sched.schedule()
        assert (d0.engine_id, d1.engine_id) == (0, 1)
        end_turn(sched, d0, [7])
        q = d0.request
        sched.submit(rollout(policy, [[10, 10]], rid=f"{policy}-other"))
        assert [d.engine_id for d in sched.schedule()] == [0, 0]  # loads (0, 1) -> (1, 1) -> (2, 1)
        turns.answer(q, reply(q), TOK, TOK.vocab_size)
        sched.resume(q)
        [d] = sched.schedule()
        assert d.request is q and d.engine_id == expected, policy


def test_the_limits_end_a_trajectory_with_their_own_reasons():
    sched = scheduler("request")
    r = trajectory_rollout("request", samples=4, max_turns=2, max_total=60)
    sched.submit(r)
    ds = sched.schedule()
    for d in ds:
        end_turn(sched, d, [7, 7])
    q0, q1, q2, q3 = (d.request for d in ds)
    assert turns.answer(q0, reply(q0, "tool_error", error="boom"), TOK, TOK.vocab_size) == "tool_error"
    assert turns.answer(q1, reply(q1, "tool_timeout"), TOK, TOK.vocab_size) == "tool_timeout"
    assert turns.answer(q2, reply(q2, content="x" * 100), TOK, TOK.vocab_size) == "context_budget"
    assert "60-token budget" in q2.trajectory.turns[-1].error
    assert turns.answer(q3, reply(q3), TOK, TOK.vocab_size) is None  # turn 2 of 2 may run
    sched.resume(q3)
    [d] = sched.schedule()
    end_turn(sched, d, [7])
    assert turns.limit_reached(q3) == "max_turns"
    assert turns.answer(q3, reply(q3), TOK, TOK.vocab_size) == "max_turns"
    assert q3.generated_token_ids[-1] == 7  # nothing appended after the last turn


def test_out_of_vocabulary_answers_and_resuming_a_running_request_are_refused():
    sched = scheduler("request")
    r = trajectory_rollout("request")
    sched.submit(r)
    [d] = sched.schedule()
    with pytest.raises(SchedulerError):
        sched.resume(d.request)
    end_turn(sched, d, [7])
    q = d.request
    assert turns.answer(q, reply(q), TOK, vocab_size=10) == "bad_tool_output"
    assert "outside the vocabulary" in q.trajectory.turns[-1].error


def test_a_cancelled_rollout_drops_its_waiting_trajectories():
    sched = scheduler("divided")
    r = trajectory_rollout("divided", samples=3)
    sched.submit(r)
    ds = sched.schedule()
    end_turn(sched, ds[0], [7])
    assert ds[0].request.state is RequestState.TOOL_WAIT
    aborts = sched.cancel("r")
    assert sorted(t for a in aborts for t in a.task_ids) == sorted(d.task.task_id for d in ds[1:])
    assert sched.num_waiting() == 0 and "r" not in sched.rollouts
    assert turns.waiting_request(r, reply(ds[0].request)) is not None  # the caller checks the rollout first


def test_context_estimates_a_later_turn_by_the_whole_trajectory_and_its_chunk_by_the_turn():
    """Past its first turn a trajectory has generated more than one turn's ``max_tokens``:
    its ranking estimate still runs to its context budget (the work left in all its turns)
    and its next chunk's expected use to what the turn allows, never the 1 token a cap of
    ``max_tokens`` alone would leave (every later-turn chunk reserved at context + 1)."""
    sched = scheduler("context")
    r = trajectory_rollout("context", samples=2)
    sched.submit(r)
    policy = sched.policy("context")
    for d in sched.schedule():
        end_turn(sched, d, [7] * 8, "length")
        q = d.request
        assert turns.answer(q, reply(q, content="x" * 30), TOK, TOK.vocab_size) is None
        assert q.num_generated_tokens > q.sampling.max_tokens
        _, rank, (use, _), _ = policy._estimated(q)
        assert rank > q.remaining_tokens
        assert 1.0 < use <= q.remaining_tokens
