"""The control-plane process: sockets, timers and the glue around the pure scheduler.

One uvloop event loop, two ROUTER sockets (trainer clients, engines), one reader task
per socket and one ticker. Every inbound message becomes a scheduler event; every
scheduler decision becomes an outbound message. Bad input from any peer is answered
with an ``ErrorReply`` (clients) or logged and counted (engines) — the loop survives.

Lifecycle: ``serve()`` binds, spawns engines (if a supervisor is given), serves until
``stop()``, then drains: open rollouts get an error, engines get ``Shutdown``, the
supervisor reaps their process groups, sockets close.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
import zmq
import zmq.asyncio

from seer.config import SeerConfig
from seer.controlplane.agents import Agents
from seer.controlplane.hostpools import LOCAL_HOST
from seer.controlplane.intake import Limits, RequestRejected, build_rollout
from seer.controlplane.pool import HostPool
from seer.controlplane.registry import Registry
from seer.controlplane.scheduler import Abort, Completion, Dispatch, Scheduler
from seer.controlplane.stats import rollout_stats
from seer.controlplane.supervisor import Supervisor
from seer.controlplane.tokenizer import Tokenizer
from seer.protocol import (
    JOIN_ENGINE_ID,
    PROTOCOL_VERSION,
    AbortTasks,
    Ack,
    AgentHello,
    AgentMessage,
    CancelRollout,
    ChunkFailed,
    ChunkFinished,
    ClientHeartbeat,
    ClientMessage,
    EngineHeartbeat,
    EngineHello,
    EngineMessage,
    ErrorReply,
    GroupCompleted,
    GroupResult,
    HelloAccepted,
    HelloRejected,
    LoadWeights,
    Ping,
    PullDone,
    RolloutAccepted,
    RolloutCompleted,
    RolloutProgress,
    RolloutRequest,
    SampleResult,
    ServiceStatus,
    Shutdown,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    UpdateWeightsRequest,
    WeightsLoaded,
    WeightsUpdated,
    unpack_logprobs,
    unpack_token_ids,
)
from seer.auth import ZapHandler, server_curve, watch_handshakes
from seer.wire import Codec, FrameError, make_socket

log = structlog.get_logger()

# A request whose chunks fail this many times fails its rollout instead of looping.
MAX_CHUNK_FAILURES = 3


@dataclass
class ClientSession:
    identity: bytes
    call_id: str
    last_heard_s: float


@dataclass
class WeightUpdate:
    identity: bytes
    call_id: str
    version: int
    path: str
    pending: set[int]
    errors: list[str]
    deadline_s: float


def _log_client_send_error(sent: asyncio.Future) -> None:
    if not sent.cancelled() and (exc := sent.exception()) is not None:
        log.warning("client_unreachable", error=str(exc))


class ControlPlane:
    def __init__(
        self,
        config: SeerConfig,
        *,
        client_address: str,
        engine_address: str,
        tokenizer: Tokenizer,
        run_dir: Path,
        supervisor: Supervisor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.client_address = client_address
        self.engine_address = engine_address
        self.tokenizer = tokenizer
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.clock = clock
        self.scheduler = Scheduler(config.scheduler.policy, clock, config.scheduler, decode=tokenizer.decode)
        self.registry = Registry(config.engines.heartbeat_timeout_s)
        self.weights_version = 0
        self.sessions: dict[str, ClientSession] = {}  # rollout_id -> client
        self.weight_update: WeightUpdate | None = None
        self._stranded_deadline_s: float | None = None  # every engine lost: wait for a joiner until then
        self.num_bad_client_frames = 0
        self.num_bad_engine_frames = 0
        self._stopping = asyncio.Event()
        self._client_codec: Codec[ClientMessage] = Codec(ClientMessage, config.server.max_request_bytes)
        # Engines and host agents share the engine socket (same address, same CURVE keys).
        self._engine_codec: Codec[EngineMessage | AgentMessage] = Codec(EngineMessage | AgentMessage)
        self.host_pool = HostPool(config.kv_pool, config)
        self.agents = Agents(config.kv_pool, self.scheduler, self._send_identity, clock)

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        ctx = zmq.asyncio.Context()
        hard_cap = 2 * self.config.server.max_request_bytes + 4096
        server = self.config.server
        # CURVE on tcp:// sockets; the ZAP handler must be bound before they accept peers.
        client_curve, engine_curve = server_curve(server, self.client_address), server_curve(server, self.engine_address)
        zap = ZapHandler(ctx, server.curve_authorized_keys) if client_curve or engine_curve else None
        self._clients = make_socket(ctx, zmq.ROUTER, self.client_address, bind=True, max_message_bytes=hard_cap,
                                    curve=client_curve)
        self._engines = make_socket(ctx, zmq.ROUTER, self.engine_address, bind=True, curve=engine_curve)
        watchers = [asyncio.create_task(watch_handshakes(sock, name))
                    for sock, name, curve in ((self._clients, "clients", client_curve),
                                              (self._engines, "engines", engine_curve)) if curve]
        if zap is not None:
            zap.start()
        log.info("control_plane_started", client_address=self.client_address, engine_address=self.engine_address,
                 policy=self.config.scheduler.policy, pid=os.getpid())
        if self.supervisor is not None:
            for proc in self.supervisor.spawn_all():
                self.registry.expect(proc.engine_id, proc.pid, self.clock())
                log.info("engine_spawned", engine_id=proc.engine_id, pid=proc.pid)
        readers = [asyncio.create_task(self._client_loop()), asyncio.create_task(self._engine_loop()),
                   asyncio.create_task(self._tick_loop())]
        ready_task = asyncio.create_task(self._wait_ready(on_ready)) if on_ready else None
        try:
            await self._stopping.wait()
        finally:
            if ready_task:
                ready_task.cancel()
            await self._drain()
            for task in readers + watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            if zap is not None:
                zap.close()
            self._clients.close(0)
            self._engines.close(0)
            ctx.term()
            self.host_pool.close()
            log.info("control_plane_stopped")

    def stop(self) -> None:
        self._stopping.set()

    async def _wait_ready(self, on_ready: Callable[[], None]) -> None:
        deadline = self.clock() + self.config.engines.startup_timeout_s
        while self.registry.num_starting() and self.clock() < deadline:
            await asyncio.sleep(0.2)
        on_ready()

    async def _drain(self) -> None:
        for rollout_id in list(self.sessions):
            self._fail_rollout(rollout_id, "shutting_down", "the Seer daemon is shutting down; retry against a running daemon")
        for engine_id in self.registry.connected_ids():
            await self._send_engine(engine_id, Shutdown())
            self.registry.mark(engine_id, "stopped")
        if self.supervisor is not None:
            await asyncio.to_thread(self.supervisor.stop_all, 30.0)

    # ------------------------------------------------------------------ sending
    async def _send_engine(self, engine_id: int, msg: object) -> bool:
        try:
            record = self.registry.engines.get(engine_id)
            identity = record.identity if record is not None else f"engine-{engine_id}".encode()
            await self._engines.send_multipart([identity, *self._engine_codec.encode(msg)])
            return True
        except zmq.ZMQError as exc:
            log.warning("engine_unreachable", engine_id=engine_id, error=str(exc))
            return False

    def _send_client(self, identity: bytes, msg: object) -> None:
        # On a zmq.asyncio socket a send never raises here: it returns a future that holds
        # the error (EHOSTUNREACH: the client is gone), so the error is read off the future.
        sent = self._clients.send_multipart([identity, *self._client_codec.encode(msg)], flags=zmq.NOBLOCK)
        sent.add_done_callback(_log_client_send_error)

    # ------------------------------------------------------------------ engines
    async def _engine_loop(self) -> None:
        while True:
            frames = await self._engines.recv_multipart()
            identity, payload = frames[0], frames[1:]
            try:
                msg = self._engine_codec.decode(payload)
            except FrameError as exc:
                self.num_bad_engine_frames += 1
                log.error("engine_frame_rejected", identity=identity.decode(errors="replace"), code=exc.code, error=str(exc))
                if exc.code == "protocol_mismatch":
                    await self._reply_engine(identity, HelloRejected(reason=str(exc)))
                continue
            if isinstance(msg, (AgentHello, PullDone)):
                try:
                    await self._on_agent_message(identity, msg)
                except Exception:  # noqa: BLE001 - one bad message must not kill the control plane
                    log.exception("agent_message_failed", identity=identity.decode(errors="replace"))
                continue
            if not isinstance(msg, EngineHello):
                record = self.registry.by_identity(identity)
                if record is None or record.engine_id != getattr(msg, "engine_id", None):
                    # Not an engine registered here under that id — typically one that
                    # outlived a previous control plane on this address: ask it to register.
                    log.warning("unregistered_engine_message", identity=identity.decode(errors="replace"),
                                message=type(msg).__name__)
                    reason = (f"this control plane has no engine registered as {identity!r}; "
                              "it may have restarted: say hello again")
                    await self._reply_engine(identity, HelloRejected(reason=reason))
                    continue
            try:
                await self._on_engine_message(identity, msg)
            except Exception:  # noqa: BLE001 - one bad message must not kill the control plane
                log.exception("engine_message_failed", identity=identity.decode(errors="replace"))

    async def _on_engine_message(self, identity: bytes, msg: EngineMessage) -> None:
        now = self.clock()
        match msg:
            case EngineHello():
                await self._on_hello(identity, msg)
            case EngineHeartbeat(engine_id=engine_id, load=load):
                self.registry.heard(engine_id, now, load)
                self.scheduler.engine_load(engine_id, load)
            case ChunkFinished():
                self.registry.heard(msg.engine_id, now)
                self._on_chunk_finished(msg)
                await self._schedule()
            case ChunkFailed(engine_id=engine_id, task_id=task_id, error=error):
                self.registry.heard(engine_id, now)
                request = self.scheduler.chunk_failed(engine_id, task_id)
                log.error("chunk_failed", engine_id=engine_id, task_id=task_id, error=error,
                          request_id=request.request_id if request else None,
                          num_failures=request.num_failures if request else None)
                if request is not None and request.num_failures >= MAX_CHUNK_FAILURES:
                    self._fail_rollout(request.group.rollout.rollout_id, "request_failed",
                                       f"request {request.request_id} failed {request.num_failures} times; last "
                                       f"error on engine {engine_id}: {error}. See the engine logs in {self.run_dir}")
                await self._schedule()
            case WeightsLoaded() if self.registry.is_updating(msg.engine_id):
                await self._on_caught_up(msg)
            case WeightsLoaded():
                self._on_weights_loaded(msg)

    async def _on_agent_message(self, identity: bytes, msg: AgentHello | PullDone) -> None:
        if isinstance(msg, AgentHello):
            if self._stopping.is_set():
                return
            await self._send_dispatches(await self.agents.on_hello(identity, msg))
        else:
            await self._send_dispatches(self.agents.on_pull_done(identity, msg))
        await self._schedule()

    async def _send_identity(self, identity: bytes, msg: object) -> bool:
        """Send to a peer of the engine socket that may already be gone (EHOSTUNREACH must
        not kill the reader); False if it is."""
        try:
            await self._engines.send_multipart([identity, *self._engine_codec.encode(msg)])
            return True
        except zmq.ZMQError as exc:
            log.warning("engine_unreachable", identity=identity.decode(errors="replace"), error=str(exc))
            return False

    async def _reply_engine(self, identity: bytes, msg: object) -> None:
        await self._send_identity(identity, msg)

    async def _on_hello(self, identity: bytes, hello: EngineHello) -> None:
        if self._stopping.is_set():
            return  # draining: no answer, so the engine keeps saying hello until the next control plane
        joined = hello.engine_id == JOIN_ENGINE_ID
        known = self.registry.by_identity(identity)
        if known is not None and known.state == "ready" and known.pid == hello.pid:
            # A repeated hello (engines repeat it until answered): same engine, same id.
            await self._send_engine(known.engine_id, HelloAccepted(engine_id=known.engine_id))
            return
        if self.weight_update is not None:
            return  # no answer mid-update: the engine repeats its hello and joins at the new version
        if joined:
            hello = msgspec.structs.replace(hello, engine_id=self.registry.next_engine_id(self.config.engines.count))
        expected = identity if joined else f"engine-{hello.engine_id}".encode()
        taken = self.registry.engines.get(hello.engine_id)
        replay = self.registry.weights_to_replay(hello, self.weights_version)
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (f"engine speaks protocol {hello.protocol_version}, control plane speaks {PROTOCOL_VERSION}; "
                      "run the same Seer version everywhere")
        elif not joined and taken is not None and taken.state == "ready" and taken.pid != hello.pid:
            reason = (f"engine id {hello.engine_id} is taken by the ready engine of pid {taken.pid}; "
                      "join with `seerctl engine --join` to get a free id")
        elif identity != expected:
            reason = f"engine {hello.engine_id} connected with identity {identity!r}, expected {expected!r}"
        elif hello.weights_version != self.weights_version and replay is None:
            reason = (f"engine has weights version {hello.weights_version}, the service is at {self.weights_version}; "
                      + (self.registry.replay_error(hello) or "restart the daemon or update weights before adding engines"))
        else:
            reason = ""
        if reason:
            log.error("engine_rejected", engine_id=hello.engine_id, reason=reason)
            await self._reply_engine(identity, HelloRejected(reason=reason))
            return
        if hello.weights_version != self.weights_version:
            # Joined after an update: bring it to the current weights before any work.
            self.registry.updating(hello, self.clock(), identity=identity, joined=joined)
            await self._send_engine(hello.engine_id, HelloAccepted(engine_id=hello.engine_id))
            assert replay is not None
            await self._send_engine(hello.engine_id, LoadWeights(path=replay, weights_version=self.weights_version))
            log.info("engine_weights_replayed", engine_id=hello.engine_id, pid=hello.pid, joined=joined,
                     from_weights_version=hello.weights_version, weights_version=self.weights_version, path=replay)
            return
        await self._admit(identity, hello, joined)

    async def _admit(self, identity: bytes, hello: EngineHello, joined: bool) -> None:
        """Register an engine with current weights as ready and give it work."""
        self.registry.ready(hello.engine_id, hello.pid, hello.capabilities, hello.weights_version, self.clock(),
                            identity=identity, joined=joined)
        host = self.agents.core_host(hello.host_id)
        if host == LOCAL_HOST:  # another host's pool comes from its agent's hello
            self._bind_pool(hello.engine_id, hello.capabilities.kv_geometry)
        self.scheduler.engine_joined(hello.engine_id, hello.capabilities, host_id=host)
        await self._send_engine(hello.engine_id, HelloAccepted(engine_id=hello.engine_id))
        log.info("engine_ready", engine_id=hello.engine_id, pid=hello.pid, joined=joined, backend=hello.capabilities.backend,
                 host_id=hello.host_id or self.agents.local_host_id,
                 kv_capacity_tokens=hello.capabilities.kv_capacity_tokens,
                 max_model_len=hello.capabilities.max_model_len, weights_version=hello.weights_version)
        await self._schedule()

    async def _on_caught_up(self, msg: WeightsLoaded) -> None:
        """A newcomer finished loading the replayed weights: ready for work, or out."""
        record = self.registry.engines[msg.engine_id]
        if msg.error or msg.weights_version != self.weights_version:
            reason = msg.error or f"loaded weights version {msg.weights_version}, the service is at {self.weights_version}"
            log.error("engine_rejected", engine_id=msg.engine_id, reason=f"weights replay failed: {reason}",
                      fix="check the last update_weights checkpoint still exists on this host")
            self.registry.replay_failed(msg.engine_id, reason)
            # It says hello again (a joined engine) and is refused then, naming the failure.
            await self._send_engine(msg.engine_id, HelloRejected(reason=f"weights replay failed: {reason}"))
            return
        assert record.hello is not None
        await self._admit(record.identity, msgspec.structs.replace(record.hello, weights_version=msg.weights_version),
                          record.joined)

    def _bind_pool(self, engine_id: int, geometry) -> None:
        """Create the host KV pool for the first engine that can use it; later engines
        must have the same block geometry to share it."""
        if geometry is None or not self.config.kv_pool.enabled:
            return
        pool = self.scheduler.pool
        if pool is None:
            try:
                self.scheduler.attach_pool(self.host_pool.create(geometry))
            except OSError as exc:
                log.error("kv_pool_unavailable", error=str(exc),
                          fix="free /dev/shm or lower kv_pool.pool_gib; chunks re-prefill meanwhile")
                return
            # This host's agent serves the pool to engines on other hosts (and pulls into it).
            self.host_pool.start_agent(self.engine_address, self.run_dir)
        elif geometry.fingerprint != pool.fingerprint:
            log.warning("kv_pool_geometry_mismatch", engine_id=engine_id, engine=geometry.fingerprint,
                        pool=pool.fingerprint, effect="this engine re-prefills instead of loading from the pool")

    def _on_chunk_finished(self, msg: ChunkFinished) -> None:
        tokens = unpack_token_ids(msg.token_ids)
        done = self.scheduler.chunk_finished(msg.engine_id, msg.task_id, tokens, unpack_logprobs(msg.logprobs),
                                             msg.finish_reason, kv_saved_tokens=msg.kv_saved_tokens)
        if done is None:
            log.debug("stale_chunk_ignored", engine_id=msg.engine_id, task_id=msg.task_id)
            return
        request = done.request
        group = request.group
        log.info("chunk_finished", request_id=request.request_id, group_id=group.group_id,
                 rollout_id=group.rollout.rollout_id, engine_id=msg.engine_id, task_id=msg.task_id,
                 num_tokens=len(tokens), num_prompt_tokens=msg.num_prompt_tokens,
                 num_cached_tokens=msg.num_cached_tokens, kv_loaded_tokens=msg.kv_loaded_tokens,
                 kv_saved_tokens=msg.kv_saved_tokens, finish_reason=msg.finish_reason,
                 latency_ms=round(msg.elapsed_ms, 1))
        if request.migrated_from is not None:
            geometry = self.scheduler.engines[msg.engine_id].capabilities.kv_geometry
            bytes_per_token = geometry.bytes_per_token if geometry is not None else 0
            log.info("chunk_migrated", request_id=request.request_id, group_id=group.group_id,
                     rollout_id=group.rollout.rollout_id, task_id=msg.task_id,
                     from_engine_id=request.migrated_from, to_engine_id=msg.engine_id,
                     prefix_tokens=msg.num_prompt_tokens, kv_loaded_tokens=msg.kv_loaded_tokens,
                     num_bytes=msg.kv_loaded_tokens * bytes_per_token,
                     # unknown (None) when the chunk finished in its loading step: vLLM hands
                     # the worker's timing to the connector only after finishing requests
                     load_ms=round(msg.kv_load_ms, 3) if msg.kv_load_ms or not msg.kv_loaded_tokens else None,
                     # prompt tokens this engine computed instead (its own cache covered the rest)
                     reprefill_tokens=msg.num_prompt_tokens - msg.num_cached_tokens,
                     mode="pool" if msg.kv_loaded_tokens else "reprefill")
        if msg.kv_load_failed_tokens:
            log.warning("kv_load_fell_back", request_id=request.request_id, engine_id=msg.engine_id,
                        task_id=msg.task_id, failed_tokens=msg.kv_load_failed_tokens,
                        effect="recomputed by the engine (stale, corrupted or missing pool blocks)")
            request.migrated_from = None
        self._deliver(done)

    def _deliver(self, done: Completion) -> None:
        group = done.group_finished
        if group is None:
            return
        rollout = group.rollout
        session = self.sessions.get(rollout.rollout_id)
        if session is not None:
            self._send_client(session.identity, GroupCompleted(
                call_id=session.call_id, rollout_id=rollout.rollout_id, group=self._group_result(group)))
        log.info("group_finished", group_id=group.group_id, rollout_id=rollout.rollout_id,
                 num_groups_done=rollout.num_groups_done, num_groups=len(rollout.groups))
        if done.rollout_finished is not None:
            stats = rollout_stats(rollout, self.scheduler.preemptions_since_start(rollout))
            log.info("rollout_finished", rollout_id=rollout.rollout_id, policy=rollout.policy,
                     num_samples=stats.num_samples, num_output_tokens=stats.num_output_tokens,
                     wall_time_s=round(stats.wall_time_s, 3), tail_time_s=round(stats.tail_time_s, 3),
                     num_preemptions=stats.num_preemptions)
            if session is not None:
                self._send_client(session.identity, RolloutCompleted(
                    call_id=session.call_id, rollout_id=rollout.rollout_id, stats=stats,
                    weights_version=self.weights_version))
            self.sessions.pop(rollout.rollout_id, None)
            self.scheduler.forget(rollout.rollout_id)

    def _group_result(self, group) -> GroupResult:
        t0 = group.rollout.accepted_s
        return GroupResult(group_index=group.group_index, prompt_id=group.prompt_id, samples=[
            SampleResult(
                sample_index=r.sample_index, token_ids=list(r.generated_token_ids), logprobs=list(r.logprobs),
                text=self.tokenizer.decode(r.generated_token_ids), finish_reason=r.finish_reason,
                num_prompt_tokens=len(r.prompt_token_ids), first_scheduled_s=(r.first_scheduled_s or t0) - t0,
                finished_s=(r.finished_s or t0) - t0, engine_ids=list(r.engine_history),
            ) for r in group.requests])

    def _on_weights_loaded(self, msg: WeightsLoaded) -> None:
        update = self.weight_update
        if update is None or msg.engine_id not in update.pending:
            return
        update.pending.discard(msg.engine_id)
        if msg.error:
            update.errors.append(f"engine {msg.engine_id}: {msg.error}")
        else:
            self.registry.engines[msg.engine_id].weights_version = msg.weights_version
        if not update.pending:
            self._finish_weight_update()

    def _finish_weight_update(self) -> None:
        update = self.weight_update
        assert update is not None
        self.weight_update = None
        if update.errors:
            log.error("weights_update_failed", path=update.path, errors=update.errors)
            self._send_client(update.identity, ErrorReply(
                call_id=update.call_id, code="weights_update_failed",
                message="; ".join(update.errors) + ". Engines that failed keep their previous weights; "
                "fix the checkpoint and call update_weights again"))
            return
        self.weights_version = update.version
        self.registry.weights_path = update.path  # replayed to engines that join later
        log.info("weights_updated", weights_version=update.version, path=update.path)
        self._send_client(update.identity, WeightsUpdated(call_id=update.call_id, weights_version=update.version))

    # ------------------------------------------------------------------ clients
    async def _client_loop(self) -> None:
        while True:
            frames = await self._clients.recv_multipart()
            identity, payload = frames[0], frames[1:]
            try:
                msg = self._client_codec.decode(payload)
            except FrameError as exc:
                self.num_bad_client_frames += 1
                log.warning("client_frame_rejected", code=exc.code, error=str(exc))
                self._send_client(identity, ErrorReply(call_id="", code=exc.code, message=str(exc)))
                continue
            try:
                await self._on_client_message(identity, msg)
            except Exception as exc:  # noqa: BLE001 - answer, log with traceback, keep serving
                log.exception("client_message_failed", call_id=getattr(msg, "call_id", ""))
                self._send_client(identity, ErrorReply(call_id=getattr(msg, "call_id", ""), code="internal_error",
                                                       message=f"internal error: {type(exc).__name__}: {exc} "
                                                       f"(see {self.run_dir / 'controlplane.log'})"))

    async def _on_client_message(self, identity: bytes, msg: ClientMessage) -> None:
        now = self.clock()
        match msg:
            case RolloutRequest():
                self._on_rollout(identity, msg)
                await self._schedule()
            case ClientHeartbeat(call_id=call_id, rollout_ids=rollout_ids):
                for rollout_id in rollout_ids:
                    if rollout_id in self.sessions:
                        self.sessions[rollout_id].last_heard_s = now
                self._send_client(identity, Ack(call_id=call_id))  # lets the client see we are alive
            case CancelRollout(call_id=call_id, rollout_id=rollout_id):
                await self._cancel(rollout_id, "cancelled")
                self._send_client(identity, Ack(call_id=call_id))
            case StatusRequest(call_id=call_id):
                self._send_client(identity, StatusReply(call_id=call_id, status=self.status()))
            case UpdateWeightsRequest():
                await self._on_update_weights(identity, msg)
            case ShutdownRequest(call_id=call_id):
                self._send_client(identity, Ack(call_id=call_id))
                self.stop()

    def _on_rollout(self, identity: bytes, req: RolloutRequest) -> None:
        def refuse(code: str, message: str) -> None:
            log.warning("rollout_rejected", rollout_id=req.rollout_id, code=code, error=message)
            self._send_client(identity, ErrorReply(call_id=req.call_id, code=code, message=message))

        ready = self.registry.ready_ids()
        if not ready:
            starting = self.registry.num_starting()
            return refuse("no_engines", f"no engine is ready ({starting} starting); wait until `seerctl status` "
                          "shows ready engines, or check the engine logs in the run dir")
        if self.weight_update is not None:
            return refuse("busy", "a weights update is in progress; retry when it has finished")
        if req.rollout_id in self.sessions or req.rollout_id in self.scheduler.rollouts:
            return refuse("duplicate_rollout", f"rollout id {req.rollout_id!r} is already running; use a fresh id")
        caps = [self.registry.engines[e].capabilities for e in ready]
        limits = Limits(
            max_group_size=self.config.server.max_group_size,
            max_prompts=self.config.server.max_prompts_per_rollout,
            max_model_len=min(c.max_model_len for c in caps if c),
            vocab_size=min(c.vocab_size for c in caps if c),
        )
        policy = req.policy or self.config.scheduler.policy
        try:
            rollout = build_rollout(req, self.tokenizer, limits, policy, self.clock())
        except RequestRejected as exc:
            return refuse(exc.code, str(exc))
        self.scheduler.submit(rollout)
        self.sessions[req.rollout_id] = ClientSession(identity, req.call_id, self.clock())
        log.info("rollout_accepted", rollout_id=req.rollout_id, policy=policy, num_groups=len(rollout.groups),
                 num_samples=rollout.num_samples, max_tokens=req.sampling.max_tokens)
        self._send_client(identity, RolloutAccepted(call_id=req.call_id, rollout_id=req.rollout_id,
                                                    num_groups=len(rollout.groups), policy=policy,
                                                    weights_version=self.weights_version))

    async def _on_update_weights(self, identity: bytes, req: UpdateWeightsRequest) -> None:
        def refuse(code: str, message: str) -> None:
            self._send_client(identity, ErrorReply(call_id=req.call_id, code=code, message=message))

        if self.sessions or any(not r.done for r in self.scheduler.rollouts.values()):
            return refuse("rollout_running", f"{len(self.sessions)} rollout(s) are running; weights can only be "
                          "updated between rollouts (wait for them or cancel them first)")
        if self.weight_update is not None or self.registry.updating_ids():
            return refuse("busy", "another weights update is in progress (or an engine is loading the current "
                          "weights); retry in a moment")
        if not os.path.exists(req.path):
            return refuse("bad_weights_path", f"weights path {req.path!r} does not exist on the daemon's host")
        ready = self.registry.ready_ids()
        if not ready:
            return refuse("no_engines", "no engine is ready to load weights")
        version = self.weights_version + 1
        self.weight_update = WeightUpdate(identity, req.call_id, version, req.path, set(ready), [],
                                          self.clock() + self.config.engines.startup_timeout_s)
        log.info("weights_update_started", weights_version=version, path=req.path, engines=ready)
        # From here on no KV computed with the old weights may load, whatever the outcome.
        await self._send_dispatches(self.scheduler.weights_changed())
        for engine_id in ready:
            await self._send_engine(engine_id, LoadWeights(path=req.path, weights_version=version))

    async def _cancel(self, rollout_id: str, reason: str) -> None:
        aborts = self.scheduler.cancel(rollout_id)
        self.sessions.pop(rollout_id, None)
        await self._send_aborts(aborts)
        log.info("rollout_aborted", rollout_id=rollout_id, reason=reason,
                 num_aborted_tasks=sum(len(a.task_ids) for a in aborts))
        await self._schedule()

    async def _send_aborts(self, aborts: list[Abort]) -> None:
        for abort in aborts:
            await self._send_engine(abort.engine_id, AbortTasks(task_ids=abort.task_ids))

    def _fail_rollout(self, rollout_id: str, code: str, message: str) -> None:
        session = self.sessions.pop(rollout_id, None)
        aborts = self.scheduler.cancel(rollout_id)
        for abort in aborts:
            asyncio.ensure_future(self._send_engine(abort.engine_id, AbortTasks(task_ids=abort.task_ids)))
        if session is not None:
            self._send_client(session.identity, ErrorReply(call_id=session.call_id, code=code, message=message))
        log.error("rollout_failed", rollout_id=rollout_id, code=code, error=message)

    # ------------------------------------------------------------------ scheduling and timers
    async def _schedule(self) -> None:
        await self._send_dispatches(self.scheduler.schedule())
        # Chunks placed on another host than their KV wait for these; each ends in PullDone.
        await self._send_dispatches(await self.agents.send_transfers())

    async def _send_dispatches(self, dispatches: list[Dispatch]) -> None:
        for d in dispatches:
            kv = d.task.kv
            log.info("chunk_dispatched", request_id=d.request.request_id, group_id=d.request.group.group_id,
                     rollout_id=d.request.group.rollout.rollout_id, engine_id=d.engine_id, task_id=d.task.task_id,
                     max_tokens=d.task.sampling.max_tokens, num_prompt_tokens=len(d.task.prompt_token_ids) // 4,
                     kv_valid_tokens=kv.valid_tokens if kv else 0, kv_save=kv.save if kv else False)
            if d.kv_pool_full:
                pool = self.scheduler.kv.pool_of(d.engine_id)  # the pool of the engine's host
                log.warning("kv_pool_full", request_id=d.request.request_id, pool=pool.name if pool else None,
                            num_free_blocks=pool.allocator.num_free if pool else 0,
                            effect="chunk not saved; its next chunk re-prefills",
                            fix="raise kv_pool.pool_gib")
            if not await self._send_engine(d.engine_id, d.task):
                self._lose_engine(d.engine_id, "unreachable")

    async def _tick_loop(self) -> None:
        interval = min(0.5, self.config.engines.heartbeat_interval_s)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._tick()
            except Exception:  # noqa: BLE001 - the ticker must keep ticking
                log.exception("tick_failed")

    async def _tick(self) -> None:
        now = self.clock()
        self._check_stranded(now)
        await self._send_dispatches(self.agents.expire(now))
        if (exit_reason := self.host_pool.agent_exited()) is not None:
            await self._send_dispatches(self.agents.lost(LOCAL_HOST, exit_reason))
        for engine_id in self.registry.connected_ids():
            await self._send_engine(engine_id, Ping())
        # Agents too: one that hears no ping says hello again (a restarted control plane learns
        # about it); one that cannot be reached any more is lost.
        await self._send_dispatches(await self.agents.ping())
        for engine_id in self.registry.silent(now):
            self._lose_engine(engine_id, f"silent for more than {self.registry.heartbeat_timeout_s:.0f} s")
        if self.supervisor is not None:
            for proc in self.supervisor.processes.values():
                code = proc.exited()
                record = self.registry.engines.get(proc.engine_id)
                if code is not None and record is not None and record.state in ("ready", "starting", "updating"):
                    self._lose_engine(proc.engine_id, f"process {proc.pid} exited with code {code}; "
                                      f"see {self.run_dir / f'engine-{proc.engine_id}.out'}")
        for rollout_id, session in list(self.sessions.items()):
            if now - session.last_heard_s > self.config.server.client_timeout_s:
                log.warning("client_lost", rollout_id=rollout_id,
                            silent_s=round(now - session.last_heard_s, 1))
                await self._cancel(rollout_id, "client_lost")
        update = self.weight_update
        if update is not None:
            for engine_id in list(update.pending):
                if self.registry.engines[engine_id].state != "ready":
                    update.pending.discard(engine_id)
                    update.errors.append(f"engine {engine_id} was lost during the update")
            if now > update.deadline_s:
                update.errors.append(f"engines {sorted(update.pending)} did not answer in time")
                update.pending.clear()
            if not update.pending:
                self._finish_weight_update()
        await self._schedule()

    def _lose_engine(self, engine_id: int, reason: str) -> None:
        record = self.registry.engines.get(engine_id)
        if record is None or record.state == "lost":
            return
        was_starting = record.state == "starting"
        self.registry.mark(engine_id, "lost")
        report = self.scheduler.engine_lost(engine_id)
        log.error("engine_lost", engine_id=engine_id, reason=reason, was_starting=was_starting,
                  num_requeued=len(report.requeued))
        if report.stranded_rollouts and self.config.engines.replacement_wait_s > 0:
            self._stranded_deadline_s = self.clock() + self.config.engines.replacement_wait_s
            self._stranded_cause = f"last: engine {engine_id}, {reason}"
            log.warning("waiting_for_engines", num_rollouts=len(report.stranded_rollouts),
                        wait_s=self.config.engines.replacement_wait_s)
            return
        for rollout in report.stranded_rollouts:
            self._fail_rollout(rollout.rollout_id, "no_engines",
                               f"every engine is lost (last: engine {engine_id}, {reason}); the rollout cannot "
                               "finish. Check the engine logs in the run dir and restart the daemon")

    def _check_stranded(self, now: float) -> None:
        """Fail the rollouts stranded by losing every engine once no engine joined in time."""
        if self._stranded_deadline_s is None:
            return
        if self.scheduler.live_engines():
            self._stranded_deadline_s = None
            return
        if now < self._stranded_deadline_s:
            return
        self._stranded_deadline_s = None
        for rollout in [r for r in self.scheduler.rollouts.values() if not r.done]:
            self._fail_rollout(rollout.rollout_id, "no_engines",
                               f"every engine is lost ({self._stranded_cause}) and none joined within "
                               f"engines.replacement_wait_s = {self.config.engines.replacement_wait_s:g} s; "
                               "check the engine logs in the run dir, join engines or restart the daemon")

    # ------------------------------------------------------------------ status
    def status(self) -> ServiceStatus:
        now = self.clock()
        rollouts = [RolloutProgress(rollout_id=r.rollout_id, policy=r.policy, num_groups=len(r.groups),
                                    num_groups_done=r.num_groups_done, num_samples=r.num_samples,
                                    num_samples_done=r.num_samples_done, num_output_tokens=r.num_output_tokens,
                                    elapsed_s=now - r.accepted_s)
                    for r in self.scheduler.rollouts.values()]
        return ServiceStatus(pid=os.getpid(), policy=self.config.scheduler.policy,
                             weights_version=self.weights_version,
                             engines=[e.status() for _, e in sorted(self.registry.engines.items())],
                             rollouts=rollouts, run_dir=str(self.run_dir), client_address=self.client_address)
