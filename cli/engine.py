"""``seerctl engine --join ADDRESS``: one engine process that joins a running control plane.

The engine is not a child of the daemon's supervisor: it is started by hand, by a
process manager on another host, or as a replacement for a lost engine. It reads the
same seer.toml as a daemon (``[engines]`` and ``[model]`` for the backend, ``[server]``
for its CURVE keys), says hello with ``JOIN_ENGINE_ID`` and gets a fresh engine id from
the control plane, so it can never collide with a spawned engine. Its hello carries a
secret it chose at start (``EngineWorker``): when it registers again with the control
plane that gave it its id (it was declared lost while it stood still, or heard nothing for
``heartbeat_timeout_s``), it names that id and proves it with the secret, and gets the same
id back; no other process can take that id. If the control plane goes away or restarts,
the engine drops its in-flight work and registers again with whatever control plane
serves ADDRESS (``engine_rejoining`` in its log), under a fresh id from a new one.

KV pool: engines use their own host's pool. Once the backend has started (only then is
the KV block shape known) the joining engine makes sure its host has a pool segment and
an agent (``python -m seer.dataplane.transfer.agent --create``) that registers it with the
control plane, so chunks can move between this host and others. The host's agent file
(``controlplane/kvpool/segment.py``: ``claim_host_agent``) makes the first engine of a host start
it and later ones (and the control plane's own host) reuse it. The agent is this
engine's child and stops with it (the segment goes with it); engines of this host that
remain then re-prefill moved chunks until an engine that joins again starts a new one.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import tempfile
from pathlib import Path

import msgspec
import structlog

from seer.config import SeerConfig
from seer.protocol import EngineCapabilities

log = structlog.get_logger()


class JoinError(RuntimeError):
    """The engine cannot join as configured; the message says what to fix."""


def join(config: SeerConfig, address: str, cache_dir: Path, log_file: Path | None) -> int:
    """Run the joining engine in this process until it is shut down; returns its exit code."""
    from seer.auth import AuthError, client_curve, is_tcp
    from seer.cli.daemon import resolve_model_path
    from seer.engines.worker import EngineWorker, make_backend
    from seer.logs import configure_logging
    from seer.protocol import JOIN_ENGINE_ID

    if not address.startswith(("tcp://", "ipc://")):
        raise JoinError(f"--join {address!r}: expected the control plane's engine address, tcp://HOST:PORT or "
                        "ipc://PATH (daemon.json's engine_address)")
    try:
        curve = client_curve(config.server, address)
    except AuthError as exc:
        raise JoinError(str(exc)) from None
    if is_tcp(address) and curve is None and not config.server.allow_insecure_tcp:
        raise JoinError(f"--join {address}: tcp:// without CURVE keys; set server.curve_server_public_key and "
                        "server.curve_client_secret_key in the config (files from `seerctl keys DIR`), or "
                        "server.allow_insecure_tcp = true if the daemon allows it")
    model_path = resolve_model_path(config, cache_dir)
    # vLLM's CPU build sizes its KV cache from the environment, read when vLLM starts.
    from seer.controlplane.supervisor import kv_cache_space_env

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", kv_cache_space_env(config.engines.kv_cache_gib))
    configure_logging("engine-join", log_file, config.logging.level, console=True)
    host_agent = HostAgent(config, address, log_file)
    backend = _StartHook(make_backend(config, model_path), host_agent.ensure)
    import uvloop

    worker = EngineWorker(JOIN_ENGINE_ID, address, config, backend, curve=curve)  # type: ignore[arg-type]

    async def main() -> int:
        # Not a child of any daemon: SIGTERM (a process manager, Ctrl-C) is how it stops.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        return await worker.run()

    try:
        return uvloop.run(main())
    finally:
        host_agent.stop()


class _StartHook:
    """The engine backend, with a call once it has started (its capabilities known)."""

    def __init__(self, backend: object, on_started) -> None:
        self._backend = backend
        self._on_started = on_started

    async def start(self) -> EngineCapabilities:
        capabilities = await self._backend.start()  # type: ignore[attr-defined]
        self._on_started(capabilities)
        return capabilities

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)


class HostAgent:
    """This host's KV pool and agent, started by the first engine of the host to join."""

    def __init__(self, config: SeerConfig, address: str, log_file: Path | None) -> None:
        self.config = config
        self.address = address
        self.log_dir = log_file.parent if log_file is not None else Path(tempfile.gettempdir())
        self.proc: subprocess.Popen | None = None
        self._config_file: Path | None = None

    def ensure(self, capabilities: EngineCapabilities) -> None:
        from seer.controlplane.kvpool.agents import reachable_ip
        from seer.controlplane.kvpool.segment import (
            HostAgentInfo,
            agent_available,
            agent_command,
            claim_host_agent,
        )
        from seer.dataplane.kvpool import SEGMENT_PREFIX, blocks_for_bytes
        from seer.dataplane.host import host_id

        geometry = capabilities.kv_geometry
        if not self.config.kv_pool.enabled or geometry is None:
            return
        if not agent_available():
            log.warning("kv_agent_unavailable", effect="chunks moving to this host re-prefill")
            return
        host = host_id()

        def start() -> HostAgentInfo:
            name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            num_blocks = blocks_for_bytes(geometry, int(self.config.kv_pool.pool_gib * (1 << 30)))
            self._config_file = self.log_dir / f"seer-agent-{os.getpid()}.json"
            self._config_file.write_bytes(msgspec.json.encode(self.config))
            bind_host = self.config.kv_pool.agent_bind_host or reachable_ip(self.address)
            cmd = agent_command(connect=self.address, config_file=self._config_file, pool_name=name,
                                bind_host=bind_host, log_file=self.log_dir / f"agent-{os.getpid()}.log",
                                create=(geometry, num_blocks))
            with open(self.log_dir / f"agent-{os.getpid()}.out", "ab") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            log.info("kv_agent_started", host_id=host, pid=self.proc.pid, pool=name, num_blocks=num_blocks,
                     bind_host=bind_host, transport=self.config.kv_pool.transport)
            return HostAgentInfo(pid=self.proc.pid, pool_name=name)

        started, info = claim_host_agent(host, start)
        if not started:
            log.info("kv_agent_found", host_id=host, pid=info.pid, pool=info.pool_name)

    def stop(self) -> None:
        if self.proc is None:
            return
        from seer.controlplane.kvpool.segment import release_host_agent
        from seer.process import stop_process
        from seer.dataplane.host import host_id

        stop_process(self.proc)
        release_host_agent(host_id(), self.proc.pid)
        if self._config_file is not None:
            self._config_file.unlink(missing_ok=True)
        self.proc = None

