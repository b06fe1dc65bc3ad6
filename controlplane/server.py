"""The control-plane process: sockets, timers and the glue around the pure scheduler.

One uvloop event loop, two ROUTER sockets (trainer clients, engines), one reader task
per socket and one ticker. Every inbound message becomes a scheduler event; every
scheduler decision becomes an outbound message. Bad input from any peer is answered
with an ``ErrorReply`` (clients) or logged and counted (engines) — the loop survives.

The server is the only place that sends: the parts return an ``Outbox`` of (peer,
message) (``outbox.py``) and ``_deliver`` sends it, in order, awaiting each send.

Lifecycle: ``serve()`` binds, spawns engines (if a supervisor is given), serves until
``stop()``, then drains: open rollouts get an error, engines get ``Shutdown``, the
supervisor reaps their process groups, sockets close.

Glued here, each in its own module: engine hellos, admission and stranded rollouts
(``membership.py``); client sessions, intake, delivery and failures (``sessions.py``, fields
from ``results.py``); the weights-update lifecycle (``weights.py``); the KV pool (``kvpool/``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import assert_never

import structlog
import zmq
import zmq.asyncio

from seer.config import SeerConfig
from seer.controlplane.deadlines import ChunkDeadlines
from seer.controlplane.kvpool.agents import Agents, ToAgent
from seer.controlplane.kvpool.table import LOCAL_HOST
from seer.controlplane.metrics import Metrics
from seer.controlplane.metrics_http import serve_metrics
from seer.controlplane.metrics_state import StateCollector
from seer.controlplane.launcher import EngineLauncher, match_engine
from seer.controlplane.membership import Membership, ModelExpectations, StrandedWait, lost_message
from seer.controlplane.memory import FOLLOW_UP_TRIMS, RolloutEnds, release, trim
from seer.controlplane.outbox import Outbox, ToClient, ToEngine, ToPeer
from seer.controlplane.kvpool.disk import DiskRunner
from seer.controlplane.kvpool.segment import PoolSegmentOwner
from seer.controlplane.registry import Registry
from seer.controlplane.results import chunk_dispatched_fields, kv_pool_full_fields
from seer.controlplane.sessions import ClientSessions
from seer.controlplane.scheduler import Dispatch, Scheduler
from seer.controlplane.state import EngineState, Request
from seer.controlplane.supervisor import Supervisor
from seer.controlplane.tokenizer import Tokenizer
from seer.controlplane.weights import Weights
from seer.protocol import (
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
    HelloRejected,
    Ping,
    PullDone,
    RolloutProgress,
    RolloutRequest,
    ServiceStatus,
    Shutdown,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    UpdateWeightsRequest,
    WeightsLoaded,
    unpack_steps,
)
from seer.auth import ZapHandler, server_curve, watch_handshakes
from seer.wire import Codec, FrameError, make_socket

log = structlog.get_logger()

# An engine in these states whose process exited is lost.
LIVE_OR_STARTING = (EngineState.READY, EngineState.STARTING, EngineState.UPDATING)

# Sends delivered between two chances for the loop to run other tasks.
DELIVER_BATCH = 256

# A reader that has run this long without giving the loop back yields before its next message.
LOOP_SLICE_S = 0.005

# A loop stall (the ticker woke this much later than asked) is logged as ``loop_stalled``.
LOOP_STALL_LOGGED_S = 1.0

# A request whose chunks fail this many times fails its rollout instead of looping.
MAX_CHUNK_FAILURES = 3


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
        launcher: EngineLauncher | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics_socket: socket.socket | None = None,
    ) -> None:
        self.config = config
        self.client_address = client_address
        self.engine_address = engine_address
        self.tokenizer = tokenizer
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.launcher = launcher  # engines that join from elsewhere (a Ray cluster): controlplane/launcher.py
        self.clock = clock
        self.registry = Registry(config.engines.heartbeat_timeout_s)  # the one table of engines
        self.scheduler = Scheduler(config.scheduler, clock, decode=tokenizer.decode, registry=self.registry)
        self.weights = Weights()  # the service's version and the update in flight
        self.deadlines = ChunkDeadlines(config.engines)  # when a chunk in flight is given up on
        self._stranded = StrandedWait(config.engines.replacement_wait_s)  # every engine lost: wait for a joiner
        self.rollout_ends = RolloutEnds()  # when ended rollouts' memory is given back (memory.py)
        self._trims_left = 0  # ticks that trim again after a release
        self.num_bad_client_frames = 0
        self.num_bad_engine_frames = 0
        self._stopping = asyncio.Event()
        self._intakes: set[asyncio.Task] = set()  # rollout requests being taken in
        # Their call ids, from the moment the request is read: a heartbeat of one of them is
        # not acked (a client expects its RolloutAccepted or ErrorReply first).
        self._intake_calls: set[str] = set()
        self._last_yield_s = 0.0  # when a reader last let the other tasks run (``_yield_if_busy``)
        self.max_loop_lag_s = 0.0  # the worst the ticker woke up late: the loop's worst stall
        self._client_codec: Codec[ClientMessage] = Codec(ClientMessage, config.server.max_request_bytes)
        # Engines and host agents share the engine socket (same address, same CURVE keys).
        self._engine_codec: Codec[EngineMessage | AgentMessage] = Codec(EngineMessage | AgentMessage)
        self.host_pool = PoolSegmentOwner(config.kv_pool, config)
        self.host_pool.disk_runner = DiskRunner(self.scheduler.kv)  # the pool's disk tier, if configured
        self.agents = Agents(config.kv_pool, self.scheduler, clock)
        self.scheduler.kv.transfer_ahead = config.kv_pool.transfer_prefetch
        # Prometheus: counters told of events here and by ``clients``; gauges read at scrape time.
        self.metrics = Metrics(clock, min_load_tokens=config.kv_pool.min_load_tokens)
        self.metrics.registry.register(StateCollector(self.metrics, self.registry, self.scheduler, self.weights,
                                                      config.speculative.method, clock))
        self._metrics_socket = metrics_socket  # bound by the caller (``cli/daemon.py``): served in ``serve``
        self.clients = ClientSessions(config, self.scheduler, self.registry, tokenizer, self.weights, clock=clock,
                                      metrics=self.metrics)
        self.membership = Membership(config, self.registry, self.scheduler, self.agents, self.host_pool,
                                     engine_address=engine_address, run_dir=run_dir, clock=clock,
                                     expected=ModelExpectations(vocab_size=tokenizer.vocab_size,
                                                                max_model_len=config.model.max_model_len))

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
        # An engine that registers again (declared lost while it lived, or a joined engine)
        # reconnects under the same identity before the old connection is torn down; without
        # handover the new one was ignored and its hello never arrived.
        self._engines.setsockopt(zmq.ROUTER_HANDOVER, 1)
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
        if self.launcher is not None:
            await asyncio.to_thread(self.launcher.start)
        readers = [asyncio.create_task(self._client_loop()), asyncio.create_task(self._engine_loop()),
                   asyncio.create_task(self._tick_loop())]
        if self._metrics_socket is not None:
            readers.append(asyncio.create_task(serve_metrics(self._metrics_socket, self.metrics.registry)))
        ready_task = asyncio.create_task(self._wait_ready(on_ready)) if on_ready else None
        try:
            await self._stopping.wait()
        finally:
            if ready_task:
                ready_task.cancel()
            for task in list(self._intakes):
                task.cancel()
            await asyncio.gather(*self._intakes, return_exceptions=True)
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
            log.info("control_plane_stopped", max_loop_lag_ms=round(self.max_loop_lag_s * 1000))

    def stop(self) -> None:
        self._stopping.set()

    async def _wait_ready(self, on_ready: Callable[[], None]) -> None:
        deadline = self.clock() + self.config.engines.startup_timeout_s
        while (self.registry.num_starting() or self._launched_starting()) and self.clock() < deadline:
            await asyncio.sleep(0.2)
        on_ready()

    async def _drain(self) -> None:
        if self.launcher is not None:
            self.launcher.begin_stop()
        for rollout_id in list(self.clients.sessions):
            await self._deliver(self.clients.fail(rollout_id, "shutting_down",
                                                  "the Seer daemon is shutting down; retry against a running daemon"))
        for engine_id in self.registry.connected_ids():
            await self._send_engine(engine_id, Shutdown())
            self.registry.stop(engine_id)
        if self.supervisor is not None:
            await asyncio.to_thread(self.supervisor.stop_all, 30.0)
        if self.launcher is not None:
            await asyncio.to_thread(self.launcher.stop, 30.0)

    async def _yield_if_busy(self) -> None:
        """Let the other tasks run if this one has held the loop for ``LOOP_SLICE_S``."""
        now = time.monotonic()
        if now - self._last_yield_s >= LOOP_SLICE_S:
            await asyncio.sleep(0)
            self._last_yield_s = time.monotonic()

    # ------------------------------------------------------------------ sending
    async def _deliver(self, outbox: Outbox) -> None:
        """Send what the parts decided, in order. A chunk that cannot reach its engine loses
        the engine; whether a message to an agent went out is told to ``Agents``. Every
        ``DELIVER_BATCH`` sends it lets the loop run (a 100,000-chunk dispatch must not
        starve heartbeats and status). The disk tier's spills and stages decided so far go
        to its thread first, and each send waits for those it depends on (a chunk never goes
        before the move its KV blocks depend on; a result to a client waits for none)."""
        runner = self.host_pool.disk_runner
        waited = {"prefetched": 0.0, "staged": 0.0, "other": 0.0}
        if runner is not None:
            runner.hand_over()
        for num_sent, send in enumerate(outbox, 1):
            if num_sent % DELIVER_BATCH == 0:
                await asyncio.sleep(0)
            if runner is not None:
                match send:
                    case Dispatch(task=task):
                        ms, why = await runner.ready_for_chunk(task.kv)
                        if ms:
                            waited[why] += ms
                    case ToClient():
                        pass
                    case _:
                        waited["other"] += await runner.ready_for_all()
            match send:
                case Dispatch():
                    log.info("chunk_dispatched", **chunk_dispatched_fields(send))
                    self.metrics.chunk_dispatched(send)  # a send that fails loses the engine: counted failed
                    if send.kv_pool_full:
                        log.warning("kv_pool_full", **kv_pool_full_fields(send, self.scheduler.kv.pool_of(send.engine_id)))
                    if send.kv_lost:
                        log.warning("kv_disk_lost", request_id=send.request.request_id,
                                    effect="its KV was on the disk tier and neither DRAM nor disk had room to bring it "
                                           "back: this chunk re-prefills", fix="raise kv_pool.pool_gib or disk_gib")
                    if not await self._send_engine(send.engine_id, send.task):
                        await self._lose_engine(send.engine_id, "unreachable")
                    else:
                        self.deadlines.sent(send.engine_id, send.task.task_id, send.task.sampling.max_tokens,
                                            self.clock())
                case ToEngine(engine_id=engine_id, msg=msg):
                    await self._send_engine(engine_id, msg)
                case ToClient(identity=identity, msg=msg):
                    self._send_client(identity, msg)
                case ToPeer(identity=identity, msg=msg):
                    await self._send_identity(identity, msg)
                case ToAgent():
                    ok = await self._send_identity(send.agent.identity, send.msg)
                    await self._deliver(self.agents.delivered(send, ok))
                case _:
                    assert_never(send)
        if total := sum(waited.values()):
            log.info("kv_disk_waited", ms=round(total, 3), num_sends=len(outbox),
                     **{f"{why}_ms": round(ms, 3) for why, ms in waited.items()})

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
            # A recv that finds a message queued does not yield: without this, a burst of
            # thousands of ChunkFinished would starve the ticker (pings, liveness) and the
            # client loop (heartbeats, status).
            await self._yield_if_busy()
            frames = await self._engines.recv_multipart()
            identity, payload = frames[0], frames[1:]
            try:
                msg = self._engine_codec.decode(payload)
            except FrameError as exc:
                self.num_bad_engine_frames += 1
                log.error("engine_frame_rejected", identity=identity.decode(errors="replace"), code=exc.code, error=str(exc))
                if exc.code == "protocol_mismatch":
                    await self._send_identity(identity, HelloRejected(reason=str(exc)))
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
                    await self._send_identity(identity, HelloRejected(reason=reason, say_hello_again=True))
                    continue
                if record.state is EngineState.LOST:
                    # Declared lost (silent past heartbeat_timeout_s, stalled) while its process
                    # lived on: its work went elsewhere, and what it sends now is stale. Asking
                    # it to say hello again brings it back as a fresh, empty engine.
                    await self._send_identity(identity, HelloRejected(reason=(
                        f"engine {record.engine_id} was declared lost "
                        f"({self.registry.loss_reasons.get(record.engine_id, 'see controlplane.log')}) and its work "
                        "given to other engines: say hello again"), say_hello_again=True))
                    log.warning("lost_engine_heard", engine_id=record.engine_id, pid=record.pid,
                                message=type(msg).__name__, action="asked to say hello again")
                    continue
            try:
                await self._on_engine_message(identity, msg)
            except Exception:  # noqa: BLE001 - one bad message must not kill the control plane
                log.exception("engine_message_failed", identity=identity.decode(errors="replace"))

    def _engine_steps(self, engine_id: int, steps: bytes) -> None:
        """An engine's step records refine the scheduler's step-cost fit; malformed ones are
        counted and dropped (the fit refuses values outside physical bounds itself)."""
        try:
            records = unpack_steps(steps)
        except ValueError as exc:
            self.num_bad_engine_frames += 1
            log.warning("engine_steps_refused", engine_id=engine_id, reason=str(exc))
            return
        fit = self.scheduler.step_cost
        refused, fits = fit.num_refused, fit.num_fits
        self.scheduler.engine_steps(engine_id, records)
        if fit.num_refused > refused:
            log.warning("engine_steps_refused", engine_id=engine_id, num_refused=fit.num_refused - refused,
                        num_records=len(records))
        model = fit.model  # refits once enough new records came
        if fit.num_fits > fits:  # the trace keeps every fit and what the policy chose from it
            status = self.scheduler.scheduling_status()
            log.info("step_cost_fitted", a_s=round(model.a, 6), b_s=round(model.b, 8), c_s=round(model.c, 10),
                     p_s=round(model.p, 8), num_records=fit.num_records, num_refused=fit.num_refused,
                     policy=status.policy, admission_margin_sd=status.admission_margin_sd,
                     overflow_odds=status.overflow_odds)

    async def _on_engine_message(self, identity: bytes, msg: EngineMessage) -> None:
        now = self.clock()
        match msg:
            case EngineHello():
                # Draining: no answer, so the engine keeps saying hello until the next control plane.
                if self._stopping.is_set():
                    return
                if (gone := self.membership.superseded(identity, msg)) is not None:
                    await self._lose_engine(gone, "another engine process said hello under its identity")
                answer = self.membership.on_hello(identity, msg, self.weights)
                await self._deliver(answer.sends)
                if answer.admitted:
                    await self._schedule()
            case EngineHeartbeat(engine_id=engine_id, load=load, steps=steps):
                self.registry.heard(engine_id, now, load)
                if steps:
                    self._engine_steps(engine_id, steps)
            case ChunkFinished() if reason := self.scheduler.refuse_result(msg):
                self.num_bad_engine_frames += 1
                log.error("chunk_result_rejected", engine_id=msg.engine_id, task_id=msg.task_id, reason=reason)
                await self._on_engine_message(identity, ChunkFailed(engine_id=msg.engine_id, task_id=msg.task_id,
                                                                    error=f"result rejected: {reason}"))
            case ChunkFinished():
                self.registry.heard(msg.engine_id, now)
                self.deadlines.finished(msg.engine_id, msg.task_id, len(msg.token_ids) // 4, msg.elapsed_ms / 1000.0,
                                        now)
                if self.registry.finished_chunk(msg.engine_id):
                    log.info("engine_healthy", engine_id=msg.engine_id, task_id=msg.task_id)
                await self._deliver(self.clients.on_chunk_finished(msg))
                await self._schedule()
            case ChunkFailed(engine_id=engine_id, task_id=task_id, error=error):
                self.registry.heard(engine_id, now)
                self.deadlines.failed(engine_id, task_id, now)
                request = self.scheduler.chunk_failed(engine_id, task_id)
                log.error("chunk_failed", engine_id=engine_id, task_id=task_id, error=error,
                          request_id=request.request_id if request else None,
                          num_failures=request.num_failures if request else None)
                if request is not None:
                    self.metrics.chunk_failed("failed")
                    await self._fail_if_exhausted(request, f"last error on engine {engine_id}: {error}")
                await self._schedule()
            case WeightsLoaded() if self.registry.is_updating(msg.engine_id):
                answer = self.membership.on_caught_up(msg, self.weights.service_version)
                await self._deliver(answer.sends)
                if answer.admitted:
                    await self._schedule()
            case WeightsLoaded():
                await self._on_weights_loaded(msg)

    async def _on_agent_message(self, identity: bytes, msg: AgentHello | PullDone) -> None:
        if isinstance(msg, AgentHello):
            if self._stopping.is_set():
                return
            await self._deliver(self.agents.on_hello(identity, msg))
        else:
            if msg.transfer_id in self.agents.sent:
                self.metrics.pull_done(msg)
            await self._deliver(self.agents.on_pull_done(identity, msg))
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

    async def _on_weights_loaded(self, msg: WeightsLoaded) -> None:
        if not self.weights.loaded(msg.engine_id, msg.error):
            return
        if not msg.error:
            self.registry.engines[msg.engine_id].loaded_weights_version = msg.weights_version
        if self.weights.answered():
            await self._finish_weight_update()

    async def _finish_weight_update(self) -> None:
        update, reply = self.weights.finish()
        self.metrics.weights_update_finished(ok=not update.errors)
        if update.errors:
            log.error("weights_update_failed", path=update.path, errors=update.errors)
        else:
            self.registry.weights_path = update.path  # replayed to engines that join later
            log.info("weights_updated", weights_version=update.target_version, path=update.path)
        await self._deliver(reply)

    # ------------------------------------------------------------------ clients
    async def _client_loop(self) -> None:
        while True:
            await self._yield_if_busy()  # as in _engine_loop: a burst of requests must not starve the rest
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
                # Its own task: a large request is taken in batches while this loop keeps
                # reading (status, heartbeats, cancels of other rollouts).
                self._intake_calls.add(msg.call_id)  # now, not when the task starts: see ClientHeartbeat
                task = asyncio.create_task(self._intake(identity, msg))
                self._intakes.add(task)
                task.add_done_callback(self._intakes.discard)
            case ClientHeartbeat(call_id=call_id, rollout_ids=rollout_ids):
                self.clients.heard(rollout_ids, now)
                # Lets the client see we are alive; not while its rollout is still being
                # taken in: a client expects its RolloutAccepted before anything else.
                if call_id not in self._intake_calls:
                    self._send_client(identity, Ack(call_id=call_id))
            case CancelRollout(call_id=call_id, rollout_id=rollout_id):
                await self._deliver(self.clients.cancel(rollout_id, "cancelled"))
                await self._schedule()
                self._send_client(identity, Ack(call_id=call_id))
            case StatusRequest(call_id=call_id):
                self._send_client(identity, StatusReply(call_id=call_id, status=self.status()))
            case UpdateWeightsRequest():
                await self._on_update_weights(identity, msg)
            case ShutdownRequest(call_id=call_id):
                self._send_client(identity, Ack(call_id=call_id))
                self.stop()

    async def _intake(self, identity: bytes, req: RolloutRequest) -> None:
        """Take a rollout in (``ClientSessions.intake``), letting the loop run between batches."""
        self.rollout_ends.started(req.rollout_id, len(req.prompts) * max(0, req.group_size))
        try:
            steps = self.clients.intake(identity, req)
            while True:
                try:
                    out = next(steps)
                except StopIteration as done:
                    await self._deliver(done.value)
                    break
                await self._deliver(out)
                await asyncio.sleep(0)
            self._intake_calls.discard(req.call_id)
            await self._schedule()
        except Exception as exc:  # noqa: BLE001 - answer, log with traceback, keep serving
            log.exception("client_message_failed", call_id=req.call_id)
            self._send_client(identity, ErrorReply(call_id=req.call_id, code="internal_error",
                                                   message=f"internal error: {type(exc).__name__}: {exc} "
                                                   f"(see {self.run_dir / 'controlplane.log'})"))
        finally:
            self._intake_calls.discard(req.call_id)

    async def _on_update_weights(self, identity: bytes, req: UpdateWeightsRequest) -> None:
        ready = self.registry.ready_ids()
        refusal = self.weights.refuse_update(
            req.path, num_sessions=len(self.clients.sessions) + len(self.clients.pending), ready_ids=ready,
            rollouts_running=any(not r.done for r in self.scheduler.rollouts.values()),
            engines_updating=bool(self.registry.updating_ids()))
        if refusal is not None:
            self._send_client(identity, ErrorReply(call_id=req.call_id, code=refusal.code, message=refusal.message))
            return
        loads = self.weights.start(identity, req.call_id, req.path, ready,
                                   self.clock() + self.config.engines.startup_timeout_s)
        assert self.weights.update is not None
        log.info("weights_update_started", weights_version=self.weights.update.target_version, path=req.path,
                 engines=ready)
        self.metrics.weights_update_started()
        # From here on no KV computed with the old weights may load, whatever the outcome.
        await self._deliver(self.scheduler.weights_changed())
        await self._deliver(loads)

    # ------------------------------------------------------------------ scheduling and timers
    async def _schedule(self) -> None:
        await self._deliver(self.scheduler.schedule())
        # Chunks placed on another host than their KV wait for these; each ends in PullDone.
        await self._deliver(self.agents.transfers())

    async def _tick_loop(self) -> None:
        interval = min(0.5, self.config.engines.heartbeat_interval_s)
        last_s = self.clock()
        while True:
            await asyncio.sleep(interval)
            # Woken late: the loop itself was busy. Measured here, before any liveness
            # judgement, so that time is not held against the engines.
            now = self.clock()
            lag_s = now - last_s - interval
            self.max_loop_lag_s = max(self.max_loop_lag_s, lag_s)
            if lag_s > interval:
                self.registry.loop_stalled(lag_s, now)
                self.deadlines.loop_stalled(lag_s)
                if lag_s > LOOP_STALL_LOGGED_S:
                    log.warning("loop_stalled", stall_ms=round(lag_s * 1000))
            try:
                await self._tick()
            except Exception:  # noqa: BLE001 - the ticker must keep ticking
                log.exception("tick_failed")
            last_s = self.clock()

    async def _tick(self) -> None:
        now = self.clock()
        await self._check_stranded(now)
        await self._deliver(self.agents.expire(now))
        if (exit_reason := self.host_pool.agent_exited()) is not None:
            await self._deliver(self.agents.lost(LOCAL_HOST, exit_reason))
        for engine_id in self.registry.connected_ids():
            await self._send_engine(engine_id, Ping())
        # Agents too: one that hears no ping says hello again (a restarted control plane learns
        # about it); one that cannot be reached any more is lost.
        await self._deliver(self.agents.ping())
        await self._expire_chunks(now)
        await self._move_stalled(now)
        for engine_id in self.registry.silent(now):
            await self._lose_engine(engine_id, f"silent for more than {self.registry.heartbeat_timeout_s:.0f} s")
        if self.supervisor is not None:
            for proc in self.supervisor.processes.values():
                code = proc.exited()
                record = self.registry.engines.get(proc.engine_id)
                if code is not None and record is not None and record.state in LIVE_OR_STARTING:
                    await self._lose_engine(proc.engine_id, f"process {proc.pid} exited with code {code}; "
                                      f"see {self.run_dir / f'engine-{proc.engine_id}.out'}")
        if self.launcher is not None:
            for lost in self.launcher.take_lost():
                engine_id = match_engine(lost.placement, self._engine_processes())
                if engine_id is not None:
                    await self._lose_engine(engine_id, lost.reason)
        for rollout_id, session in list(self.clients.sessions.items()):
            if now - session.last_heard_s > self.config.server.client_timeout_s:
                log.warning("client_lost", rollout_id=rollout_id,
                            silent_s=round(now - session.last_heard_s, 1))
                await self._deliver(self.clients.cancel(rollout_id, "client_lost"))
                await self._schedule()
        self.weights.expire(now, set(self.registry.ready_ids()))
        if self.weights.answered():
            await self._finish_weight_update()
        await self._schedule()
        self._release_memory()

    def _release_memory(self) -> None:
        """Give back the memory of rollouts that ended (``memory.py``): drop the references
        the engines' in-flight logs keep to them; after large ones, collect and trim. The
        loop stands still meanwhile: that time is held against no engine or chunk."""
        num_ended, due = self.rollout_ends.update(self.scheduler.rollouts.keys() | self.clients.pending)
        if num_ended:
            self.registry.drop_inflight_history()
        if self._trims_left:
            self._trims_left -= 1
            if self._trims_left:
                trim()
            else:
                # What still referred to the ended rollouts at the release (an aborted chunk's
                # result on its way, the client's stream closing) has let go by now; the
                # heap is small again, so this collection is cheap.
                self._collect(follow_up=True)
        if due:
            self._trims_left = FOLLOW_UP_TRIMS
            self._collect(follow_up=False)

    def _collect(self, follow_up: bool) -> None:
        done = release()
        self.registry.loop_stalled(done.seconds, self.clock())
        self.deadlines.loop_stalled(done.seconds)
        log.info("memory_released", rss_before_mb=round(done.rss_before_bytes / 2**20, 1),
                 rss_after_mb=round(done.rss_after_bytes / 2**20, 1), num_collected=done.num_collected,
                 ms=round(done.seconds * 1000), follow_up=follow_up)

    async def _expire_chunks(self, now: float) -> None:
        """Chunks past their deadline (``deadlines.py``) go back to the buffer (counted as a
        failure of their request) and elsewhere; their late results are ignored; the engine
        gets no new work until it finishes a chunk."""
        for engine_id, task_id in self.deadlines.expired(now):
            request = self.scheduler.chunk_failed(engine_id, task_id)
            if request is None:
                continue  # finished, failed or aborted meanwhile
            log.warning("chunk_timed_out", engine_id=engine_id, task_id=task_id, request_id=request.request_id,
                        num_failures=request.num_failures)
            self.metrics.chunk_failed("timed_out")
            await self._send_engine(engine_id, AbortTasks(task_ids=[task_id]))
            if self.registry.mark_unhealthy(engine_id):
                log.warning("engine_unhealthy", engine_id=engine_id,
                            reason=f"chunk {task_id} ({request.request_id}) passed its deadline")
            await self._fail_if_exhausted(request, f"last: engine {engine_id} did not finish it by its deadline")

    async def _move_stalled(self, now: float) -> None:
        """Engines that make no progress while others do (``deadlines.py``): every chunk of
        theirs goes back to the buffer (counted as a failure of its request) and elsewhere,
        is aborted on the engine, its late result ignored; the engine is marked unhealthy
        (no new work until it answers a chunk)."""
        for engine_id, task_ids in self.deadlines.stalled(now).items():
            view = self.registry.engines.get(engine_id)
            if view is None or view.state is not EngineState.READY:
                continue
            moved = [r for r in (self.scheduler.chunk_failed(engine_id, t) for t in task_ids) if r is not None]
            reason = self.deadlines.stall_reason(engine_id, len(task_ids), now)
            log.warning("engine_stalled", engine_id=engine_id, num_moved=len(moved), reason=reason)
            self.metrics.chunk_failed("timed_out", len(moved))
            await self._send_engine(engine_id, AbortTasks(task_ids=task_ids))
            if self.registry.mark_unhealthy(engine_id):
                log.warning("engine_unhealthy", engine_id=engine_id, reason=reason)
            for request in moved:
                await self._fail_if_exhausted(request, f"last: engine {engine_id} made no progress on it")

    async def _fail_if_exhausted(self, request: Request, last: str) -> None:
        """A request whose chunks failed ``MAX_CHUNK_FAILURES`` times fails its rollout (once:
        several of its requests may reach the limit in one sweep of a stalled engine)."""
        if request.num_failures >= MAX_CHUNK_FAILURES and request.group.rollout.rollout_id in self.scheduler.rollouts:
            await self._deliver(self.clients.fail(
                request.group.rollout.rollout_id, "request_failed",
                f"request {request.request_id} failed {request.num_failures} times; {last}. "
                f"See the engine logs in {self.run_dir}"))

    async def _lose_engine(self, engine_id: int, reason: str) -> None:
        report = self.scheduler.engine_lost(engine_id)
        if report.previous is None:
            return  # unknown, or no longer live
        self.deadlines.engine_gone(engine_id)
        self.registry.note_loss(engine_id, reason)
        self.metrics.engine_lost()
        self.metrics.chunk_failed("engine_lost", len(report.requeued))
        log.error("engine_lost", engine_id=engine_id, reason=reason, was_starting=report.previous is EngineState.STARTING,
                  num_requeued=len(report.requeued))
        if report.stranded_rollouts and self._stranded.begin(self.clock(), engine_id, reason):
            log.warning("waiting_for_engines", num_rollouts=len(report.stranded_rollouts),
                        wait_s=self.config.engines.replacement_wait_s)
            return
        for rollout in report.stranded_rollouts:
            await self._deliver(self.clients.fail(rollout.rollout_id, "no_engines", lost_message(engine_id, reason)))

    async def _check_stranded(self, now: float) -> None:
        """Fail the rollouts stranded by losing every engine once no engine joined in time."""
        if self._stranded.expired(now, bool(self.scheduler.live_engines())):
            for rollout in [r for r in self.scheduler.rollouts.values() if not r.done]:
                await self._deliver(self.clients.fail(rollout.rollout_id, "no_engines",
                                                      self._stranded.expired_message()))

    # ------------------------------------------------------------------ status
    def status(self) -> ServiceStatus:
        now = self.clock()
        rollouts = [RolloutProgress(rollout_id=r.rollout_id, policy=r.policy, num_groups=len(r.groups),
                                    num_groups_done=r.num_groups_done, num_samples=r.num_samples,
                                    num_samples_done=r.num_samples_done, num_output_tokens=r.num_output_tokens,
                                    elapsed_s=now - r.accepted_s)
                    for r in self.scheduler.rollouts.values()]
        engines = [e.status() for _, e in sorted(self.registry.engines.items())]
        if self.launcher is not None:  # where each launched engine runs
            processes = self._engine_processes()
            for placement in self.launcher.placements():
                engine_id = match_engine(placement, processes)
                for e in engines:
                    if e.engine_id == engine_id:
                        e.node_ip, e.ray_actor_id = placement.node_ip, placement.actor_id
        return ServiceStatus(pid=os.getpid(), policy=self.config.scheduler.policy,
                             weights_version=self.weights.service_version, engines=engines,
                             rollouts=rollouts, run_dir=str(self.run_dir), client_address=self.client_address,
                             scheduling=self.scheduler.scheduling_status())

    def _launched_starting(self) -> bool:
        """A launcher's engines are still joining (not all ready, restarts left)."""
        launcher = self.launcher
        return launcher is not None and len(self.registry.ready_ids()) < launcher.num_engines and not launcher.gave_up()

    def _engine_processes(self) -> dict[int, tuple[str, int]]:
        """``{engine_id: (host_id, pid)}`` with host ids as engines report them (launchers
        know their engines by process, not by id)."""
        local = self.agents.local_host_id
        return {engine_id: (local if (host := self.scheduler.kv.engine_hosts.get(engine_id, LOCAL_HOST)) == LOCAL_HOST
                            else host, view.pid) for engine_id, view in self.registry.engines.items()}
