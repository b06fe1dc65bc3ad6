"""What the scheduler core decides, as values: the chunk dispatches, the aborts, what a
finished chunk completed and what a lost engine left behind (``scheduler.py`` returns
them; the server's I/O edge, the simulator and the tests act on them), and the
cost-aware choices it reports (``scheduling_status``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from seer.controlplane.state import EngineState, Group, Request, Rollout
from seer.protocol import ChunkTask, SchedulingStatus

if TYPE_CHECKING:
    from seer.config import SchedulerConfig
    from seer.controlplane.policies.base import Policy
    from seer.stepcost import StepCostFit


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
    turn_ended: bool = False  # a trajectory's turn ended: it waits for its environment
    recomputed_tokens: int = 0  # context tokens the chunk computed again (``turns.recomputed_tokens``)


@dataclass
class LossReport:
    previous: EngineState | None = None  # the lost engine's state before; None: it was not live
    requeued: list[Request] = field(default_factory=list)
    stranded_rollouts: list[Rollout] = field(default_factory=list)  # no engine left


class SchedulerError(RuntimeError):
    pass


def scheduling_status(config: SchedulerConfig, policy: Policy, fit: StepCostFit) -> SchedulingStatus:
    """The fitted step cost and ``policy``'s (the configured one's) cost-aware choices."""
    model = fit.model
    chunked, margin = policy.chunked, policy.reserve_z
    return SchedulingStatus(
        step_fixed_s=model.a, step_per_seq_s=model.b, step_per_kv_token_s=model.c, step_per_prefill_token_s=model.p,
        num_step_records=fit.num_records, num_step_records_refused=fit.num_refused,
        policy=config.policy, chunk_size_tokens=config.chunk_size_tokens if chunked else 0,
        admission_margin_sd=margin, overflow_odds=policy.odds if margin is not None else None,
        placement=("drain" if policy.places_by_drain else "in-flight") if chunked else "engine",
        whole_samples=policy.whole_samples)


__all__ = ["Abort", "Completion", "Dispatch", "LossReport", "SchedulerError"]
