"""Rollouts as their clients see them: accepted or refused, delivered group by group,
then completed, failed or cancelled.

Owns: the client session of every open rollout (who asked, under which call id, when it
was last heard from -- the server cancels the rollout of a client silent for
``server.client_timeout_s``), the refusals at intake (``no_engines``, ``busy``,
``duplicate_rollout`` and those of ``intake.py``), what a finished chunk is logged as
and, when it finishes a group or the rollout, the ``GroupCompleted`` /
``RolloutCompleted`` its client gets; the ``ErrorReply`` of a failed rollout and the
``AbortTasks`` for its chunks. Events: ``rollout_accepted``, ``rollout_rejected``,
``stale_chunk_ignored``, ``chunk_finished``, ``chunk_migrated``, ``kv_load_fell_back``,
``group_finished``, ``rollout_finished``, ``rollout_aborted``, ``rollout_failed`` (fields
built by ``results.py``). The scheduler decides; this module says what the clients (and,
for aborted chunks, the engines) are sent: each call returns an ``Outbox`` the server
delivers (``outbox.py``). Scheduling after an acceptance or a cancel is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import structlog

from seer.config import SeerConfig
from seer.controlplane.intake import (
    INTAKE_BATCH,
    Limits,
    RequestRejected,
    intake_steps,
    run_steps,
)
from seer.controlplane.metrics import Metrics
from seer.controlplane.outbox import Outbox, ToClient, ToEngine
from seer.controlplane.registry import Registry
from seer.controlplane.results import (
    chunk_finished_fields,
    chunk_migrated_fields,
    group_result,
    kv_load_fell_back_fields,
    rollout_finished_fields,
)
from seer.controlplane.scheduler import Completion, Scheduler
from seer.controlplane.stats import rollout_stats
from seer.controlplane.tokenizer import Tokenizer
from seer.controlplane.weights import Weights
from seer.protocol import (
    AbortTasks,
    ChunkFinished,
    ErrorReply,
    GroupCompleted,
    RolloutAccepted,
    RolloutCompleted,
    RolloutRequest,
    unpack_token_ids,
)

log = structlog.get_logger()


@dataclass
class ClientSession:
    identity: bytes
    call_id: str
    last_heard_s: float


class ClientSessions:
    """The open rollouts' client sessions, and what their clients are sent."""

    def __init__(self, config: SeerConfig, scheduler: Scheduler, registry: Registry, tokenizer: Tokenizer,
                 weights: Weights, *, clock: Callable[[], float], metrics: Metrics | None = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.registry = registry  # read only: which engines are ready, their limits
        self.tokenizer = tokenizer
        self.weights = weights  # read only: the version reported, whether an update is in flight
        self.sessions: dict[str, ClientSession] = {}  # rollout_id -> client
        self.pending: set[str] = set()  # rollout ids being taken in (``intake``)
        self.clock = clock
        self.metrics = metrics if metrics is not None else Metrics(clock)  # told what finished and failed

    def heard(self, rollout_ids: list[str], now_s: float) -> None:
        """A client heartbeat: its rollouts' clients are alive."""
        for rollout_id in rollout_ids:
            if rollout_id in self.sessions:
                self.sessions[rollout_id].last_heard_s = now_s

    def on_chunk_finished(self, msg: ChunkFinished) -> Outbox:
        """Log a finished chunk; deliver its group (and rollout) if it finished one."""
        done = self.scheduler.chunk_finished(msg)
        if done is None:
            log.debug("stale_chunk_ignored", engine_id=msg.engine_id, task_id=msg.task_id)
            return []
        request = done.request
        log.info("chunk_finished", **chunk_finished_fields(msg, request, len(unpack_token_ids(msg.token_ids))))
        self.metrics.chunk_finished(msg, done, migrated=request.migrated_from is not None)
        if request.migrated_from is not None:
            geometry = self.scheduler.engines[msg.engine_id].capabilities.kv_geometry
            bytes_per_token = geometry.bytes_per_token if geometry is not None else 0
            log.info("chunk_migrated", **chunk_migrated_fields(msg, request, bytes_per_token))
        if msg.kv_load_failed_tokens:
            log.warning("kv_load_fell_back", **kv_load_fell_back_fields(msg, request))
            request.migrated_from = None
        return self.deliver(done)

    def deliver(self, done: Completion) -> Outbox:
        """The ``GroupCompleted`` (and ``RolloutCompleted``) of what a chunk finished."""
        group = done.group_finished
        if group is None:
            return []
        out: Outbox = []
        rollout = group.rollout
        session = self.sessions.get(rollout.rollout_id)
        if session is not None:
            out.append(ToClient(session.identity, GroupCompleted(
                call_id=session.call_id, rollout_id=rollout.rollout_id, group=group_result(group, self.tokenizer.decode))))
        log.info("group_finished", group_id=group.group_id, rollout_id=rollout.rollout_id,
                 num_groups_done=rollout.num_groups_done, num_groups=len(rollout.groups))
        if done.rollout_finished is not None:
            stats = rollout_stats(rollout, self.scheduler.preemptions_since_start(rollout))
            log.info("rollout_finished", **rollout_finished_fields(rollout, stats))
            self.metrics.rollout_completed(rollout, stats)
            if session is not None:
                out.append(ToClient(session.identity, RolloutCompleted(
                    call_id=session.call_id, rollout_id=rollout.rollout_id, stats=stats,
                    weights_version=self.weights.service_version)))
            self.sessions.pop(rollout.rollout_id, None)
            self.scheduler.forget(rollout.rollout_id)
        return out

    def on_request(self, identity: bytes, req: RolloutRequest) -> Outbox:
        """Accept a rollout (the caller schedules it) or refuse it with an ``ErrorReply``,
        in one go (``intake`` without pauses)."""
        yielded, last = run_steps(self.intake(identity, req))
        return [send for out in yielded for send in out] + last

    def intake(self, identity: bytes, req: RolloutRequest, batch: int = INTAKE_BATCH) -> Generator[Outbox, None, Outbox]:
        """Accept a rollout or refuse it, pausing (yielding what to send so far) between
        batches of prompts checked, samples built and requests enqueued (``intake.py``),
        so the server's loop answers heartbeats and status meanwhile. The client gets its
        ``RolloutAccepted`` before the requests are enqueued (so before any of its groups
        can complete); the refusal ``ErrorReply`` is returned. The rollout id is reserved
        meanwhile (a second request with it is a ``duplicate_rollout``). The caller
        schedules after an acceptance."""
        def refuse(code: str, message: str) -> Outbox:
            log.warning("rollout_rejected", rollout_id=req.rollout_id, code=code, error=message)
            return [ToClient(identity, ErrorReply(call_id=req.call_id, code=code, message=message))]

        ready = self.registry.ready_ids()
        if not ready:
            starting = self.registry.num_starting()
            return refuse("no_engines", f"no engine is ready ({starting} starting); wait until `seerctl status` "
                          "shows ready engines, or check the engine logs in the run dir")
        if self.weights.update is not None:
            return refuse("busy", "a weights update is in progress; retry when it has finished")
        if req.rollout_id in self.sessions or req.rollout_id in self.scheduler.rollouts or req.rollout_id in self.pending:
            return refuse("duplicate_rollout", f"rollout id {req.rollout_id!r} is already running; use a fresh id")
        caps = [self.registry.engines[e].capabilities for e in ready]
        limits = Limits(
            max_group_size=self.config.server.max_group_size,
            max_prompts=self.config.server.max_prompts_per_rollout,
            max_model_len=min(c.max_model_len for c in caps if c),
            vocab_size=min(c.vocab_size for c in caps if c),
            speculative_method=self.config.speculative.method,
        )
        policy = req.policy or self.config.scheduler.policy
        self.pending.add(req.rollout_id)
        try:
            steps = intake_steps(req, self.tokenizer, limits, policy, self.clock(), batch)
            while True:
                try:
                    next(steps)
                except StopIteration as built:
                    rollout = built.value
                    break
                except RequestRejected as exc:
                    return refuse(exc.code, str(exc))
                yield []
            self.sessions[req.rollout_id] = ClientSession(identity, req.call_id, self.clock())
            log.info("rollout_accepted", rollout_id=req.rollout_id, policy=policy, num_groups=len(rollout.groups),
                     num_samples=rollout.num_samples, max_tokens=req.sampling.max_tokens)
            accepted: Outbox = [ToClient(identity, RolloutAccepted(
                call_id=req.call_id, rollout_id=req.rollout_id, num_groups=len(rollout.groups), policy=policy,
                weights_version=self.weights.service_version))]
            for _ in self.scheduler.submit_steps(rollout, batch):
                yield accepted
                accepted = []
            return accepted
        finally:
            self.pending.discard(req.rollout_id)

    def cancel(self, rollout_id: str, reason: str) -> Outbox:
        """Abort a rollout's chunks and forget its client (no reply: the caller acks; then schedules)."""
        if rollout_id in self.scheduler.rollouts:
            self.metrics.rollout_aborted(rollout_id, reason)
        aborts = self.scheduler.cancel(rollout_id)
        self.sessions.pop(rollout_id, None)
        log.info("rollout_aborted", rollout_id=rollout_id, reason=reason,
                 num_aborted_tasks=sum(len(a.task_ids) for a in aborts))
        return [ToEngine(abort.engine_id, AbortTasks(task_ids=abort.task_ids)) for abort in aborts]

    def fail(self, rollout_id: str, code: str, message: str) -> Outbox:
        """End a rollout with an error: its chunks are aborted, its client gets ``code``."""
        if rollout_id in self.scheduler.rollouts:
            self.metrics.rollout_aborted(rollout_id, code)
        session = self.sessions.pop(rollout_id, None)
        aborts = self.scheduler.cancel(rollout_id)
        out: Outbox = [ToEngine(abort.engine_id, AbortTasks(task_ids=abort.task_ids)) for abort in aborts]
        if session is not None:
            out.append(ToClient(session.identity, ErrorReply(call_id=session.call_id, code=code, message=message)))
        log.error("rollout_failed", rollout_id=rollout_id, code=code, error=message)
        return out
