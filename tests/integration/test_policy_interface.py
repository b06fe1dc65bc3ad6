"""A policy written to the ``Policy`` interface alone (``controlplane/policies/base.py``)
runs: registered from outside the package, it serves a rollout on the simulator's core and
on the daemon with real simulated-engine processes, and the status reads its defaults.

The policy below implements only what the interface requires (``name``, ``__len__``,
``enqueue``, ``discard_rollout``, ``assign``); every optional member the scheduler, the
KV tiers and the status read comes from the base class.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque

import pytest

from seer.config import SchedulerConfig
from seer.controlplane.policies import POLICIES
from seer.controlplane.policies.base import Assignment, Policy, register
from seer.controlplane.state import EngineView, Request
from tests.daemon_helpers import in_process_plane, plane_logging

NAME = "test-minimal"


class FirstComeFirstServed(Policy):
    """Whole samples in arrival order, each to the engine with the fewest in flight."""

    name = NAME

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._waiting: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def enqueue(self, request: Request) -> None:
        self._waiting.append(request)

    def discard_rollout(self, rollout_id: str) -> None:
        self._waiting = deque(r for r in self._waiting if r.group.rollout.rollout_id != rollout_id)

    def assign(self, engines: list[EngineView], limit: int = sys.maxsize) -> list[Assignment]:
        load = {e.engine_id: e.num_inflight for e in engines}
        out = []
        while self._waiting:
            request = self._waiting.popleft()
            engine_id = min(load, key=lambda i: (load[i], i))
            load[engine_id] += 1
            out.append(Assignment(request, engine_id, request.remaining_tokens))
        return out


@pytest.fixture
def minimal_policy():
    register(FirstComeFirstServed)
    try:
        yield NAME
    finally:
        POLICIES.pop(NAME, None)
        from seer import config

        config._POLICY_NAMES.discard(NAME)


def test_a_minimal_policy_runs_a_simulated_rollout(minimal_policy):
    """On the simulator's core (the real scheduler, virtual engines) every sample of a
    trace finishes with its trace length, one chunk each."""
    from seer.stepcost import CostModel
    from sim.simulator import Simulation
    from sim.workloads import generate_trace

    trace = generate_trace("minimal", num_groups=6, group_size=4, max_tokens=64, mean_tokens=24, prompt_tokens=16,
                           icc=0.3, seed=3)
    sim = Simulation(trace, minimal_policy, 2, CostModel.cpu_smollm2(), 4096, SchedulerConfig(policy=minimal_policy),
                     0, 256)
    result = sim.run()
    samples = [r for g in sim.rollout.groups for r in g.requests]
    assert result.num_requests == len(samples) == trace.num_requests
    assert result.num_output_tokens == trace.num_output_tokens
    assert all(r.num_chunks == 1 and r.finish_reason in ("stop", "length") for r in samples)
    assert {r.engine_history[0] for r in samples} == {0, 1}


@pytest.mark.timeout(600)
def test_a_minimal_policy_serves_a_daemon_rollout_on_sim_engines(minimal_policy, tmp_path):
    """In-process control plane, two real sim-engine processes: a 12 x 4 rollout under the
    minimal policy returns every sample once in its place, and ``status`` names the
    policy with the interface's defaults (engine-side placement, no margin)."""
    from benchmarks.load import big_rollout, write_config
    from seer.client import AsyncSeerClient
    from seer.config import load_config

    config = load_config(write_config(tmp_path / "c.toml", engines=2, step_s=0.001, policy=minimal_policy,
                                      mean_output_tokens=8))

    async def go():
        async with in_process_plane(config, tmp_path) as (_plane, client_address):
            result, problems = await big_rollout(client_address, 12, 4, 16, "minimal", 300)
            async with AsyncSeerClient(client_address, timeout_s=60) as client:
                status = await client.status()
        return result, problems, status

    with plane_logging(tmp_path):
        result, problems, status = asyncio.run(go())
    assert problems == []
    assert result.stats.num_samples == 48
    scheduling = status.scheduling
    assert scheduling.policy == minimal_policy
    assert scheduling.placement == "engine" and scheduling.chunk_size_tokens == 0
    assert scheduling.admission_margin_sd is None and scheduling.whole_samples is False
