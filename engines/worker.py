"""One engine process: the ZeroMQ worker loop around an engine backend.

Lifecycle: build the backend and start it (loads the model) -> connect a DEALER to
the control plane -> send ``EngineHello`` -> wait for ``HelloAccepted`` (or exit on
``HelloRejected``) -> serve ``ChunkTask`` / ``AbortTasks`` / ``LoadWeights`` / ``Ping``
until ``Shutdown``, or until the control plane has been silent for
``heartbeat_timeout_s`` (it is gone: exit rather than linger; an engine that joined
with ``seerctl engine --join`` registers again instead). A spawned engine whose parent,
the daemon, still runs takes the silence for a stall of the daemon
(a CPU hog, swapping, a long collection) and keeps serving: it exits when its parent is
gone, which ``--die-with-parent`` also signals, and a stall must not end every engine
while the daemon lives. Heartbeats carrying
load go out every ``heartbeat_interval_s``. Backend errors become ``ChunkFailed`` /
``WeightsLoaded(error=...)`` messages; exceptions never cross the process boundary.

Identity: every connection to the control plane has its own routing id (``engine-N.<random>``,
or ``join-<random>`` for a joining engine), and every hello carries the engine's secret:
the one its supervisor spawned it with (read once from the pipe ``--secret-fd`` names; never
on the command line or in the environment), or one it chose at start (a joined engine, or
one started by hand). The control plane gives an engine's id only to the process that
proves it: a second connection claiming a live engine's id is refused while the engine
keeps serving, and an engine that registers again (declared lost, or rejoining the control
plane that gave it its id: ``previous_engine_id`` with ``previous_control_plane``) takes its
id back with it.

Entry: ``python -m seer.engines.worker --engine-id N --connect ADDR --config FILE [--secret-fd FD]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
import time
import uuid
from pathlib import Path

import msgspec
import structlog
import zmq
import zmq.asyncio

from seer.config import SeerConfig
from seer.dataplane.host import host_id
from seer.engines.backend import EngineBackend
from seer.protocol import (
    JOIN_ENGINE_ID,
    PROTOCOL_VERSION,
    AbortTasks,
    ChunkFailed,
    ChunkFinished,
    ChunkTask,
    ControlMessage,
    EngineCapabilities,
    EngineHeartbeat,
    EngineHello,
    EngineLoad,
    HelloAccepted,
    HelloRejected,
    LoadWeights,
    Ping,
    Shutdown,
    WeightsLoaded,
    pack_logprobs,
    pack_steps,
    pack_token_ids,
)
from seer.peer import PeerSession
from seer.dataplane.kvpool import SEGMENT_PREFIX
from seer.process import die_with_parent, remove_stale_shm
from seer.wire import Codec, FrameError, make_socket

log = structlog.get_logger()

STOP_GRACE_S = 10.0  # after SIGTERM, the backend's shutdown gets this long before the process group is killed
SPEC_LOG_INTERVAL_S = 30.0  # speculation_stats: drafts and acceptance since the last one


def make_backend(config: SeerConfig, model_path: str, *, engine_id: int = 0,
                 run_dir: str | None = None) -> EngineBackend:
    """The engine's backend. ``run_dir`` (the daemon's run dir, None for a joined engine)
    is where the grouped draft server of this host is found; without one, grouped
    speculative decoding drafts from this engine's own samples."""
    if config.engines.backend == "sim":
        from seer.engines.sim_backend import SimBackend

        return SimBackend(
            step_s=config.engines.sim_step_s,
            mean_output_tokens=config.engines.sim_mean_output_tokens,
            max_model_len=config.model.max_model_len,
            fault_token_id=config.engines.sim_fault_token_id,
            fault_kills_engine=config.engines.sim_fault_kills_engine,
        )
    from seer.engines.vllm_backend import VLLMBackend  # the worker's only path to vLLM

    return VLLMBackend(
        model_path,
        dtype=config.model.dtype,
        max_model_len=config.model.max_model_len,
        enforce_eager=config.engines.enforce_eager,
        gpu_memory_utilization=config.engines.gpu_memory_utilization,
        kv_cache_gib=config.engines.kv_cache_gib,
        logprobs_mode=config.engines.logprobs_mode,
        block_size=config.kv_pool.block_size if config.kv_pool.enabled else None,
        kv_connector=config.kv_pool.enabled,
        verify_checksums=config.kv_pool.verify_checksums,
        speculative=config.speculative,
        engine_id=engine_id,
        draft_run_dir=run_dir,
    )


class EngineWorker:
    """``engine_id = JOIN_ENGINE_ID``: a joining engine (``seerctl engine --join``); the
    control plane assigns its id, and when the control plane stops, goes silent or
    forgets it (restart) it drops its in-flight work and registers again, waiting up to
    ``startup_timeout_s`` for a control plane; SIGTERM stops it. A spawned engine (fixed
    id) exits instead once its parent, the daemon, is gone; while the daemon runs it waits
    through silence and registers again when the control plane took it for lost."""

    def __init__(self, engine_id: int, address: str, config: SeerConfig, backend: EngineBackend,
                 curve: dict[str, object] | None = None, parent_pid: int | None = None,
                 secret: str | None = None) -> None:
        self.engine_id = engine_id
        # What every hello proves this process with (its supervisor's, or chosen here). Never logged.
        self._secret = secret or secrets.token_urlsafe(32)
        # A joining engine's id and the control plane that gave it (HelloAccepted): named in
        # its next hello, to get the same id back from the same control plane.
        self._previous_id = JOIN_ENGINE_ID
        self._control_plane = ""
        # A spawned engine's parent, the daemon: while it runs, silence is a stall, not a
        # lost control plane. None: no such parent to watch (a joined engine).
        self.parent_pid = parent_pid
        self.joining = engine_id == JOIN_ENGINE_ID
        self.address = address
        self.config = config
        self.backend = backend
        self.curve = curve
        self.weights_version = 0
        self._codec: Codec[ControlMessage] = Codec(ControlMessage)
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._peer = PeerSession(config.engines.heartbeat_timeout_s, time.monotonic())
        self._stop = asyncio.Event()
        self._spec_reported: tuple[int, int, int] = (0, 0, 0)  # backend.spec_counts() at the last log
        self.exit_code = 0

    async def run(self) -> int:
        t0 = time.monotonic()
        capabilities = await self.backend.start()
        log.info("engine_started", engine_id=self.engine_id, backend=capabilities.backend,
                 startup_s=round(time.monotonic() - t0, 2), kv_capacity_tokens=capabilities.kv_capacity_tokens)
        ctx = zmq.asyncio.Context()
        try:
            while (await self._session(ctx, capabilities) and (self.joining or self._parent_runs())
                   and not self._stop.is_set()):
                # The control plane is gone, restarted, or took this engine for lost (its daemon
                # still runs): nobody will collect this work; register again, empty.
                lost = list(self._tasks)
                await self._drop_tasks()
                log.warning("engine_rejoining", engine_id=self.engine_id, address=self.address,
                            num_dropped_tasks=len(lost))
        finally:
            await self._drop_tasks()
            await self.backend.shutdown()
            ctx.term()
            log.info("engine_stopped", engine_id=self.engine_id, exit_code=self.exit_code)
        return self.exit_code

    async def _session(self, ctx: zmq.asyncio.Context, capabilities: EngineCapabilities) -> bool:
        """Register and serve on a fresh socket; True if the control plane was lost."""
        # A fresh routing id per connection: nothing stale is routed to it, and the control
        # plane (which refuses a second connection under a live routing id) never takes a
        # reconnecting engine for the duplicate of its previous connection.
        if self.joining:
            self.engine_id = JOIN_ENGINE_ID
            identity = f"join-{uuid.uuid4().hex[:12]}".encode()
        else:
            identity = f"engine-{self.engine_id}.{uuid.uuid4().hex[:12]}".encode()
        self._sock = make_socket(ctx, zmq.DEALER, self.address, bind=False, identity=identity, curve=self.curve)
        self._peer = PeerSession(self.config.engines.heartbeat_timeout_s, time.monotonic())
        try:
            self._hello = EngineHello(engine_id=self.engine_id, protocol_version=PROTOCOL_VERSION, pid=os.getpid(),
                                      capabilities=capabilities, weights_version=self.weights_version,
                                      host_id=host_id(),  # engines use their host's KV pool
                                      secret=self._secret, previous_engine_id=self._previous_id,
                                      previous_control_plane=self._control_plane)
            await self._send(self._hello)
            self._peer.unanswered(time.monotonic())
            if not await self._await_accept():
                self.exit_code = 0 if self._stop.is_set() else 3
                return False
            heartbeat = asyncio.create_task(self._heartbeat_loop())
            try:
                return await self._serve()
            finally:
                heartbeat.cancel()
                self._log_spec()  # what the last interval drafted
        finally:
            self._sock.close(0)

    def stop(self) -> None:
        """Leave at the next loop turn (SIGTERM handler of a joined engine)."""
        self._stop.set()

    async def _drop_tasks(self) -> None:
        tasks = list(self._tasks.values())
        await self.backend.abort(list(self._tasks))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _send(self, msg: object) -> None:
        await self._sock.send_multipart(self._codec.encode(msg))

    async def _recv(self, timeout_s: float) -> ControlMessage | None:
        if not await self._sock.poll(timeout=int(timeout_s * 1000)):
            return None
        frames = await self._sock.recv_multipart()
        self._peer.heard(time.monotonic(), answers_hello=False)
        try:
            return self._codec.decode(frames)
        except FrameError as exc:
            log.error("control_message_rejected", engine_id=self.engine_id, code=exc.code, error=str(exc))
            return None

    async def _await_accept(self) -> bool:
        deadline = time.monotonic() + self.config.engines.startup_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            msg = await self._recv(1.0)
            if msg is None and self._peer.hello_due(time.monotonic()):
                # A hello can be lost (a control plane stopping as it arrived); the
                # control plane answers a repeated one from the same engine the same way.
                await self._send(self._hello)
            match msg:
                case HelloAccepted(engine_id=engine_id, control_plane=control_plane):
                    self._peer.heard(time.monotonic())
                    self.engine_id = engine_id  # assigned by the control plane when joining
                    if self.joining:
                        self._previous_id, self._control_plane = engine_id, control_plane
                    log.info("engine_registered", engine_id=self.engine_id, address=self.address,
                             joined=self.joining)
                    return True
                case HelloRejected(say_hello_again=True):
                    continue  # an answer to the previous session's messages: this hello is pending
                case HelloRejected(reason=reason):
                    log.error("engine_rejected", engine_id=self.engine_id, reason=reason)
                    print(f"seer engine {self.engine_id}: control plane refused this engine: {reason}", file=sys.stderr)
                    return False
                case _:
                    continue
        log.error("engine_registration_timed_out", engine_id=self.engine_id, address=self.address)
        return False

    def _parent_runs(self) -> bool:
        """Does the process that spawned this engine still run? (Its children are handed to
        init or a subreaper when it dies, so the parent pid changes.)"""
        return self.parent_pid is not None and not self.joining and os.getppid() == self.parent_pid

    async def _serve(self) -> bool:
        """Serve until Shutdown or a dead backend (False) or the control plane is lost (True)."""
        silent_since: float | None = None  # a stall of a daemon that still runs, while it lasts
        while not self._stop.is_set():
            msg = await self._recv(0.5)
            if self._stop.is_set():
                return False
            if msg is None:
                now = time.monotonic()
                if self._peer.timed_out(now):
                    if self._parent_runs():
                        if silent_since is None:
                            silent_since = self._peer.last_heard_s
                            log.warning("control_plane_silent", engine_id=self.engine_id,
                                        silent_s=round(now - silent_since, 1), parent_pid=self.parent_pid,
                                        action="the daemon process runs: waiting for it, work kept")
                        continue
                    log.error("control_plane_lost", engine_id=self.engine_id,
                              silent_s=round(now - self._peer.last_heard_s, 1))
                    return True
                continue
            if silent_since is not None:
                log.warning("control_plane_back", engine_id=self.engine_id,
                            silent_s=round(time.monotonic() - silent_since, 1))
                silent_since = None
            match msg:
                case ChunkTask():
                    self._tasks[msg.task_id] = asyncio.create_task(self._run_task(msg))
                case AbortTasks(task_ids=task_ids):
                    await self.backend.abort(task_ids)
                case LoadWeights(path=path, weights_version=version):
                    await self._load_weights(path, version)
                case Ping():
                    pass
                case Shutdown():
                    # The control plane is stopping. A joined engine is not its child: it
                    # waits for the next control plane on this address (a restart) instead.
                    log.info("engine_shutdown_requested", engine_id=self.engine_id, rejoin=self.joining)
                    return self.joining
                case HelloRejected(reason=reason):
                    # The control plane does not know us (it restarted on this address) or took
                    # us for lost (a stall): register again (``run``).
                    log.error("control_plane_forgot_engine", engine_id=self.engine_id, reason=reason)
                    return True
                case HelloAccepted():
                    pass

    async def _run_task(self, task: ChunkTask) -> None:
        t0 = time.monotonic()
        try:
            out = await self.backend.generate(task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - errors are data across processes
            log.exception("chunk_failed", engine_id=self.engine_id, task_id=task.task_id, request_id=task.request_id)
            await self._send(ChunkFailed(engine_id=self.engine_id, task_id=task.task_id, error=f"{type(exc).__name__}: {exc}"))
            if not self.backend.healthy():
                # A dead engine must not keep accepting work it will fail: exit, so the
                # control plane declares it lost and re-deals its requests elsewhere.
                log.error("engine_backend_died", engine_id=self.engine_id)
                self.exit_code = 1
                self._stop.set()
            return
        finally:
            self._tasks.pop(task.task_id, None)
        await self._send(ChunkFinished(
            engine_id=self.engine_id, task_id=task.task_id,
            token_ids=pack_token_ids(out.token_ids), logprobs=pack_logprobs(out.logprobs),
            finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens, elapsed_ms=(time.monotonic() - t0) * 1000.0,
            kv_loaded_tokens=out.kv_loaded_tokens, kv_load_ms=out.kv_load_ms,
            kv_load_failed_tokens=out.kv_load_failed_tokens,
            kv_saved_tokens=out.kv_saved_tokens,
        ))

    async def _load_weights(self, path: str, version: int) -> None:
        t0 = time.monotonic()
        try:
            await self.backend.load_weights(path)
        except Exception as exc:  # noqa: BLE001 - reported to the control plane as data
            log.exception("weights_load_failed", engine_id=self.engine_id, path=path)
            await self._send(WeightsLoaded(engine_id=self.engine_id, weights_version=self.weights_version,
                                           error=f"{type(exc).__name__}: {exc}"))
            return
        self.weights_version = version
        log.info("weights_loaded", engine_id=self.engine_id, weights_version=version,
                 latency_ms=round((time.monotonic() - t0) * 1000, 1))
        await self._send(WeightsLoaded(engine_id=self.engine_id, weights_version=version))

    async def _heartbeat_loop(self) -> None:
        last_spec_log = time.monotonic()
        while True:
            await self._send(EngineHeartbeat(engine_id=self.engine_id, load=self.load(),
                                             steps=pack_steps(self.backend.take_steps())))
            await asyncio.sleep(self.config.engines.heartbeat_interval_s)
            if time.monotonic() - last_spec_log >= SPEC_LOG_INTERVAL_S:
                self._log_spec()
                last_spec_log = time.monotonic()

    def load(self) -> EngineLoad:
        """The backend's load plus its cumulative speculative-decoding counts (the control
        plane exports both: docs/operations.md, "Metrics")."""
        load = self.backend.load()
        load.num_spec_drafts, load.num_spec_draft_tokens, load.num_spec_accepted_tokens = self.backend.spec_counts()
        return load

    def _log_spec(self) -> None:
        """Log what speculative decoding did since the last report (nothing if idle)."""
        now = self.backend.spec_counts()
        steps, drafted, accepted = (a - b for a, b in zip(now, self._spec_reported, strict=True))
        self._spec_reported = now
        if steps:
            log.info("speculation_stats", engine_id=self.engine_id, drafting_steps=steps, draft_tokens=drafted,
                     accepted_tokens=accepted, acceptance=round(accepted / drafted, 3) if drafted else 0.0,
                     tokens_per_drafting_step=round(1 + accepted / steps, 3))


def read_secret(fd: int) -> str:
    """The secret the supervisor wrote into the pipe ``fd`` (to its end), which is closed
    here: nothing this process starts later (vLLM's workers) inherits it."""
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seer-engine")
    parser.add_argument("--engine-id", type=int, required=True)
    parser.add_argument("--connect", required=True)
    parser.add_argument("--config", required=True, help="JSON-encoded SeerConfig file")
    parser.add_argument("--model-path", default="")
    parser.add_argument("--log-file", default="")
    parser.add_argument("--die-with-parent", action="store_true")
    parser.add_argument("--secret-fd", type=int, default=-1,
                        help="a pipe to read this engine's secret from (the supervisor's; read once, then closed)")
    args = parser.parse_args(argv)
    secret = read_secret(args.secret_fd) if args.secret_fd >= 0 else None
    parent_pid = None
    if args.die_with_parent:
        die_with_parent()
        parent_pid = os.getppid()  # the daemon (its death also sends this process SIGTERM)
    config = msgspec.json.decode(Path(args.config).read_bytes(), type=SeerConfig)
    from seer.logs import configure_logging

    configure_logging(f"engine-{args.engine_id}", Path(args.log_file) if args.log_file else None,
                      config.logging.level, console=True)
    # The supervisor writes the engine config into the run dir, where the draft server is.
    backend = make_backend(config, args.model_path, engine_id=args.engine_id, run_dir=str(Path(args.config).parent))
    try:
        import uvloop

        from seer.auth import client_curve

        curve = client_curve(config.server, args.connect)
        worker = EngineWorker(args.engine_id, args.connect, config, backend, curve=curve, parent_pid=parent_pid,
                              secret=secret)
        code = uvloop.run(_serve_until_stopped(worker, parent_pid is not None))
    except KeyboardInterrupt:
        return 130
    if parent_pid is not None and os.getppid() != parent_pid:
        _leave_nothing(parent_pid)
    return code


async def _serve_until_stopped(worker: EngineWorker, spawned: bool) -> int:
    """Run the worker. A spawned engine stops on SIGTERM (its daemon stopping it, or dead:
    ``--die-with-parent``) as on ``Shutdown``: the backend shuts its processes down (vLLM's
    engine core and workers, which unlink their shared memory). If that takes longer than
    STOP_GRACE_S, everything in this engine's process group is killed."""
    if spawned:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            worker.stop()
            loop.call_later(STOP_GRACE_S, _kill_own_group)

        loop.add_signal_handler(signal.SIGTERM, stop)
    return await worker.run()


def _leave_nothing(daemon_pid: int) -> None:
    """The daemon that spawned this engine died without stopping it (SIGKILL, the OOM
    killer): nobody else is left to clean up. Its KV pool segments are unlinked and any
    process of this engine's group still up (vLLM's, had its shutdown failed) is killed."""
    removed = remove_stale_shm(SEGMENT_PREFIX, pid=daemon_pid)
    log.warning("engine_outlived_daemon", daemon_pid=daemon_pid, removed_segments=removed)
    _kill_own_group()


def _kill_own_group() -> None:
    """SIGKILL this process's group, itself included, when it leads it (a spawned engine
    runs in its own session; a worker run by hand or in a test does not, and kills nothing)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
