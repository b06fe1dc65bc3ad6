"""Rollouts as their clients see them: accepted or refused, delivered group by group,
then completed, failed or cancelled.

Owns: the client session of every open rollout (who asked, under which call id, when it
was last heard from -- the server cancels the rollout of a client silent for
``server.client_timeout_s`` once the rollout is admitted), the admission of accepted
rollouts into the scheduler at the pace their samples finish (the backlog and its window,
``backlog.py``; a rollout waiting there holds no engine and is not timed out), the refusals at intake (``no_engines``, ``busy``,
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
from seer.controlplane.backlog import Backlog, Parked, may_admit, window_samples
from seer.controlplane.intake import (
    INTAKE_BATCH,
    Limits,
    RequestRejected,
    build_steps,
    check_steps,
    run_steps,
)
from seer.controlplane.memory import MemoryRelease
from seer.controlplane.metrics import Metrics
from seer.controlplane.agent_calls import AgentKeys
from seer.controlplane.outbox import Outbox, ToCall, ToClient, ToEngine
from seer.controlplane.registry import Registry
from seer.controlplane.results import (
    chunk_finished_fields,
    chunk_migrated_fields,
    group_result,
    kv_load_fell_back_fields,
    rollout_finished_fields,
)
from seer.controlplane.scheduler import Completion, Scheduler
from seer.controlplane import turns
from seer.controlplane.state import Request, Rollout
from seer.controlplane.stats import rollout_stats
from seer.controlplane.tokenizer import Tokenizer
from seer.controlplane.weights import Weights
from seer.protocol import (
    AbortTasks,
    ChunkFinished,
    EngineCapabilities,
    ErrorReply,
    GroupCompleted,
    RolloutAccepted,
    RolloutCompleted,
    RolloutRequest,
    TurnInput,
    unpack_token_ids,
)

log = structlog.get_logger()


@dataclass
class ClientSession:
    identity: bytes
    call_id: str
    last_heard_s: float
    # False while the rollout waits in the backlog: it holds no engine, and its client's
    # silence is not timed until it is admitted (``timed_out``).
    admitted: bool = False


class ClientSessions:
    """The open rollouts' client sessions, and what their clients are sent."""

    def __init__(self, config: SeerConfig, scheduler: Scheduler, registry: Registry, tokenizer: Tokenizer,
                 weights: Weights, *, clock: Callable[[], float], metrics: Metrics | None = None,
                 memory: MemoryRelease | None = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.registry = registry  # read only: which engines are ready, their limits
        self.tokenizer = tokenizer
        self.weights = weights  # read only: the version reported, whether an update is in flight
        self.sessions: dict[str, ClientSession] = {}  # rollout_id -> client
        # Rollout ids taken in but not (yet) in the scheduler: being checked, parked in the
        # backlog, or being built and enqueued (``intake``, ``admit_steps``).
        self.pending: set[str] = set()
        self.backlog = Backlog()  # accepted rollouts waiting for the admission window (``backlog.py``)
        self.open: dict[str, Rollout] = {}  # admitted rollouts still in the scheduler
        self.open_samples = 0  # their samples not yet finished
        self._admitting = False  # a batch of admissions is under way (``backlog.may_admit``)
        self.ended_samples = 0  # samples of finished rollouts (the server's early memory release resets it)
        self.clock = clock
        self.metrics = metrics if metrics is not None else Metrics(clock)  # told what finished and failed
        self.memory = memory  # given each delivered rollout to take apart (``MemoryRelease.dismantle``)
        self.agent_keys = AgentKeys()  # the open agent rollouts' call keys (``agent_calls.py``)
        self.openai_url = ""  # the OpenAI endpoint's, when on (set by it: ``openai_http.py``)
        self.openai_model = ""

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
        if done.sample_finished and request.group.rollout.rollout_id in self.open:
            self.open_samples -= 1
        done.recomputed_tokens = turns.recomputed_tokens(request, msg)
        request.group.rollout.num_recomputed_tokens += done.recomputed_tokens
        log.info("chunk_finished", **chunk_finished_fields(msg, request, len(unpack_token_ids(msg.token_ids))),
                 recomputed_tokens=done.recomputed_tokens)
        self.metrics.chunk_finished(msg, done, migrated=request.migrated_from is not None)
        if request.migrated_from is not None:
            geometry = self.scheduler.engines[msg.engine_id].capabilities.kv_geometry
            bytes_per_token = geometry.bytes_per_token if geometry is not None else 0
            log.info("chunk_migrated", **chunk_migrated_fields(msg, request, bytes_per_token))
        if msg.kv_load_failed_tokens:
            log.warning("kv_load_fell_back", **kv_load_fell_back_fields(msg, request))
            request.migrated_from = None
        if request.trajectory is not None:
            turns.chunk_done(request, msg, done.recomputed_tokens)
            if done.turn_ended:
                return self._turn_ended(request)
        return self.deliver(done)

    def _turn_ended(self, request: Request) -> Outbox:
        """A trajectory waits for its environment: its client is asked (``TurnEnded``)."""
        session = self.sessions.get(request.group.rollout.rollout_id)
        if session is None:
            return []
        msg = turns.turn_ended_message(request, session.call_id, self.tokenizer.decode)
        log.info("turn_ended", request_id=request.request_id, turn=msg.turn, num_tokens=len(msg.token_ids),
                 finish_reason=msg.finish_reason, num_context_tokens=msg.num_context_tokens, final=msg.final)
        if not request.group.rollout.agent:
            return [ToClient(session.identity, msg)]
        # An agent's call waits for this turn; an agent function that returned meanwhile ends it.
        out: Outbox = [ToCall(request.request_id, msg)]
        pending = request.trajectory.pending_end  # type: ignore[union-attr]
        if isinstance(pending, TurnInput):
            request.trajectory.pending_end = None  # type: ignore[union-attr]
            out += self.on_turn_input(session.identity, pending)
        return out

    def on_turn_input(self, identity: bytes, msg: TurnInput) -> Outbox:
        """A trajectory's environment answered: append and resume it, or end it (the caller
        schedules after). A stale answer (the rollout ended, the turn is not the one
        waiting) is dropped; one from another client is refused."""
        session = self.sessions.get(msg.rollout_id)
        rollout = self.scheduler.rollouts.get(msg.rollout_id)
        if session is None or rollout is None:
            log.debug("stale_turn_input", rollout_id=msg.rollout_id, group_index=msg.group_index)
            return []
        if session.identity != identity:
            return [ToClient(identity, ErrorReply(call_id=msg.call_id, code="not_your_rollout",
                                                  message=f"rollout {msg.rollout_id!r} belongs to another client"))]
        session.last_heard_s = max(session.last_heard_s, self.clock())
        request = turns.waiting_request(rollout, msg)
        if request is None and msg.turn == -1 and rollout.agent:  # its call's turn still runs: at its end
            running = turns.sample_of(rollout, msg)
            if running is not None and running.trajectory is not None and running.finish_reason is None:
                running.trajectory.pending_end = msg
                return []
        if request is None:
            log.warning("stale_turn_input", rollout_id=msg.rollout_id, group_index=msg.group_index,
                        sample_index=msg.sample_index, turn=msg.turn)
            return []
        ended = turns.answer(request, msg, self.tokenizer, self.vocab_size())
        records = request.trajectory.turns  # type: ignore[union-attr]
        record = records[-2 if ended is None else -1] if records else None  # None: an agent that made no call
        log.info("turn_answered", request_id=request.request_id, turn=msg.turn, outcome=msg.outcome,
                 tool_name=msg.tool_name, tool_s=round(msg.tool_s, 3),
                 appended_tokens=record.appended_tokens if record else 0, error=(record.error if record else
                                                                                msg.error) or None)
        if ended is None:
            self.scheduler.resume(request)
            return []
        done = self.scheduler.end_trajectory(request, ended)
        if rollout.rollout_id in self.open:
            self.open_samples -= 1
        return self.deliver(done)

    def _ready_capabilities(self) -> list[EngineCapabilities]:
        caps = (self.registry.engines[e].capabilities for e in self.registry.ready_ids())
        return [c for c in caps if c is not None]

    def vocab_size(self) -> int:
        """The vocabulary every ready engine accepts (the tokenizer's while none is ready):
        the bound on prompt, stop and environment token ids."""
        sizes = [c.vocab_size for c in self._ready_capabilities()]
        return min(sizes) if sizes else self.tokenizer.vocab_size

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
            self._ended(rollout.rollout_id, finished=True)
        return out

    def on_request(self, identity: bytes, req: RolloutRequest) -> Outbox:
        """Accept a rollout (the caller schedules it) or refuse it with an ``ErrorReply``,
        in one go (``intake``, then ``admit_steps``, without pauses)."""
        yielded, last = run_steps(self.intake(identity, req))
        admitted, failed = run_steps(self.admit_steps())
        return [send for out in yielded + admitted for send in out] + last + failed

    def intake(self, identity: bytes, req: RolloutRequest, batch: int = INTAKE_BATCH) -> Generator[Outbox, None, Outbox]:
        """Accept a rollout or refuse it, pausing (yielding what to send so far) between
        batches of prompts checked, samples built and requests enqueued (``intake.py``),
        so the server's loop answers heartbeats and status meanwhile. The rollout id is
        reserved meanwhile (a second request with it is a ``duplicate_rollout``); the
        refusal ``ErrorReply`` is returned. An accepted rollout enters the scheduler at
        once if the admission window has room and no other rollout waits for it (its
        client gets ``RolloutAccepted`` before any of its requests can be scheduled);
        otherwise its ``RolloutAccepted`` is returned and it waits in the backlog
        (``backlog.py``) for ``admit_steps``. The caller schedules after an admission."""
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
        if req.agent_keys is not None:
            if not self.openai_url:
                return refuse("openai_off", "an agent rollout needs the daemon's OpenAI endpoint: set "
                              "[openai] enabled = true in seer.toml and restart the daemon")
            if self.agent_keys.taken(req.agent_keys):
                return refuse("bad_trajectory", "an agent key of this rollout is already in use; mint fresh keys")
        limits = Limits(
            max_group_size=self.config.server.max_group_size,
            max_prompts=self.config.server.max_prompts_per_rollout,
            max_model_len=min(c.max_model_len for c in self._ready_capabilities()),
            vocab_size=self.vocab_size(),
            speculative_method=self.config.speculative.method,
        )
        policy = req.policy or self.config.scheduler.policy
        self.pending.add(req.rollout_id)
        admitting = False
        try:
            steps = check_steps(req, self.tokenizer, limits, policy, batch)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    checked = done.value
                    break
                except RequestRejected as exc:
                    return refuse(exc.code, str(exc))
                yield []
            parked = Parked(identity, req, policy, checked)
            self.sessions[req.rollout_id] = ClientSession(identity, req.call_id, self.clock())
            if req.agent_keys is not None:
                self.agent_keys.add(req.rollout_id, req.agent_keys)
            accepted: Outbox = [ToClient(identity, RolloutAccepted(
                call_id=req.call_id, rollout_id=req.rollout_id, num_groups=len(req.prompts), policy=policy,
                weights_version=self.weights.service_version,
                openai_url=self.openai_url if req.agent_keys is not None else "",
                openai_model=self.openai_model if req.agent_keys is not None else ""))]
            admitting = not self.backlog and may_admit(self.open_samples, self.window(), self._admitting)
            log.info("rollout_accepted", rollout_id=req.rollout_id, policy=policy, num_groups=len(req.prompts),
                     num_samples=parked.num_samples, max_tokens=req.sampling.max_tokens,
                     num_queued=0 if admitting else len(self.backlog) + 1)
            if not admitting:
                self.backlog.park(parked)
                return accepted
            return (yield from self._admit(parked, accepted, batch))
        finally:
            if not admitting and req.rollout_id not in self.backlog:
                self.pending.discard(req.rollout_id)

    def window(self) -> int:
        """Open samples the scheduler may hold before admission waits (``backlog.py``)."""
        return window_samples(len(self.registry.ready_ids()))

    def admit_steps(self, engines_expected: bool = False,
                    batch: int = INTAKE_BATCH) -> Generator[Outbox, None, Outbox]:
        """Admit parked rollouts while the window has room, clients taking turns, pausing
        between batches as ``intake`` does (yields what to send so far; the caller
        schedules after). With no ready engine nothing is admitted; if none is expected
        either (``engines_expected``: none starting or catching up, no wait for a joining
        engine) every parked rollout fails with ``no_engines``, as running ones do."""
        out: Outbox = []
        while self.backlog:
            if not self.registry.ready_ids():
                if not engines_expected:
                    for rollout_id in self.backlog.ids():
                        out += self.fail(rollout_id, "no_engines", "every engine is lost and none is starting; "
                                         "check the engine logs in the run dir, join engines or restart the daemon")
                break
            if not may_admit(self.open_samples, self.window(), self._admitting):
                self._admitting = False
                break
            self._admitting = True
            parked = self.backlog.pop()
            if parked is None:
                break
            yield out
            out = yield from self._admit(parked, [], batch)
        if not self.backlog:
            self._admitting = False
        return out

    def _admit(self, parked: Parked, first: Outbox, batch: int) -> Generator[Outbox, None, Outbox]:
        """Build a parked rollout's requests and enqueue them (``first`` goes out at the first
        pause after the first batch is enqueued). A rollout cancelled meanwhile is dropped."""
        req = parked.req
        rollout_id = req.rollout_id
        try:
            steps = build_steps(req, parked.checked, parked.policy, self.clock(), batch)
            while True:
                try:
                    next(steps)
                except StopIteration as built:
                    rollout = built.value
                    break
                yield []
            session = self.sessions.get(rollout_id)
            if session is None:
                return first  # cancelled or failed while being built
            session.admitted = True
            session.last_heard_s = max(session.last_heard_s, self.clock())  # its client is timed from now on
            self.open[rollout_id] = rollout
            self.open_samples += rollout.num_samples
            try:
                for _ in self.scheduler.submit_steps(rollout, batch):
                    yield first
                    first = []
            except Exception as exc:  # noqa: BLE001 - the scheduler kept nothing of it: neither do we
                log.exception("rollout_admission_failed", rollout_id=rollout_id)
                self._closed(rollout_id)
                self.sessions.pop(rollout_id, None)
                return first + [ToClient(parked.identity, ErrorReply(
                    call_id=req.call_id, code="internal_error",
                    message=f"internal error: {type(exc).__name__}: {exc} (see the daemon's controlplane.log)"))]
            return first
        finally:
            self.pending.discard(rollout_id)

    def _closed(self, rollout_id: str, finished: bool = False) -> Rollout | None:
        """A rollout left the scheduler (finished, cancelled or failed): its open samples leave
        the window. A finished one's samples count towards an early memory release
        (``ended_samples``). The rollout, if it was open."""
        self.agent_keys.remove(rollout_id)
        rollout = self.open.pop(rollout_id, None)
        if rollout is not None:
            num_samples = rollout.num_samples
            self.open_samples -= num_samples - rollout.num_samples_done
            if finished:
                self.ended_samples += num_samples
        return rollout

    def _ended(self, rollout_id: str, finished: bool = False) -> None:
        """The scheduler let go of the rollout (``forget``, or ``cancel``: its aborted chunks
        come back as unknown tasks): ``_closed``, then it is taken apart
        (``MemoryRelease.dismantle``), in that order: its samples are counted from its groups."""
        rollout = self._closed(rollout_id, finished)
        if rollout is not None and self.memory is not None:
            self.memory.dismantle(rollout)

    def timed_out(self, now_s: float) -> list[str]:
        """Admitted rollouts whose client was silent for longer than ``server.client_timeout_s``
        (counted from the last heartbeat, or from the admission if later)."""
        limit = self.config.server.client_timeout_s
        return [rollout_id for rollout_id, session in self.sessions.items()
                if session.admitted and now_s - session.last_heard_s > limit]

    def cancel(self, rollout_id: str, reason: str, by: bytes | None = None) -> Outbox:
        """Abort a rollout's chunks and forget its client (no reply to ``by``, the client that
        cancelled it: the caller acks; then schedules). Cancelled by another client (an
        operator's ``CancelRollout``), the rollout's own client is told: its call ends with
        ``rollout_cancelled`` instead of waiting for groups that will never come."""
        if rollout_id in self.scheduler.rollouts:
            self.metrics.rollout_aborted(rollout_id, reason)
        self._unpark(rollout_id)
        aborts = self.scheduler.cancel(rollout_id)
        self._ended(rollout_id)
        session = self.sessions.pop(rollout_id, None)
        log.info("rollout_aborted", rollout_id=rollout_id, reason=reason,
                 num_aborted_tasks=sum(len(a.task_ids) for a in aborts))
        out: Outbox = [ToEngine(abort.engine_id, AbortTasks(task_ids=abort.task_ids)) for abort in aborts]
        if session is not None and by is not None and session.identity != by:
            out.append(ToClient(session.identity, ErrorReply(
                call_id=session.call_id, code="rollout_cancelled",
                message=f"rollout {rollout_id} was cancelled by another client (a CancelRollout naming it); "
                        "the groups it had not yet returned are dropped: submit it again to run them")))
        return out

    def fail(self, rollout_id: str, code: str, message: str) -> Outbox:
        """End a rollout with an error: its chunks are aborted, its client gets ``code``."""
        if rollout_id in self.scheduler.rollouts:
            self.metrics.rollout_aborted(rollout_id, code)
        session = self.sessions.pop(rollout_id, None)
        self._unpark(rollout_id)
        aborts = self.scheduler.cancel(rollout_id)
        self._ended(rollout_id)
        out: Outbox = [ToEngine(abort.engine_id, AbortTasks(task_ids=abort.task_ids)) for abort in aborts]
        if session is not None:
            out.append(ToClient(session.identity, ErrorReply(call_id=session.call_id, code=code, message=message)))
        log.error("rollout_failed", rollout_id=rollout_id, code=code, error=message)
        return out

    def _unpark(self, rollout_id: str) -> None:
        if self.backlog.remove(rollout_id) is not None:
            self.pending.discard(rollout_id)
