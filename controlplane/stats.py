"""Rollout statistics: throughput and tail time, from per-sample finish times.

Definitions (as in the Seer paper): throughput = output tokens of the whole rollout
divided by its wall time (accepted -> last sample finished); tail time = time from
the moment 90 % of the samples have finished to the moment the last one finishes.
"""

from __future__ import annotations

import math

from seer.controlplane.state import Rollout
from seer.protocol import RolloutStats


# The tail starts when this fraction of a rollout's samples has finished.
TAIL_FRACTION = 0.9


def tail_start_rank(num_samples: int, fraction: float = TAIL_FRACTION) -> int:
    """The finish (1-based) at which the tail starts: ceil(fraction*N), at least 1. The
    metrics' running tail (``metrics.Metrics``) and ``tail_time_s`` both count from it."""
    return max(1, math.ceil(fraction * num_samples))


def tail_time_s(finish_times_s: list[float], fraction: float = TAIL_FRACTION) -> float:
    """Seconds from the ``tail_start_rank``-th finish to the last (0 for N < 2)."""
    if len(finish_times_s) < 2:
        return 0.0
    ordered = sorted(finish_times_s)
    return ordered[-1] - ordered[tail_start_rank(len(ordered), fraction) - 1]


def rollout_stats(rollout: Rollout, num_preemptions: int) -> RolloutStats:
    finish = [r.finished_s - rollout.accepted_s for g in rollout.groups for r in g.requests if r.finished_s is not None]
    wall = max(finish) if finish else 0.0
    return RolloutStats(
        policy=rollout.policy,
        num_groups=len(rollout.groups),
        num_samples=rollout.num_samples,
        num_output_tokens=rollout.num_output_tokens,
        wall_time_s=wall,
        throughput_tokens_per_s=(rollout.num_output_tokens / wall) if wall > 0 else 0.0,
        tail_time_s=tail_time_s(finish),
        num_preemptions=num_preemptions,
        num_chunks=rollout.num_chunks,
        per_engine_output_tokens={str(k): v for k, v in sorted(rollout.per_engine_output_tokens.items())},
        num_recomputed_tokens=rollout.num_recomputed_tokens,
    )
