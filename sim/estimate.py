"""What a finished rollout would have taken under another policy: an *estimate*.

Owns one question the rollout summary asks: given the lengths this rollout really
generated, how does its policy compare with the ``group`` baseline (veRL's scheduling) on
the same number of engines? Seeded sampling is schedule-invariant, so every policy would
have generated exactly these samples; only the schedule differs. The simulator replays
the lengths under both policies with the ``cpu`` cost model (calibrated to one float32
SmolLM2 vLLM engine per core, ``CostModel.cpu_smollm2``) and returns the ratio of their
throughputs. It is a model, not a measurement: on other hardware or models the cost
model does not apply, and real runs spread more than the simulator (docs/benchmarks.md,
"the simulator checked against real runs", for how close it came on this machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.simulator import simulate
from seer.sim.workloads import ResultGroup, Trace, trace_of_results

if TYPE_CHECKING:
    from seer.client import RolloutResult

BASELINE = "group"
MAX_SAMPLES = 20_000  # above this the replay would cost seconds: no estimate


@dataclass(frozen=True)
class BaselineEstimate:
    baseline: str
    ratio: float  # this policy's simulated throughput / the baseline's
    cost_model: str


def trace_of(result: RolloutResult, max_tokens: int) -> Trace:
    """The rollout's real prompt and output lengths as a simulator trace (budget
    ``max_tokens``, raised to the longest sample if one is longer; ValueError for a
    rollout with no samples or a sample with no tokens)."""
    groups = [ResultGroup(g.group_index, max(s.num_prompt_tokens for s in g.samples),
                          tuple(len(s.token_ids) for s in g.samples),
                          tuple(s.finish_reason == "length" for s in g.samples))
              for g in result.groups if g.samples]
    longest = max((max(g.output_tokens) for g in groups), default=0)
    return trace_of_results(groups, max_tokens=max(max_tokens, longest), name=result.rollout_id)


def against_baseline(result: RolloutResult, *, num_engines: int, kv_capacity_tokens: int, max_tokens: int,
                     scheduler: SchedulerConfig) -> BaselineEstimate | None:
    """The simulated throughput ratio of ``result``'s policy over ``group`` on these
    lengths, or None when there is nothing to compare (the baseline itself, no engines,
    no samples, a policy the simulator cannot replay, or too large a rollout)."""
    policy = result.stats.policy
    if policy == BASELINE or num_engines < 1 or kv_capacity_tokens < 1 or not result.groups:
        return None
    try:
        trace = trace_of(result, max_tokens)
    except ValueError:  # no samples, or an empty one: nothing to replay
        return None
    if trace.num_requests > MAX_SAMPLES:
        return None
    cost = CostModel.cpu_smollm2()
    try:
        ours = simulate(trace, policy, num_engines, cost, kv_capacity_tokens,
                        msgspec.structs.replace(scheduler, policy=policy))
        base = simulate(trace, BASELINE, num_engines, cost, kv_capacity_tokens,
                        msgspec.structs.replace(scheduler, policy=BASELINE))
    except (ValueError, KeyError):  # e.g. an oracle without true lengths: no estimate
        return None
    if base.throughput_tokens_per_s <= 0:
        return None
    return BaselineEstimate(BASELINE, ours.throughput_tokens_per_s / base.throughput_tokens_per_s, "cpu")
