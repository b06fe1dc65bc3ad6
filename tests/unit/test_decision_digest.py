"""The scheduler core's speed work (issue 12, decisions/s) changed no decision: a digest of
every dispatch (engine, request, chunk budget, in order) of seeded simulations and of the
speed benchmark's loop equals the digest recorded before the work (commit 2af8395).

Placement on small engines (``imbalance_fraction``, issue 13) changed decisions on
purpose: with ``imbalance_fraction = 1.0`` it places exactly as before, so the 2af8395
digests are checked with it, and the default placement has its own digests, recorded
when it was introduced.

The give-back fix (a request skipped this round goes back only into the index it was
taken from) changed one thing on purpose: a request the starvation guard took but could
not place used to lose its place in the guard's heap (and gain a duplicate in the main
one); now it keeps it, so the guard's next turn offers it again. The speed benchmark's
loop, which has starvation turns that skip, got a new digest for that (the old one,
de09ead2f40952e2, is what the code gives with the guard's entry dropped as before); the
seeded simulations below never skip on a guard turn and kept theirs.

The probe rule of 2026-12-02 (a probe keeps its priority for its first chunk only, and the
reservation's calibration steps by 0.15) changed ``context``'s decisions on purpose: its
three digests were re-recorded then (before: b5d36539fe216d21, 4a7e783cbc46970e and, for
the speed benchmark's loop, ce0a3166c71bc9b6). ``divided`` and ``oracle`` kept theirs.

The simulations above never fill an engine's KV budget (40,000 tokens: the same dispatches
as with 400,000), so they cannot see a change to admission. The third set runs the same
trace on 12,000 tokens per engine, where admission decides; its digests were recorded at
a2ac37b, and a test checks that the budget really binds there.

The length model's online fit (2026-12-03: ``RolloutLengths.refit``) changed ``context``'s
decisions on purpose: its three simulation digests were re-recorded (before:
136ef3712f527280, b1ef516a90ae6587 and a91862136077f3ce). The speed benchmark's loop
never finishes a probe, so it never refits and kept its digest.

Calibrating expected use by a sample's stage (2026-12-04: ``ContextPolicy._stage``) changed
``context``'s decisions on the binding KV budget on purpose (before: 24b975c626473ce4); on
the other two simulations every chunk is calibrated as before.

The cost-aware decisions (2026-12-06) changed decisions on purpose: a group's prompt is
reserved once per engine (every KV-bound digest, ``divided``'s too: before
efd4f7cb00c7035a, a18ae26fa2b6ad36 and 9b3551a15a039969), and the policies with a length
model (``context``, ``oracle``) place by predicted drain time and ``context`` takes its
admission margin from the step cost (before, unbound: 1df526f57dcc9264 / d682146afb957c0d
with imbalance_fraction 1.0, 9ad8f5969120247e / 651b5cbd46914d79 by default; the speed
benchmark's loop: ca8b9ec951bd2c01). Placement by drain time ignores ``imbalance_fraction``,
so ``context`` and ``oracle`` have one digest for both placements."""

from __future__ import annotations

import hashlib

import pytest

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.simulator import Simulation
from seer.sim.workloads import generate_trace
from tests.benchmark_modules import load_benchmark

SMALL = CostModel(a=1.0, b=0.0625, c=0.001, p=0.01, pool_s_per_token=0.001)

# Recorded at commit 2af8395, before the incremental engine bookkeeping.
SIM_DIGESTS = {
    "divided": "1496714e466955f6",
    "context": "a244e51d87426f3a",  # re-recorded for the probe rule, the length fit, the cost-aware decisions
    "oracle": "6f9780b15ab2cab9",  # re-recorded for placement by drain time
}
# Recorded at a2ac37b on a KV budget that binds (12,000 tokens per engine, placement pinned).
SIM_DIGESTS_KV_BOUND = {
    "divided": "0c2db4605f4ce5ca",  # re-recorded for the prompt reserved once per engine (docstring)
    "context": "8964d6441db47aff",  # ... the length fit, calibration by stage, the cost-aware decisions
    "oracle": "7d985131054ff3bd",
}
KV_BOUND = 12_000
BENCH_DIGEST = "d3c075d8c77e02f6"  # see the docstring: the guard's give-back, the probe rule, cost-aware decisions
# Recorded with the default ``imbalance_fraction`` (0.5) when it was introduced.
SIM_DIGESTS_SMALL_ENGINE_PLACEMENT = {
    "divided": "4c2b4033f5885cdf",
    "context": "a244e51d87426f3a",  # placement by drain time: the same as with imbalance_fraction 1.0
    "oracle": "6f9780b15ab2cab9",
}


def _digest(dispatches) -> str:
    h = hashlib.sha256()
    for d in dispatches:
        h.update(f"{d.engine_id}:{d.request.request_id}:{d.task.sampling.max_tokens};".encode())
    return h.hexdigest()[:16]


def sim_digest(policy: str, kv_capacity_tokens: int = 40_000, **cfg) -> str:
    trace = generate_trace("digest", num_groups=48, group_size=8, max_tokens=2048, mean_tokens=400,
                           prompt_tokens=64, icc=0.6, seed=7)
    config = SchedulerConfig(policy=policy, chunk_size_tokens=256, **cfg)
    sim = Simulation(trace, policy, 4, SMALL, kv_capacity_tokens, config, 3, 64)
    seen = []
    schedule = sim.scheduler.schedule

    def recording():
        out = schedule()
        seen.extend(out)
        return out

    sim.scheduler.schedule = recording  # type: ignore[method-assign]
    sim.run()
    return _digest(seen)


def bench_digest() -> str:
    bench = load_benchmark("sim_policy_speed")
    sched, _ = bench.build("context", 3000, 16, 8)
    running = list(sched.schedule())
    seen = list(running)
    from seer.protocol import ChunkFinished, pack_logprobs, pack_token_ids

    while len(seen) < 4000 and running:
        d = running.pop(0)
        n = d.task.sampling.max_tokens
        sched.chunk_finished(ChunkFinished(engine_id=d.engine_id, task_id=d.task.task_id,
                                           token_ids=pack_token_ids([7] * n), logprobs=pack_logprobs([0.0] * n),
                                           finish_reason="length", num_prompt_tokens=0, num_cached_tokens=0,
                                           elapsed_ms=0.0))
        new = sched.schedule()
        seen.extend(new)
        running.extend(new)
    return _digest(seen)


@pytest.mark.parametrize("policy", sorted(SIM_DIGESTS))
def test_a_seeded_simulation_dispatches_exactly_as_before(policy):
    """Same trace, seed and config: the same dispatches in the same order as before the speed work."""
    assert sim_digest(policy, imbalance_fraction=1.0) == SIM_DIGESTS[policy]


@pytest.mark.parametrize("policy", sorted(SIM_DIGESTS_SMALL_ENGINE_PLACEMENT))
def test_a_seeded_simulation_with_the_default_placement_dispatches_as_recorded(policy):
    """The default placement (small-engine tolerance) on the same trace: the recorded dispatches."""
    assert sim_digest(policy) == SIM_DIGESTS_SMALL_ENGINE_PLACEMENT[policy]


@pytest.mark.parametrize("policy", sorted(SIM_DIGESTS_KV_BOUND))
def test_a_seeded_simulation_on_a_binding_kv_budget_dispatches_as_recorded(policy):
    """Where admission decides (12,000 tokens per engine): the recorded dispatches, and
    not those of a budget too large to bind, so a change to admission shows here."""
    digest = sim_digest(policy, KV_BOUND, imbalance_fraction=1.0)
    assert digest != sim_digest(policy, 10 * KV_BOUND, imbalance_fraction=1.0)
    assert digest == SIM_DIGESTS_KV_BOUND[policy]


def test_the_speed_benchmarks_loop_dispatches_exactly_as_before():
    """The microbenchmark's loop (16 engines, thousands waiting): the same dispatches as before."""
    assert bench_digest() == BENCH_DIGEST
