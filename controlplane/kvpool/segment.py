"""The host KV pool's lifecycle on the control-plane side, and this host's agent.

The control plane creates the shared-memory segment when the first engine that can use
it registers (only the engines know the shape of a KV block), owns its allocator through
the scheduler, and unlinks the segment when it stops. Segments left behind by a control
plane that was killed are removed at the next start (their name carries the owner's pid).

Next to the segment it starts this host's agent (``python -m seer.dataplane.transfer.agent``,
attached to the segment): the agent serves the pool's blocks to agents on other hosts and
pulls their blocks into it (see ``agents.py``). It is stopped before the segment is unlinked.
An agent that exits is reported by ``agent_exited``; the pool then serves local engines
only. ``bind`` offers each admitted local engine to the pool: the first that can use it
creates it (events ``kv_pool_created``, ``kv_pool_unavailable``); a later one with another
block geometry re-prefills instead (``kv_pool_geometry_mismatch``). ``agent_command`` is also how a joining engine starts its own host's agent.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog

from seer.config import KVPoolConfig, SeerConfig
from seer.controlplane.kvpool.table import PoolBinding
from seer.protocol import PoolGeometry
from seer.dataplane.kvdisk import DiskTier, DiskTierError
from seer.dataplane.kvpool import SEGMENT_PREFIX, KVPoolSegment, PoolAllocator, blocks_for_bytes
from seer.dataplane.host import host_id
from seer.process import pid_alive, remove_stale_shm, stop_process

if TYPE_CHECKING:
    from seer.controlplane.kvpool.disk import DiskRunner
    from seer.controlplane.scheduler import Scheduler

log = structlog.get_logger()

AGENT_MODULE = "seer.dataplane.transfer.agent"


def agent_available() -> bool:
    return importlib.util.find_spec(AGENT_MODULE) is not None


def agent_command(*, connect: str, config_file: Path, pool_name: str, bind_host: str, log_file: Path,
                  create: tuple[PoolGeometry, int] | None = None) -> list[str]:
    """The agent's command line: attach to ``pool_name`` (or create it with this geometry
    and number of blocks, and unlink it at exit), serve it on ``bind_host`` and register
    with the control plane at ``connect`` (CURVE keys and transport from the config)."""
    cmd = [sys.executable, "-m", AGENT_MODULE, "--connect", connect, "--config", str(config_file),
           "--pool", pool_name, "--bind-host", bind_host, "--log-file", str(log_file)]
    if create is not None:
        geometry, num_blocks = create
        cmd += ["--create", "--geometry", msgspec.json.encode(geometry).decode(), "--num-blocks", str(num_blocks)]
    return cmd


class HostAgentInfo(msgspec.Struct, kw_only=True):
    """What the host's agent file records: who serves this host's pool."""

    pid: int
    pool_name: str


def host_agent_file(host: str) -> Path:
    """One file per host (``host_id()``: hostname + network namespace) through which the
    control plane and joining engines agree on who starts the host's pool and agent."""
    return Path(tempfile.gettempdir()) / f"seer-agent-{re.sub(r'[^A-Za-z0-9_.-]', '_', host)}.json"


def claim_host_agent(host: str, start: Callable[[], HostAgentInfo]) -> tuple[bool, HostAgentInfo]:
    """Under an exclusive lock on the host's file: the live agent it records, or a new one
    from ``start()`` (recorded). True if this call started it."""
    path = host_agent_file(host)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = msgspec.json.decode(path.read_bytes(), type=HostAgentInfo)
        except (OSError, msgspec.DecodeError):
            current = None
        if current is not None and pid_alive(current.pid) and Path("/dev/shm", current.pool_name).exists():
            return False, current
        info = start()
        path.write_bytes(msgspec.json.encode(info))
        return True, info


def release_host_agent(host: str, pid: int) -> None:
    """Forget the host's agent if the file still records ``pid``."""
    path = host_agent_file(host)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if msgspec.json.decode(path.read_bytes(), type=HostAgentInfo).pid == pid:
                path.unlink()
        except (OSError, msgspec.DecodeError):
            pass


class PoolSegmentOwner:
    def __init__(self, config: KVPoolConfig, seer_config: SeerConfig | None = None) -> None:
        self.config = config
        self.seer_config = seer_config or SeerConfig(kv_pool=config)
        self.segment: KVPoolSegment | None = None
        self.agent: subprocess.Popen | None = None
        self._agent_reported = False
        self.disk_runner: DiskRunner | None = None  # set by the server: runs the disk tier's ops

    def create(self, geometry: PoolGeometry) -> PoolBinding:
        stale = remove_stale_shm(SEGMENT_PREFIX)
        if stale:
            log.warning("kv_pool_stale_segments_removed", segments=stale)
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        num_blocks = blocks_for_bytes(geometry, int(self.config.pool_gib * (1 << 30)))
        self.segment = KVPoolSegment.create(name, geometry, num_blocks)
        log.info("kv_pool_created", name=name, num_blocks=num_blocks, block_bytes=geometry.bytes_per_block,
                 capacity_tokens=num_blocks * geometry.block_size, geometry=geometry.fingerprint)
        return PoolBinding(name=name, allocator=PoolAllocator(num_blocks, geometry.block_size),
                           fingerprint=geometry.fingerprint, min_load_tokens=self.config.min_load_tokens)

    def bind(self, scheduler: Scheduler, engine_id: int, geometry: PoolGeometry | None, *, engine_address: str,
             run_dir: Path) -> None:
        """Create the host KV pool (and start its agent) for the first local engine that can
        use it; later engines must have the same block geometry to share it."""
        if geometry is None or not self.config.enabled:
            return
        pool = scheduler.pool
        if pool is None:
            try:
                scheduler.add_host_pool(self.create(geometry))
            except OSError as exc:
                log.error("kv_pool_unavailable", error=str(exc),
                          fix="free /dev/shm or lower kv_pool.pool_gib; chunks re-prefill meanwhile")
                return
            self._attach_disk(scheduler)
            # This host's agent serves the pool to engines on other hosts (and pulls into it).
            self.start_agent(engine_address, run_dir)
        elif geometry.fingerprint != pool.fingerprint:
            log.warning("kv_pool_geometry_mismatch", engine_id=engine_id, engine=geometry.fingerprint,
                        pool=pool.fingerprint, effect="this engine re-prefills instead of loading from the pool")

    def _attach_disk(self, scheduler: Scheduler) -> None:
        """The disk tier under the new pool, if configured (``kv_pool.disk_gib`` > 0)."""
        if self.config.disk_gib <= 0 or self.segment is None or self.disk_runner is None:
            return
        try:
            tier = DiskTier.create(self.config.disk_path, self.segment, int(self.config.disk_gib * (1 << 30)))
        except DiskTierError as exc:
            log.error("kv_disk_unavailable", error=str(exc), effect="no disk tier: a full pool means re-prefill")
            return
        self.disk_runner.attach(tier, self.segment)
        scheduler.kv.attach_disk(tier.num_slots, prefetch=self.config.disk_prefetch,
                                  depth=self.config.disk_prefetch_depth)
        log.info("kv_disk_created", path=str(tier.path), num_slots=tier.num_slots, direct_io=tier.direct,
                 capacity_tokens=tier.num_slots * self.segment.geometry.block_size)

    def start_agent(self, engine_address: str, run_dir: Path) -> None:
        """Start this host's agent for the segment (no agent: the pool serves local engines only)."""
        if self.segment is None or self.agent is not None:
            return
        if not agent_available():
            log.warning("kv_agent_unavailable", module=AGENT_MODULE,
                        effect="engines on other hosts re-prefill instead of pulling KV from this host")
            return
        from seer.controlplane.kvpool.agents import reachable_ip

        config_file = run_dir / "agent-config.json"
        config_file.write_bytes(msgspec.json.encode(self.seer_config))
        bind_host = self.config.agent_bind_host or reachable_ip(engine_address)
        cmd = agent_command(connect=engine_address, config_file=config_file, pool_name=self.segment.path.name,
                            bind_host=bind_host, log_file=run_dir / "agent.log")
        with open(run_dir / "agent.out", "ab") as out:
            self.agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        # Engines joining from this host find it there and start no second pool.
        claim_host_agent(host_id(), lambda: HostAgentInfo(pid=self.agent.pid, pool_name=self.segment.path.name))
        log.info("kv_agent_started", pid=self.agent.pid, pool=self.segment.path.name, bind_host=bind_host,
                 transport=self.config.transport)

    def agent_exited(self) -> str | None:
        """Once, when the agent has exited: why."""
        if self.agent is None or self._agent_reported or (code := self.agent.poll()) is None:
            return None
        self._agent_reported = True
        return f"agent process {self.agent.pid} exited with code {code}"

    def close(self) -> None:
        if self.disk_runner is not None:
            self.disk_runner.close()
        if self.agent is not None:
            stop_process(self.agent)
            release_host_agent(host_id(), self.agent.pid)
            self.agent = None
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            log.info("kv_pool_removed", name=self.segment.path.name)
            self.segment = None
