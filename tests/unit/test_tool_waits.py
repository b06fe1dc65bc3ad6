"""``context`` sees tool waits (``controlplane/policies/tool_waits.py``): tool latency learned
per tool name from answered turns, turns per trajectory from a group's ended trajectories,
a trajectory's expected waits to come added to its ranking as decode steps, and an ended
trajectory's length fed to its group's length model like any finished sample's."""

from __future__ import annotations

from seer.controlplane import turns
from seer.controlplane.policies.ordered import LENGTH_SPAN, _pack
from seer.controlplane.policies.tool_waits import ToolWaits, _Mean
from tests.unit.test_chunked_policies import scheduler
from tests.unit.test_turns import TOK, end_turn, reply, trajectory_rollout


class Runner:
    """Drives trajectories on a scheduler, keeping every dispatch until its request's turn."""

    def __init__(self, sched) -> None:
        self.sched, self.pending = sched, {}

    def dispatched(self, q):
        for d in self.sched.schedule():
            self.pending[d.request.request_id] = d
        return self.pending.pop(q.request_id)

    def turn(self, q, tool: str, seconds: float, tokens: int = 4) -> None:
        """``q`` samples ``tokens`` and stops; its environment answers after ``seconds`` with
        ``tool``, and it is queued again."""
        end_turn(self.sched, self.dispatched(q), [7] * (tokens - 1) + [TOK.EOS])
        assert turns.answer(q, reply(q, tool_name=tool, tool_s=seconds), TOK, TOK.vocab_size) is None
        self.sched.resume(q)


def test_latency_per_tool_name_and_turns_per_group_give_the_waits_to_come():
    sched = scheduler("context")
    r = trajectory_rollout("context", samples=3, max_turns=8)
    sched.submit(r)
    first, second, third = r.groups[0].requests
    run = Runner(sched)
    waits = ToolWaits()
    assert waits.wait_s(first) == 0.0  # nothing known of the group yet
    for tool, seconds in [("slow", 4.0), ("slow", 6.0), ("fast", 1.0)]:
        run.turn(first, tool, seconds)
        waits.answered(first)
    assert waits.latency["slow"].value == 5.0 and waits.latency["fast"].value == 1.0
    first.trajectory.turns.append(first.trajectory.turns[-1])  # as if it ran a 5th turn
    waits.ended(first)  # 5 turns
    run.turn(second, "slow", 5.0)
    waits.answered(second)
    # 5 turns expected, 2 run (one answered, one current): 3 more calls of its own tool.
    assert waits.wait_s(second) == 3 * 5.0
    # A trajectory that has called nothing yet expects every tool's mean per call.
    assert waits.wait_s(third) == 4 * (4.0 + 6.0 + 1.0 + 5.0) / 4


def test_context_ranks_a_trajectory_by_its_tokens_and_its_waits_to_come():
    sched = scheduler("context")
    r = trajectory_rollout("context", samples=2, max_turns=8)
    sched.submit(r)
    policy = sched.policy("context")
    q = r.groups[0].requests[1]
    policy.tool_waits.turns[q.group] = _Mean()  # as if a trajectory of its group had ended after 6 turns
    policy.tool_waits.turns[q.group].add(6)
    Runner(sched).turn(q, "search", 2.0)  # learned through Scheduler.resume -> turn_answered
    assert policy.tool_waits.latency["search"].value == 2.0
    policy._step_s = 0.1
    steps = int(policy.tool_waits.wait_s(q) / 0.1)
    assert steps == int(4 * 2.0 / 0.1)  # 6 turns expected, 2 run: 4 waits of 2 s, in 0.1 s steps
    assert policy._key(q) == _pack(LENGTH_SPAN - (policy._estimated(q)[1] + steps), q.group, q.sample_index)


def test_an_ended_trajectory_teaches_its_group_length_and_turns():
    sched = scheduler("context")
    r = trajectory_rollout("context", samples=2, max_turns=2)
    sched.submit(r)
    policy = sched.policy("context")
    first, second = r.groups[0].requests
    run = Runner(sched)
    run.turn(first, "calc", 1.0, tokens=6)
    end_turn(sched, run.dispatched(first), [5] * 5 + [TOK.EOS])
    before = policy._posterior(second)
    turns.answer(first, reply(first, "done"), TOK, TOK.vocab_size)
    sched.end_trajectory(first, "stop")  # -> trajectory_ended
    assert policy.tool_waits.turns[first.group].value == 2
    assert policy._model(second).groups[r.groups[0].group_index].n == 1  # its length observed
    assert policy._posterior(second) != before
