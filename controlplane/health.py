"""Engine and chunk health: what the control plane does about chunks that do not come back
and engines that stop working.

Owns the decisions the server's loop used to make inline: a chunk past its deadline and
every chunk of a stalled engine (``deadlines.py`` judges both) go back to the buffer,
counted as a failure of their request, are aborted on the engine (their late results are
ignored), and the engine is marked unhealthy (``Registry.mark_unhealthy``: no new work
until it answers a chunk); a chunk an engine reports failed goes back the same way; a
request whose chunks failed ``MAX_CHUNK_FAILURES`` times fails its rollout; an engine
silent past ``engines.heartbeat_timeout_s``, whose process exited, or that cannot be
reached is lost (``Scheduler.engine_lost`` requeues its chunks; lost engines beyond the
newest ``registry.LOST_ENGINES_KEPT`` are forgotten: ``forget_lost``) and, when no engine is
left, its rollouts wait for a joiner or fail (``membership.StrandedWait``). It also keeps
the chunks' clocks (``ChunkDeadlines``): sent, finished, failed, and the control plane's
own loop stalls, which count against no engine or chunk.

Events: ``chunk_timed_out``, ``engine_stalled``, ``engine_unhealthy``, ``engine_healthy``,
``chunk_failed``, ``engine_lost``, ``waiting_for_engines`` (and, through
``ClientSessions.fail``, ``rollout_failed``). Plain and synchronous: no sockets, no
awaits, the clock injected; every decision returns the ``Outbox`` (``outbox.py``) the
server delivers, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import structlog

from seer.config import EnginesConfig
from seer.controlplane.deadlines import ChunkDeadlines
from seer.controlplane.membership import StrandedWait, lost_message
from seer.controlplane.metrics import Metrics
from seer.controlplane.outbox import Outbox, ToEngine
from seer.controlplane.registry import Registry
from seer.controlplane.scheduler import Dispatch, Scheduler
from seer.controlplane.sessions import ClientSessions
from seer.controlplane.state import EngineState, Request
from seer.protocol import AbortTasks, ChunkFinished

log = structlog.get_logger()

# An engine in these states whose process exited is lost.
LIVE_OR_STARTING = (EngineState.READY, EngineState.STARTING, EngineState.UPDATING)

# A request whose chunks fail this many times fails its rollout instead of looping.
MAX_CHUNK_FAILURES = 3


class Health:
    """Chunk deadlines, stalls, failures and engine losses, decided; what to send, returned."""

    def __init__(self, config: EnginesConfig, registry: Registry, scheduler: Scheduler, clients: ClientSessions,
                 metrics: Metrics, *, run_dir: Path, clock: Callable[[], float]) -> None:
        self.registry = registry
        self.scheduler = scheduler
        self.clients = clients  # fails the rollouts (``ClientSessions.fail``: its client and its chunks)
        self.metrics = metrics
        self.run_dir = run_dir  # named in the errors: where the engine logs are
        self.clock = clock
        self.deadlines = ChunkDeadlines(config)  # when a chunk in flight is given up on
        self.stranded = StrandedWait(config.replacement_wait_s)  # every engine lost: wait for a joiner

    # ------------------------------------------------------------------ what engines and the loop report
    def sent(self, send: Dispatch, now_s: float) -> None:
        """A chunk reached its engine: its deadline's clock starts."""
        self.deadlines.sent(send.engine_id, send.task.task_id, send.task.sampling.max_tokens, now_s)

    def chunk_finished(self, msg: ChunkFinished, now_s: float) -> None:
        """A chunk came back (possibly late, and before its result is judged): the engine is
        heard, measured, and healthy again if it was not."""
        self.registry.heard(msg.engine_id, now_s)
        self.deadlines.finished(msg.engine_id, msg.task_id, len(msg.token_ids) // 4, msg.elapsed_ms / 1000.0, now_s)
        if self.registry.finished_chunk(msg.engine_id):
            log.info("engine_healthy", engine_id=msg.engine_id, task_id=msg.task_id)

    def chunk_failed(self, engine_id: int, task_id: int, error: str, now_s: float) -> Outbox:
        """The engine reported a chunk failed (or its result was refused): the request goes
        back to the buffer, counted as a failure; at the limit its rollout fails."""
        self.registry.heard(engine_id, now_s)
        self.deadlines.failed(engine_id, task_id, now_s)
        request = self.scheduler.chunk_failed(engine_id, task_id)
        log.error("chunk_failed", engine_id=engine_id, task_id=task_id, error=error,
                  request_id=request.request_id if request else None,
                  num_failures=request.num_failures if request else None)
        if request is None:
            return []
        self.metrics.chunk_failed("failed")
        return self.fail_if_exhausted(request, f"last error on engine {engine_id}: {error}")

    def loop_stalled(self, stall_s: float, now_s: float) -> None:
        """The control plane's loop stood still for ``stall_s``: held against no engine's
        silence and no chunk's deadline."""
        self.registry.loop_stalled(stall_s, now_s)
        self.deadlines.loop_stalled(stall_s)

    # ------------------------------------------------------------------ the ticker's judgements
    def expire_chunks(self, now_s: float) -> Outbox:
        """Chunks past their deadline go back to the buffer (counted as a failure of their
        request) and elsewhere, are aborted on their engine (their late results are
        ignored); the engine gets no new work until it finishes a chunk."""
        out: Outbox = []
        for engine_id, task_id in self.deadlines.expired(now_s):
            request = self.scheduler.chunk_failed(engine_id, task_id)
            if request is None:
                continue  # finished, failed or aborted meanwhile
            log.warning("chunk_timed_out", engine_id=engine_id, task_id=task_id, request_id=request.request_id,
                        num_failures=request.num_failures)
            self.metrics.chunk_failed("timed_out")
            out.append(ToEngine(engine_id, AbortTasks(task_ids=[task_id])))
            if self.registry.mark_unhealthy(engine_id):
                log.warning("engine_unhealthy", engine_id=engine_id,
                            reason=f"chunk {task_id} ({request.request_id}) passed its deadline")
            out += self.fail_if_exhausted(request, f"last: engine {engine_id} did not finish it by its deadline")
        return out

    def move_stalled(self, now_s: float) -> Outbox:
        """Ready engines that make no progress while others do: every chunk of theirs goes
        back to the buffer (counted as a failure of its request) and elsewhere, is aborted
        on the engine, its late result ignored; the engine is marked unhealthy."""
        out: Outbox = []
        for engine_id, task_ids in self.deadlines.stalled(now_s).items():
            view = self.registry.engines.get(engine_id)
            if view is None or view.state is not EngineState.READY:
                continue
            moved = [r for r in (self.scheduler.chunk_failed(engine_id, t) for t in task_ids) if r is not None]
            reason = self.deadlines.stall_reason(engine_id, len(task_ids), now_s)
            log.warning("engine_stalled", engine_id=engine_id, num_moved=len(moved), reason=reason)
            self.metrics.chunk_failed("timed_out", len(moved))
            out.append(ToEngine(engine_id, AbortTasks(task_ids=task_ids)))
            if self.registry.mark_unhealthy(engine_id):
                log.warning("engine_unhealthy", engine_id=engine_id, reason=reason)
            for request in moved:
                out += self.fail_if_exhausted(request, f"last: engine {engine_id} made no progress on it")
        return out

    def lose_silent(self, now_s: float) -> Outbox:
        """Engines silent longer than the heartbeat timeout are lost."""
        out: Outbox = []
        for engine_id in self.registry.silent(now_s):
            out += self.lose_engine(engine_id, f"silent for more than {self.registry.heartbeat_timeout_s:.0f} s")
        return out

    def process_exited(self, engine_id: int, pid: int, code: int) -> Outbox:
        """An engine process spawned here exited: the engine is lost if it was starting or live."""
        record = self.registry.engines.get(engine_id)
        if record is None or record.state not in LIVE_OR_STARTING:
            return []
        return self.lose_engine(engine_id, f"process {pid} exited with code {code}; "
                                           f"see {self.run_dir / f'engine-{engine_id}.out'}")

    def check_stranded(self, now_s: float) -> Outbox:
        """Fail the rollouts stranded by losing every engine once no engine joined in time."""
        out: Outbox = []
        if self.stranded.expired(now_s, bool(self.scheduler.live_engines())):
            for rollout in [r for r in self.scheduler.rollouts.values() if not r.done]:
                out += self.clients.fail(rollout.rollout_id, "no_engines", self.stranded.expired_message())
        return out

    def forget_lost(self) -> None:
        """Lost engines beyond the newest ``registry.LOST_ENGINES_KEPT`` are forgotten by the
        registry and by every table kept by engine id (``Scheduler.forget_engine``)."""
        for engine_id in self.registry.forget_lost():
            self.scheduler.forget_engine(engine_id)

    # ------------------------------------------------------------------ outcomes
    def fail_if_exhausted(self, request: Request, last: str) -> Outbox:
        """A request whose chunks failed ``MAX_CHUNK_FAILURES`` times fails its rollout (once:
        several of its requests may reach the limit in one sweep of a stalled engine)."""
        if request.num_failures >= MAX_CHUNK_FAILURES and request.group.rollout.rollout_id in self.scheduler.rollouts:
            return self.clients.fail(
                request.group.rollout.rollout_id, "request_failed",
                f"request {request.request_id} failed {request.num_failures} times; {last}. "
                f"See the engine logs in {self.run_dir}")
        return []

    def lose_engine(self, engine_id: int, reason: str) -> Outbox:
        """The engine is lost (nothing if it was unknown or no longer live): its chunks go
        back to the buffer; rollouts left without any engine wait for a joiner
        (``engines.replacement_wait_s``) or fail now with ``no_engines``."""
        report = self.scheduler.engine_lost(engine_id)
        if report.previous is None:
            return []  # unknown, or no longer live
        self.deadlines.engine_gone(engine_id)
        self.registry.note_loss(engine_id, reason)
        self.forget_lost()
        self.metrics.engine_lost(engine_id)
        self.metrics.chunk_failed("engine_lost", len(report.requeued))
        log.error("engine_lost", engine_id=engine_id, reason=reason, was_starting=report.previous is EngineState.STARTING,
                  num_requeued=len(report.requeued))
        if report.stranded_rollouts and self.stranded.begin(self.clock(), engine_id, reason):
            log.warning("waiting_for_engines", num_rollouts=len(report.stranded_rollouts),
                        wait_s=self.stranded.wait_s)
            return []
        out: Outbox = []
        for rollout in report.stranded_rollouts:
            out += self.clients.fail(rollout.rollout_id, "no_engines", lost_message(engine_id, reason))
        return out
