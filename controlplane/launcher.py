"""What the control plane needs from an engine launcher other than its own supervisor.

Owns: the ``EngineLauncher`` protocol the server drives (start after binding, report
lost engine processes on each tick, say where each engine runs for status, stop after
the drain), the records crossing it (``EnginePlacement``, ``LostEngine``), and the pure
restart decision (``RestartBudget``).

A launcher starts engines that *join* (``seerctl engine --join``): the control plane
gives them fresh ids at their hello, so a launcher knows its engines by the process it
started (host id + pid), never by engine id. ``match_engine`` maps one to the other. The
Ray launcher (``seer.cli.ray_launcher``) implements the protocol; this layer never
imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class EnginePlacement:
    """One running engine process a launcher started, and where."""

    host_id: str  # ``seer.dataplane.host.host_id()`` on the engine's node
    pid: int
    node_ip: str
    actor_id: str


@dataclass(frozen=True)
class LostEngine:
    """An engine process a launcher saw end (its actor died or the process exited)."""

    placement: EnginePlacement
    reason: str


class EngineLauncher(Protocol):
    num_engines: int

    def start(self) -> None: ...  # blocking: run in a thread

    def take_lost(self) -> list[LostEngine]: ...  # non-blocking: called on the event loop

    def placements(self) -> list[EnginePlacement]: ...

    def gave_up(self) -> bool: ...  # every engine's restarts are spent

    def begin_stop(self) -> None: ...  # the drain starts: engines that end now are not restarted

    def stop(self, grace_s: float) -> None: ...  # blocking: run in a thread


@dataclass
class RestartBudget:
    """Restarts left per engine slot: a slot whose engine ends while the daemon is not
    stopping is started again until ``max_restarts`` is spent."""

    max_restarts: int
    used: dict[int, int]

    @classmethod
    def for_slots(cls, num_slots: int, max_restarts: int) -> RestartBudget:
        return cls(max_restarts=max_restarts, used=dict.fromkeys(range(num_slots), 0))

    def should_restart(self, slot: int, stopping: bool) -> bool:
        return not stopping and self.used[slot] < self.max_restarts

    def restarted(self, slot: int) -> int:
        """Count a restart of ``slot``; returns the attempt number (1 = first restart)."""
        self.used[slot] += 1
        return self.used[slot]


def match_engine(placement: EnginePlacement, engines: dict[int, tuple[str, int]]) -> int | None:
    """The engine id whose (host id, pid) is the placement's, from ``{engine_id: (host_id,
    pid)}``; the newest (highest) id when a pid was reused on that host."""
    found = [engine_id for engine_id, (host_id, pid) in engines.items()
             if pid == placement.pid and host_id == placement.host_id]
    return max(found) if found else None
