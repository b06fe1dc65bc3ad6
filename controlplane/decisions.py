"""What the scheduler core decides, as values: the chunk dispatches, the aborts, what a
finished chunk completed and what a lost engine left behind (``scheduler.py`` returns
them; the server's I/O edge, the simulator and the tests act on them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from seer.controlplane.state import EngineState, Group, Request, Rollout
from seer.protocol import ChunkTask


class Dispatch(msgspec.Struct, frozen=True):
    """A chunk task bound for an engine (a Struct: one is made per decision, see
    ``Assignment``)."""

    engine_id: int
    task: ChunkTask
    request: Request
    kv_pool_full: bool = False  # the chunk will continue but the pool had no room to save it
    kv_lost: bool = False  # its KV was on the disk tier and could not come back: it re-prefills


@dataclass(frozen=True)
class Abort:
    engine_id: int
    task_ids: list[int]


@dataclass
class Completion:
    """What one finished chunk completed (possibly nothing)."""

    request: Request
    sample_finished: bool = False
    group_finished: Group | None = None
    rollout_finished: Rollout | None = None
    requeued: bool = False
    num_tokens: int = 0  # output tokens the chunk added to its request (after stop strings)


@dataclass
class LossReport:
    previous: EngineState | None = None  # the lost engine's state before; None: it was not live
    requeued: list[Request] = field(default_factory=list)
    stranded_rollouts: list[Rollout] = field(default_factory=list)  # no engine left


class SchedulerError(RuntimeError):
    pass


__all__ = ["Abort", "Completion", "Dispatch", "LossReport", "SchedulerError"]
