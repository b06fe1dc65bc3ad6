"""The control-plane process: the event loop, the sockets, and dispatching to the core.

One piece on purpose (over 500 lines): the one sender, whose guarantees (every outbox
delivered in order, each send awaited, one reader task per socket) hold because all the
sockets and their loops are here; every decision is in the modules named below.

Owns the I/O, as vLLM's ``EngineCoreProc`` does around its ``EngineCore``: one uvloop
event loop, two ROUTER sockets (trainer clients, engines), one reader task per socket and
one ticker; decoding frames, handing each message to the part that decides about it, and
delivering what was decided. Bad input from any peer is answered with an ``ErrorReply``
(clients) or logged and counted (engines) -- the loop survives. The server is the only
place that sends: the parts are plain, synchronous classes that return an ``Outbox`` of
(peer, message) (``outbox.py``), and ``_deliver`` sends it, in order, awaiting each send.
The server schedules after each event that may free or bring work; the ticker pings and
asks the parts for their judgements.

Lifecycle: ``serve()`` binds, spawns engines (if a supervisor is given), serves until
``stop()``, then drains: open rollouts get an error, engines get ``Shutdown``, the
supervisor reaps their process groups, sockets close.

The decisions: ``core.py`` (``ControlCore``) wires the parts and decides what spans them
(weights updates, hellos, step records); chunk deadlines, stalls, failures and engine
losses (``health.py``); engine admission and the check of every engine message's sender
(``membership.py``); client sessions, intake, delivery and failures (``sessions.py``);
ended rollouts' memory (``memory.py``); status (``status.py``); the KV pool (``kvpool/``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import assert_never

import structlog
import zmq
import zmq.asyncio

from seer.config import SeerConfig
from seer.controlplane.core import ControlCore
from seer.controlplane.kvpool.agents import ToAgent
from seer.controlplane.kvpool.disk import DiskRunner
from seer.controlplane.kvpool.table import LOCAL_HOST
from seer.controlplane.launcher import EngineLauncher
from seer.controlplane.loopwatch import LoopWatch
from seer.controlplane.memory import RELEASE_MIN_SAMPLES
from seer.controlplane.metrics_http import serve_metrics
from seer.controlplane.openai_http import OpenAIEndpoint, served_model_name
from seer.controlplane.outbox import Outbox, ToCall, ToClient, ToEngine, ToPeer
from seer.controlplane.scheduler import Dispatch
from seer.controlplane.state import RequestState
from seer.controlplane.supervisor import Supervisor
from seer.controlplane.tokenizer import Tokenizer
from seer.protocol import (
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
    RolloutRequest,
    ServiceStatus,
    Shutdown,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    TurnInput,
    UpdateWeightsRequest,
    WeightsLoaded,
)
from seer.auth import ZapHandler, server_curve, watch_handshakes
from seer.wire import Codec, FrameError, make_socket

log = structlog.get_logger()

# Sends delivered between two chances for the loop to run other tasks.
DELIVER_BATCH = 256

# Rollouts of at most this many samples are taken in by the client reader itself, not a task.
INLINE_INTAKE_SAMPLES = 2048

# Assignments placed between two chances for the loop to run other tasks: a new rollout's
# 2,000 chunks placed at once held the loop for over 500 ms.
SCHEDULE_SLICE = 128

# A reader that has run this long without giving the loop back yields before its next message.
LOOP_SLICE_S = 0.005


def _stale(send: object) -> bool:
    """A chunk decided before its rollout was cancelled or its engine lost (the scheduler
    no longer has it in flight): ``_deliver`` drops it."""
    return isinstance(send, Dispatch) and (send.request.task_id != send.task.task_id
                                           or send.request.state is not RequestState.RUNNING)


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
        openai_socket: socket.socket | None = None,
    ) -> None:
        self.config = config
        self.client_address = client_address
        self.engine_address = engine_address
        self.tokenizer = tokenizer
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.launcher = launcher  # engines that join from elsewhere (a Ray cluster): controlplane/launcher.py
        self.clock = clock
        # The decisions are the core's (core.py); its parts, as the server and callers reach them:
        self.core = core = ControlCore(config, tokenizer=tokenizer, engine_address=engine_address,
                                       client_address=client_address, run_dir=run_dir, launcher=launcher, clock=clock)
        self.registry, self.scheduler, self.clients = core.registry, core.scheduler, core.clients
        self.agents, self.host_pool, self.metrics = core.agents, core.host_pool, core.metrics
        self.health, self.membership = core.health, core.membership
        self.rollout_ends = core.memory.ends  # when ended rollouts' memory is given back (memory.py)
        self.host_pool.disk_runner = DiskRunner(self.scheduler.kv)  # the pool's disk tier, if configured
        self.num_bad_client_frames = 0
        self.num_bad_engine_frames = 0
        self._stopping = asyncio.Event()
        self._intakes: set[asyncio.Task] = set()  # rollout requests being taken in
        # Their call ids, from the moment the request is read: a heartbeat of one of them is
        # not acked (a client expects its RolloutAccepted or ErrorReply first).
        self._intake_calls: set[str] = set()
        # Set when parked rollouts may be admitted (``_admit_loop``): after an intake parks one,
        # after each scheduling (samples finished, rollouts ended) and on every tick.
        self._admission_wanted = asyncio.Event()
        self._last_yield_s = 0.0  # when a reader last let the other tasks run (``_yield_if_busy``)
        self.max_loop_lag_s = 0.0  # the worst the ticker woke up late
        self.loop_watch = LoopWatch()  # the stall log (``loop_stalled``): every stall from 0.1 s, and why
        self._client_codec: Codec[ClientMessage] = Codec(ClientMessage, config.server.max_request_bytes)
        # Engines and host agents share the engine socket (same address, same CURVE keys).
        self._engine_codec: Codec[EngineMessage | AgentMessage] = Codec(EngineMessage | AgentMessage)
        self._metrics_socket = metrics_socket  # bound by the caller (``cli/daemon.py``): served in ``serve``
        self.openai = None if openai_socket is None else OpenAIEndpoint(  # [openai]: agent calls over HTTP
            config.openai, model=served_model_name(config), clients=self.clients, scheduler=self.scheduler,
            tokenizer=tokenizer, schedule=self._schedule, sock=openai_socket)
        if self.openai is not None:
            core.status.openai_url = self.openai.url + "/v1"

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
        # No ROUTER_HANDOVER: a second connection under a live routing id is ignored by
        # ZeroMQ (its messages never arrive) instead of taking the engine's pings and chunks.
        # Engines connect under a fresh routing id per connection (``engine-N.<random>``,
        # ``join-<random>``), so one that registers again is never the duplicate; its hello
        # names its id and proves it with its secret (``membership.claim_hello``).
        watchers = [asyncio.create_task(watch_handshakes(sock, name))
                    for sock, name, curve in ((self._clients, "clients", client_curve),
                                              (self._engines, "engines", engine_curve)) if curve]
        if zap is not None:
            zap.start()
        log.info("control_plane_started", client_address=self.client_address, engine_address=self.engine_address,
                 policy=self.config.scheduler.policy, pid=os.getpid())
        if self.supervisor is not None:
            for proc in self.supervisor.spawn_all():
                # Its hello must carry the secret it was spawned with (an inherited pipe).
                self.registry.expect(proc.engine_id, proc.pid, self.clock(), secret=proc.secret)
                log.info("engine_spawned", engine_id=proc.engine_id, pid=proc.pid)
        if self.launcher is not None:
            await asyncio.to_thread(self.launcher.start)
        readers = [asyncio.create_task(self._client_loop()), asyncio.create_task(self._engine_loop()),
                   asyncio.create_task(self._tick_loop()), asyncio.create_task(self._admit_loop()),
                   asyncio.create_task(self.loop_watch.run())]
        if self._metrics_socket is not None:
            readers.append(asyncio.create_task(serve_metrics(self._metrics_socket, self.metrics.registry)))
        if self.openai is not None:
            readers.append(asyncio.create_task(self.openai.serve()))
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
            log.info("control_plane_stopped",
                     max_loop_lag_ms=round(max(self.max_loop_lag_s, self.loop_watch.max_stall_s) * 1000))

    def stop(self) -> None:
        self._stopping.set()

    async def _wait_ready(self, on_ready: Callable[[], None]) -> None:
        deadline = self.clock() + self.config.engines.startup_timeout_s
        while self.core.status.starting() and self.clock() < deadline:
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
        ``DELIVER_BATCH`` sends, or ``LOOP_SLICE_S`` of sending, it lets the loop run (a 100,000-chunk dispatch must not
        starve heartbeats and status). The disk tier's spills and stages decided so far go
        to its thread first, and each send waits for those it depends on (a chunk never goes
        before the move its KV blocks depend on; a result to a client waits for none)."""
        runner = self.host_pool.disk_runner
        waited = {"prefetched": 0.0, "staged": 0.0, "other": 0.0}
        if runner is not None:
            runner.hand_over()
        slice_s, num_sent = time.monotonic(), 0
        for send in outbox:
            if _stale(send):
                continue  # its rollout cancelled, or its engine lost, while the loop ran: not sent
            # Each send is logged and encoded: 256 of them took up to ~80 ms on a loaded machine.
            num_sent += 1
            if num_sent % DELIVER_BATCH == 0 or (num_sent % 16 == 0 and time.monotonic() - slice_s >= LOOP_SLICE_S):
                await asyncio.sleep(0)
                slice_s = time.monotonic()
                if _stale(send):
                    continue
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
                    self.core.dispatching(send)
                    if not await self._send_engine(send.engine_id, send.task):
                        await self._deliver(self.health.lose_engine(send.engine_id, "unreachable"))
                    else:
                        self.health.sent(send, self.clock())
                case ToEngine(engine_id=engine_id, msg=msg):
                    await self._send_engine(engine_id, msg)
                case ToClient(identity=identity, msg=msg):
                    self._send_client(identity, msg)
                case ToCall() if self.openai is not None:
                    self.openai.deliver(send)
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
        """Send to the connection ``engine_id`` registered on (none before its hello: False)."""
        record = self.registry.engines.get(engine_id)
        identity = record.identity if record is not None else b""
        if not identity:  # (never a name it might connect under: that could be another process)
            log.warning("engine_unreachable", engine_id=engine_id, error="no connection registered")
            return False
        return await self._send_identity(identity, msg, engine_id)

    async def _send_identity(self, identity: bytes, msg: object, engine_id: int | None = None) -> bool:
        """Send to a peer of the engine socket that may already be gone (EHOSTUNREACH must
        not kill the reader); False if it is (logged by engine id if it is one)."""
        try:
            await self._engines.send_multipart([identity, *self._engine_codec.encode(msg)])
            return True
        except zmq.ZMQError as exc:
            peer = {"identity": identity.decode(errors="replace")} if engine_id is None else {"engine_id": engine_id}
            log.warning("engine_unreachable", **peer, error=str(exc))
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
            if not isinstance(msg, EngineHello) and (refusal := self.membership.refuse_sender(identity, msg)):
                await self._send_identity(identity, refusal)  # not an engine registered here (as this id), or lost
                continue
            try:
                await self._on_engine_message(identity, msg)
            except Exception:  # noqa: BLE001 - one bad message must not kill the control plane
                log.exception("engine_message_failed", identity=identity.decode(errors="replace"))

    async def _on_engine_message(self, identity: bytes, msg: EngineMessage) -> None:
        now = self.clock()
        match msg:
            case EngineHello():
                # Draining: no answer, so the engine keeps saying hello until the next control plane.
                if self._stopping.is_set():
                    return
                answer = self.core.hello(identity, msg)
                await self._deliver(answer.sends)
                if answer.admitted:
                    await self._schedule()
            case EngineHeartbeat(engine_id=engine_id, load=load, steps=steps):
                if not self.core.heartbeat(engine_id, load, steps, now):
                    self.num_bad_engine_frames += 1
            case ChunkFinished() if reason := self.scheduler.refuse_result(msg):
                self.num_bad_engine_frames += 1
                log.error("chunk_result_rejected", engine_id=msg.engine_id, task_id=msg.task_id, reason=reason)
                await self._on_engine_message(identity, ChunkFailed(engine_id=msg.engine_id, task_id=msg.task_id,
                                                                    error=f"result rejected: {reason}"))
            case ChunkFinished():
                await self._deliver(self.core.chunk_finished(msg, now))
                await self._schedule()
            case ChunkFailed(engine_id=engine_id, task_id=task_id, error=error):
                await self._deliver(self.health.chunk_failed(engine_id, task_id, error, now))
                await self._schedule()
            case WeightsLoaded():
                answer = self.core.weights_loaded(msg)
                await self._deliver(answer.sends)
                if answer.admitted:
                    await self._schedule()

    async def _on_agent_message(self, identity: bytes, msg: AgentHello | PullDone) -> None:
        if isinstance(msg, AgentHello) and self._stopping.is_set():
            return  # draining: no answer, as for an engine's hello
        await self._deliver(self.core.agent_message(identity, msg))
        await self._schedule()

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
                self._send_client(identity, self._internal_error(getattr(msg, "call_id", ""), exc))

    def _internal_error(self, call_id: str, exc: Exception) -> ErrorReply:
        return ErrorReply(call_id=call_id, code="internal_error", message=f"internal error: {type(exc).__name__}: "
                          f"{exc} (see {self.run_dir / 'controlplane.log'})")

    async def _on_client_message(self, identity: bytes, msg: ClientMessage) -> None:
        now = self.clock()
        match msg:
            case RolloutRequest() if len(msg.prompts) * max(1, msg.group_size) <= INLINE_INTAKE_SAMPLES:
                # A small request is taken in here, by this reader (still in batches): a task
                # per request would let a burst of 10,000 requests queue 10,000 tasks for one
                # turn of the loop.
                await self._intake(identity, msg)
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
            case TurnInput():
                await self._deliver(self.clients.on_turn_input(identity, msg))
                await self._schedule()
            case CancelRollout(call_id=call_id, rollout_id=rollout_id):
                await self._deliver(self.clients.cancel(rollout_id, "cancelled", by=identity))
                await self._schedule()
                self._send_client(identity, Ack(call_id=call_id))
            case StatusRequest(call_id=call_id):
                self._send_client(identity, StatusReply(call_id=call_id, status=self.status()))
            case UpdateWeightsRequest():
                await self._deliver(self.core.update_weights(identity, msg))
            case ShutdownRequest(call_id=call_id):
                self._send_client(identity, Ack(call_id=call_id))
                self.stop()

    async def _intake(self, identity: bytes, req: RolloutRequest) -> None:
        """Take a rollout in (``ClientSessions.intake``), letting the loop run between batches:
        accepted, it enters the scheduler now or waits in the backlog (``_admit_loop``)."""
        self.rollout_ends.started(req.rollout_id, len(req.prompts) * max(0, req.group_size))
        try:
            await self._run_steps(self.clients.intake(identity, req))
            self._intake_calls.discard(req.call_id)
            if req.rollout_id in self.scheduler.rollouts:
                await self._schedule()
            elif req.rollout_id in self.clients.backlog:
                self._admission_wanted.set()
        except Exception as exc:  # noqa: BLE001 - answer, log with traceback, keep serving
            log.exception("client_message_failed", call_id=req.call_id)
            self._send_client(identity, self._internal_error(req.call_id, exc))
        finally:
            self._intake_calls.discard(req.call_id)

    async def _run_steps(self, steps: Generator[Outbox, None, Outbox]) -> None:
        """Deliver what a stepped part (``ClientSessions.intake``, ``admit_steps``) yields,
        letting the loop run between its steps."""
        while True:
            try:
                out = next(steps)
            except StopIteration as done:
                await self._deliver(done.value)
                return
            await self._deliver(out)
            await asyncio.sleep(0)

    async def _admit_loop(self) -> None:
        """Admit parked rollouts as the window frees (``backlog.py``), then schedule them.
        Engines may still come if starting, catching up, or awaited after every engine was lost."""
        while await self._admission_wanted.wait():
            self._admission_wanted.clear()
            if not self.clients.backlog:
                continue
            expected = bool(self.registry.num_starting() or self.registry.updating_ids()
                            or self.health.stranded.deadline_s is not None)
            before = len(self.clients.open)
            try:
                await self._run_steps(self.clients.admit_steps(engines_expected=expected))
                if len(self.clients.open) != before:
                    await asyncio.sleep(0)  # the last batch was enqueued in this turn of the loop
                    await self._schedule()
            except Exception:  # noqa: BLE001 - log with traceback, keep admitting
                log.exception("rollout_admission_failed")

    # ------------------------------------------------------------------ scheduling and timers
    async def _schedule(self) -> None:
        if self.clients.backlog:
            self._admission_wanted.set()  # samples may have finished: room for parked rollouts
        await self._deliver(self.scheduler.schedule(SCHEDULE_SLICE))
        while self.scheduler.cut_short:  # a burst is placed a slice at a time, the loop free between
            await asyncio.sleep(0)
            await self._deliver(self.scheduler.schedule(SCHEDULE_SLICE))
        # Chunks placed on another host than their KV wait for these; each ends in PullDone.
        await self._deliver(self.agents.transfers())
        if self.clients.ended_samples >= RELEASE_MIN_SAMPLES:  # now, before the next rollout is built
            self.clients.ended_samples = 0
            self.core.release_memory()

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
                self.health.loop_stalled(lag_s, now)  # logged by the stall log (``loopwatch.py``)
            try:
                await self._tick()
            except Exception:  # noqa: BLE001 - the ticker must keep ticking
                log.exception("tick_failed")
            last_s = self.clock()

    async def _tick(self) -> None:
        now = self.clock()
        await self._deliver(self.health.check_stranded(now))
        await self._deliver(self.agents.expire(now))
        if (exit_reason := self.host_pool.agent_exited()) is not None:
            await self._deliver(self.agents.lost(LOCAL_HOST, exit_reason))
        for engine_id in self.registry.connected_ids():
            await self._send_engine(engine_id, Ping())
        # Agents too: one that hears no ping says hello again (a restarted control plane learns
        # about it); one that cannot be reached any more is lost.
        await self._deliver(self.agents.ping())
        processes = self.supervisor.processes.values() if self.supervisor is not None else ()
        exits = [(proc.engine_id, proc.pid, code) for proc in processes if (code := proc.exited()) is not None]
        lost = self.launcher.take_lost() if self.launcher is not None else []
        await self._deliver(self.core.judge_engines(now, exits, lost))
        if silent := self.clients.timed_out(now):
            for rollout_id in silent:
                if (session := self.clients.sessions.get(rollout_id)) is not None:
                    log.warning("client_lost", rollout_id=rollout_id, silent_s=round(now - session.last_heard_s, 1))
                    await self._deliver(self.clients.cancel(rollout_id, "client_lost"))
                    await self._yield_if_busy()  # each cancel is a pass over the policy's queues
            await self._schedule()
        self._admission_wanted.set()
        await self._deliver(self.core.expire_weights(now))
        await self._schedule()
        # Let outboxes cut short at a time slice finish first (uvloop runs a due timer before
        # them): one still holding a cancelled rollout's Dispatches would keep it alive.
        await asyncio.sleep(0)
        self.core.release_memory()  # the loop stands still meanwhile: held against no engine or chunk

    def status(self) -> ServiceStatus:
        """What ``seerctl status`` shows (``status.py``)."""
        return self.core.status.status()
