"""What a trajectory's tool waits still to come will cost, learned online (``context``).

A trajectory's makespan is its turns' decode steps plus its environment's waits between
them; two trajectories with the same tokens left are not the same work if one still has
more, or slower, tool calls ahead. ``ToolWaits`` learns, as trajectories run:

* per tool name, the mean seconds its environment took to answer (``TurnRecord.tool_s``),
  from every answered turn (``Policy.turn_answered``);
* per group, how many turns its ended trajectories ran (``Policy.trajectory_ended``), as
  the group's lengths are learned from its finished samples.

``wait_s`` is then a trajectory's expected waits to come: its group's mean turns less the
turns it has run, times the mean latency of the tools it has called (all tools' mean before
it has called one). Nothing is known of a group before one of its trajectories ends: no
wait is expected yet. Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

from seer.controlplane.state import Group, Request


class _Mean:
    __slots__ = ("n", "total")

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x

    @property
    def value(self) -> float:
        return self.total / self.n if self.n else 0.0


class ToolWaits:
    def __init__(self) -> None:
        self.latency: dict[str, _Mean] = {}  # tool name -> seconds per answer
        self._all = _Mean()  # every tool's answers
        self.turns: dict[Group, _Mean] = {}  # group -> turns of its ended trajectories

    def answered(self, request: Request) -> None:
        """Learn from the turn just answered (the one before the trajectory's current turn)."""
        t = request.trajectory
        if t is None or len(t.turns) < 2:
            return
        turn = t.turns[-2]
        self.latency.setdefault(turn.tool_name, _Mean()).add(turn.tool_s)
        self._all.add(turn.tool_s)

    def ended(self, request: Request) -> None:
        t = request.trajectory
        if t is not None and t.turns:
            self.turns.setdefault(request.group, _Mean()).add(len(t.turns))

    def wait_s(self, request: Request) -> float:
        """The tool seconds ``request``'s trajectory is expected still to wait."""
        t = request.trajectory
        known = self.turns.get(request.group)
        if t is None or known is None:
            return 0.0
        left = known.value - len(t.turns)
        if left <= 0:
            return 0.0
        names = {turn.tool_name for turn in t.turns[:-1]}
        means = [self.latency[n].value for n in names if n in self.latency]
        per_call = sum(means) / len(means) if means else self._all.value
        return left * per_call

    def forget(self, done: list[Group]) -> None:
        for group in done:
            self.turns.pop(group, None)
