"""What the service reports about itself: ``seerctl status``, readiness and where engines run.

Owns the ``ServiceStatus`` a ``StatusRequest`` is answered with (rollouts' progress, every
engine's record, and for engines a launcher started, the node and Ray actor each runs on),
whether engines are still starting (``starting``: the server calls the daemon ready once
none is, or at ``engines.startup_timeout_s``), and the map from engine ids to the
processes launchers know them by (``engine_processes``: ``launcher.match_engine`` reads
it). Plain: reads the tables it is given, the clock and pid injected, sends nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from seer.config import SeerConfig
from seer.controlplane.kvpool.agents import Agents
from seer.controlplane.kvpool.table import LOCAL_HOST
from seer.controlplane.launcher import EngineLauncher, match_engine
from seer.controlplane.registry import Registry
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import RequestState
from seer.controlplane.weights import Weights
from seer.protocol import RolloutProgress, ServiceStatus


class Status:
    """The service's status, read from the tables it is given."""

    def __init__(self, config: SeerConfig, registry: Registry, scheduler: Scheduler, weights: Weights, agents: Agents,
                 launcher: EngineLauncher | None, *, run_dir: Path, client_address: str, pid: int,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.registry = registry
        self.scheduler = scheduler
        self.weights = weights
        self.agents = agents
        self.launcher = launcher
        self.run_dir = run_dir
        self.client_address = client_address
        self.pid = pid
        self.clock = clock
        self.openai_url = ""  # the OpenAI endpoint's (``[openai]``), set when it serves

    def status(self) -> ServiceStatus:
        now = self.clock()
        rollouts = [RolloutProgress(rollout_id=r.rollout_id, policy=r.policy, num_groups=len(r.groups),
                                    num_groups_done=r.num_groups_done, num_samples=r.num_samples,
                                    num_samples_done=r.num_samples_done, num_output_tokens=r.num_output_tokens,
                                    elapsed_s=now - r.accepted_s, num_recomputed_tokens=r.num_recomputed_tokens,
                                    num_waiting_for_env=sum(q.state is RequestState.TOOL_WAIT
                                                            for g in r.groups for q in g.requests)
                                    if r.groups and r.groups[0].requests[0].trajectory is not None else 0)
                    for r in self.scheduler.rollouts.values()]
        engines = [e.status() for _, e in sorted(self.registry.engines.items())]
        if self.launcher is not None:  # where each launched engine runs
            processes = self.engine_processes()
            for placement in self.launcher.placements():
                engine_id = match_engine(placement, processes)
                for e in engines:
                    if e.engine_id == engine_id:
                        e.node_ip, e.ray_actor_id = placement.node_ip, placement.actor_id
        return ServiceStatus(pid=self.pid, policy=self.config.scheduler.policy,
                             weights_version=self.weights.service_version, engines=engines,
                             rollouts=rollouts, run_dir=str(self.run_dir), client_address=self.client_address,
                             scheduling=self.scheduler.scheduling_status(), openai_url=self.openai_url)

    def starting(self) -> bool:
        """Engines are still starting: spawned ones before their hello, or a launcher's
        still joining (not all ready, restarts left)."""
        return bool(self.registry.num_starting()) or self.launched_starting()

    def launched_starting(self) -> bool:
        """A launcher's engines are still joining (not all ready, restarts left)."""
        launcher = self.launcher
        return launcher is not None and len(self.registry.ready_ids()) < launcher.num_engines and not launcher.gave_up()

    def engine_processes(self) -> dict[int, tuple[str, int]]:
        """``{engine_id: (host_id, pid)}`` with host ids as engines report them (launchers
        know their engines by process, not by id)."""
        local = self.agents.local_host_id
        return {engine_id: (local if (host := self.scheduler.kv.engine_hosts.get(engine_id, LOCAL_HOST)) == LOCAL_HOST
                            else host, view.pid) for engine_id, view in self.registry.engines.items()}
