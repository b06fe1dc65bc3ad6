"""The pure scheduler core: events in, decisions out.

It owns the rollouts, every request's state and the tasks on every engine; the engine records and their
lifecycle are the registry's (``registry.py``, which it holds), the request buffer is the policies' (their
queues of waiting requests). It never awaits, opens sockets or reads the wall clock (``clock`` is
injected), so the control-plane server, the tests and the simulator drive the very same code.

Events: ``engine_joined``/``engine_load``/``engine_lost``/``forget_engine``, ``submit``, ``cancel``,
``chunk_finished``/``chunk_failed``, ``resume``/``end_trajectory`` (a trajectory's environment answered),
``add_host_pool``/``remove_host_pool``, ``transfer_finished``/``transfer_abandoned``. Decisions:
``schedule()`` returns the chunk dispatches, ``take_transfers()`` the KV transfers chunks wait for
(``kvpool/table.py``), ``cancel``/``engine_lost`` what to abort, ``chunk_finished`` what completed.

Invariants (pinned by tests): a request is in exactly one of {its policy's queue, one engine's in-flight
set, waiting for its environment, finished}; a task id is dispatched once; a sample finishes once.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterator
from operator import attrgetter

from seer.controlplane.chunk_task import absorb_chunk, build_chunk_task, chunk_continues
from seer.controlplane.decisions import Abort, Completion, Dispatch, LossReport, SchedulerError, scheduling_status
from seer.controlplane.kvpool.table import LOCAL_HOST, HostPoolTable, KVPlan, PoolBinding, Transfer
from seer.controlplane.policies import Policy, make_policy
from seer.controlplane.policies.base import Assignment
from seer.controlplane.registry import Registry
from seer.controlplane.result_check import refuse_result
from seer.controlplane.stops import Decode, cut_at_stop
from seer.controlplane.turns import turn_ended, waiting
from seer.controlplane.state import EngineState, EngineView, Request, RequestState, Rollout
from seer.config import SchedulerConfig
from seer.stepcost import PRIORS, CostModel, StepCostFit
from seer.protocol import ChunkFinished, EngineCapabilities, EngineLoad, SchedulingStatus, unpack_logprobs, unpack_token_ids

# The decisions (``decisions.py``) are re-exported: callers import them from here.
__all__ = ["Abort", "Completion", "Dispatch", "LossReport", "PoolBinding", "Scheduler", "SchedulerError"]

_INFLIGHT = attrgetter("inflight")
_NO_KV_PLAN = KVPlan(None)  # frozen: one for every chunk that has nothing to load or save

# At most this many waiting requests are given at once to a policy that deals everything
# it holds (``group``); the rest wait in order in ``Scheduler._unqueued``.
POLICY_WINDOW = 4096


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float], decode: Decode | None = None,
                 registry: Registry | None = None, cost_prior: CostModel | None = None) -> None:
        self._clock = clock
        # The engines' step cost, fitted online from the step records they report
        # (``engine_steps``), from the configured prior (or the simulator's own model); the
        # chunked policies take their cost-aware decisions from it.
        self.step_cost = StepCostFit(cost_prior if cost_prior is not None else PRIORS[config.cost_prior]())
        # Token ids -> text, for stop strings that straddle chunk boundaries (pure: the
        # server passes its tokenizer's decode; without it stop strings are only matched
        # by the engines, inside a chunk).
        self._decode = decode
        self.config = config
        # The one table of engines (their lifecycle is the registry's; their tasks are ours).
        self.registry = registry if registry is not None else Registry()
        self.engines: dict[int, EngineView] = self.registry.engines
        self.rollouts: dict[str, Rollout] = {}
        self._policies: dict[str, Policy] = {}
        self._tasks: dict[int, tuple[int, Request]] = {}  # task_id -> (engine_id, request)
        # Assignments beyond an engine's ``max_chunks_per_engine``, in the order the policy
        # made them: waiting requests already placed (part of the request buffer).
        self._held: dict[int, deque[Assignment]] = {}
        self.cut_short = False  # the last ``schedule`` stopped at its limit
        # Submitted requests of whole-request policies not yet given to their policy, in
        # order (``_top_up``): waiting requests too (part of the request buffer).
        self._unqueued: deque[Request] = deque()
        self._next_task_id = 1
        # The host KV pools (one per host), every request's KV home, transfers between them;
        # the disk tier reads the policies' queues for who is needed next (and last).
        self.kv = HostPoolTable(self._policies)
        # The KV pool's epoch: bumped at every weights update *attempt* (a failed one too,
        # unlike the service's version); pool blocks are tagged with it, so KV saved under
        # other weights never matches. On the wire it is the ``weights_version`` of
        # ``KVDescriptor`` and ``PullBlocks``.
        self.kv_epoch = 0

    # ------------------------------------------------------------------ KV pools
    @property
    def pool(self) -> PoolBinding | None:
        """The control plane's own host pool."""
        return self.kv.pools.get(LOCAL_HOST)

    def add_host_pool(self, pool: PoolBinding) -> list[Dispatch]:
        """A host's pool (or its agent) registered; chunks whose transfer it ended go now."""
        return self._after_transfers(self.kv.add(pool))

    def remove_host_pool(self, host_id: str) -> list[Dispatch]:
        return self._after_transfers(self.kv.remove(host_id))

    def take_transfers(self) -> list[Transfer]:
        """KV transfers decided since the last call; each ends with ``transfer_finished``."""
        return self.kv.take_new_transfers()

    def transfer_finished(self, transfer_id: int, ok: bool) -> tuple[Transfer | None, list[Dispatch]]:
        """An agent finished a pull; the chunk that waited for it (if still wanted) goes now,
        with the moved KV or, if it failed, with re-prefill."""
        transfer = self.kv.finish(transfer_id, ok)
        return transfer, self._after_transfers([transfer] if transfer is not None else [])

    def transfer_abandoned(self, transfer_id: int) -> list[Dispatch]:
        """No answer in time: the waiting chunk goes with re-prefill; the destination blocks
        stay held until the agent answers after all (``transfer_finished``)."""
        transfer = self.kv.transfers.get(transfer_id)
        if transfer is None or transfer.abandoned:
            return []
        self.kv.abandon(transfer)
        return self._after_transfers([transfer])

    def _after_transfers(self, transfers: list[Transfer]) -> list[Dispatch]:
        out = []
        for transfer in transfers:
            if transfer.waiter is None:
                continue
            task_id, engine_id, max_tokens = transfer.waiter
            transfer.waiter = None
            entry = self._tasks.get(task_id)
            if entry is None or entry[0] != engine_id or entry[1].task_id != task_id:
                continue  # the chunk was cancelled or its engine lost meanwhile
            dispatch = self._build(entry[1], self.engines[engine_id], task_id, max_tokens)
            if dispatch is not None:
                out.append(dispatch)
        return out

    def weights_changed(self) -> list[Dispatch]:
        """New weights: no KV saved under the old ones may ever load (blocks are tagged
        with the epoch; this also gives every block back). Chunks that waited for a
        transfer (none between rollouts) go now, with re-prefill."""
        self.kv_epoch += 1
        waiting = list(self.kv.transfers.values())
        self.kv.weights_changed([q for r in self.rollouts.values() for g in r.groups for q in g.requests])
        return self._after_transfers(waiting)

    def _kv_plan(self, request: Request, view: EngineView, task_id: int, max_tokens: int) -> KVPlan:
        """What the engine needs to load this chunk's prefix from its host's pool and to
        save its KV for the next chunk, or the transfer the chunk must wait for."""
        geometry = view.capabilities.kv_geometry
        if geometry is None or not self.kv.pools or not self.policy(request.group.rollout.policy).uses_kv_pool:
            return _NO_KV_PLAN  # simulated engines, pool off, a baseline (its engines' own cache only)
        continues = chunk_continues(request, max_tokens, view.capabilities.max_model_len)
        return self.kv.plan(request, view.engine_id, geometry.fingerprint if geometry else None,
                            request.context_tokens, max_tokens, continues, self.kv_epoch, task_id)

    # ------------------------------------------------------------------ engines
    def engine_joined(self, engine_id: int, capabilities: EngineCapabilities, host_id: str = LOCAL_HOST, *,
                      pid: int = 0, loaded_weights_version: int = 0, now_s: float = 0.0, identity: bytes | None = None,
                      joined: bool = False) -> None:
        """An engine is ready for work (``Registry.admit``) on ``host_id``."""
        view = self.engines.get(engine_id)
        if view is not None and view.state is EngineState.READY and view.inflight:
            raise SchedulerError(f"engine {engine_id} joined twice while it has work in flight")
        self.registry.admit(engine_id, capabilities, pid=pid, loaded_weights_version=loaded_weights_version, now_s=now_s,
                            identity=identity, joined=joined)
        self.kv.engine_hosts[engine_id] = host_id
        self.kv.num_live_engines = len(self.registry.live())

    def engine_load(self, engine_id: int, load: EngineLoad) -> None:
        view = self.engines.get(engine_id)
        if view is not None:
            view.load = load

    def scheduling_status(self) -> SchedulingStatus:
        """The fitted step cost and the configured policy's cost-aware choices (status, metrics)."""
        return scheduling_status(self.config, self.policy(self.config.policy), self.step_cost)

    def engine_steps(self, engine_id: int, records: list[tuple[float, ...]], weight: float = 1.0) -> int:
        """Step records ``(seconds, batch, KV tokens, prefilled tokens)`` an engine reported;
        those within physical bounds refine the step-cost fit (``seer/stepcost.py``). Returns
        how many were taken. ``weight``: identical steps each record stands for."""
        if engine_id not in self.engines:
            return 0
        return self.step_cost.add(records, weight)  # type: ignore[arg-type]

    def engine_lost(self, engine_id: int) -> LossReport:
        """Return the lost engine's in-flight requests to the buffer (from their last
        completed chunk) and report rollouts that now have no engine to run on."""
        report = LossReport(previous=self.registry.lose(engine_id))
        self.kv.num_live_engines = len(self.registry.live())
        if report.previous is not EngineState.READY:
            return report  # not live (or never admitted): nothing of ours on it
        view = self.engines[engine_id]
        for held in self._held.pop(engine_id, ()):
            self.kv.queue.released(held.request)
            self._enqueue(held.request)
        for task_id, request in list(view.inflight.items()):
            self._tasks.pop(task_id, None)
            self._enqueue(request)
            report.requeued.append(request)
        view.inflight.clear()
        if not self.live_engines():
            report.stranded_rollouts = [r for r in self.rollouts.values() if not r.done]
        return report

    def forget_engine(self, engine_id: int) -> None:
        """The registry forgot this lost engine (``Registry.forget_lost``): so does every table
        here kept by engine id (the policies', the KV-host map, the rollouts' preemption marks)."""
        for policy in self._policies.values():
            policy.engine_forgotten(engine_id)
        self.kv.engine_hosts.pop(engine_id, None)
        for rollout in self.rollouts.values():
            rollout.preemptions_at_start.pop(engine_id, None)

    def live_engines(self) -> list[EngineView]:
        return self.registry.live()

    # ------------------------------------------------------------------ rollouts
    def policy(self, name: str) -> Policy:
        if name not in self._policies:
            policy = self._policies[name] = make_policy(name, self.config)
            policy.step_cost = self.step_cost  # the chunked policies decide by the fitted step cost
        return self._policies[name]

    def submit(self, rollout: Rollout) -> None:
        for _ in self.submit_steps(rollout, batch=0):
            pass

    def submit_steps(self, rollout: Rollout, batch: int) -> Iterator[None]:
        """Register a rollout and enqueue its requests, yielding after every ``batch``
        requests (0: never) so a caller on an event loop can let it run in between; what
        is enqueued may be scheduled meanwhile. Stops early if the rollout is cancelled
        meanwhile. If a policy refuses a request, nothing of the rollout stays behind."""
        if rollout.rollout_id in self.rollouts:
            raise SchedulerError(f"rollout {rollout.rollout_id} already exists")
        policy = self.policy(rollout.policy)  # validates the name
        rollout.preemptions_at_start = {e.engine_id: e.load.num_preemptions for e in self.engines.values()}
        self.rollouts[rollout.rollout_id] = rollout
        num_enqueued = 0
        try:
            for group in rollout.groups:
                for request in group.requests:
                    if rollout.cancelled:
                        return
                    if request.state is RequestState.TOOL_WAIT:
                        continue  # an agent's trajectory: its first call starts it
                    if policy.chunked:
                        self._enqueue(request)
                    else:  # given to the policy a window at a time (``schedule``)
                        self._unqueued.append(request)
                    num_enqueued += 1
                    if batch and num_enqueued % batch == 0:
                        yield
        except Exception:
            self.rollouts.pop(rollout.rollout_id, None)
            policy.discard_rollout(rollout.rollout_id)
            self._drop_unqueued(rollout)
            raise

    def _drop_unqueued(self, rollout: Rollout) -> None:
        if any(r.group.rollout is rollout for r in self._unqueued):
            self._unqueued = deque(r for r in self._unqueued if r.group.rollout is not rollout)

    def cancel(self, rollout_id: str) -> list[Abort]:
        rollout = self.rollouts.pop(rollout_id, None)
        if rollout is None:
            return []
        rollout.cancelled = True
        self.policy(rollout.policy).discard_rollout(rollout_id)
        self._drop_unqueued(rollout)
        for engine_id, held in self._held.items():
            if any(a.request.group.rollout is rollout for a in held):
                for a in held:
                    if a.request.group.rollout is rollout:
                        self.kv.queue.released(a.request)
                self._held[engine_id] = deque(a for a in held if a.request.group.rollout is not rollout)
        aborts: dict[int, list[int]] = {}
        for group in rollout.groups:
            for request in group.requests:
                self.kv.drop(request)
                if request.state is RequestState.RUNNING and request.task_id is not None:
                    engine_id, _ = self._tasks.pop(request.task_id)
                    self.engines[engine_id].inflight.pop(request.task_id, None)
                    aborts.setdefault(engine_id, []).append(request.task_id)
                    request.state = RequestState.FINISHED
                    request.finish_reason = "abort"
        self.policy(rollout.policy).rollout_ended(rollout_id, self.registry.schedulable())
        return [Abort(engine_id, task_ids) for engine_id, task_ids in sorted(aborts.items())]

    def forget(self, rollout_id: str) -> None:
        """Drop a completed rollout's state once its results have been delivered."""
        rollout = self.rollouts.get(rollout_id)
        if rollout is not None and rollout.done:
            del self.rollouts[rollout_id]
            self.policy(rollout.policy).rollout_ended(rollout_id, self.registry.schedulable())

    # ------------------------------------------------------------------ decisions
    def num_waiting(self) -> int:
        return (sum(len(p) for p in self._policies.values()) + sum(len(h) for h in self._held.values())
                + len(self._unqueued))

    def schedule(self, limit: int = sys.maxsize) -> list[Dispatch]:
        """Place waiting work: at most ``limit`` assignments this call (the server's loop
        slice); ``cut_short`` says it stopped there with work perhaps still placeable."""
        self.cut_short = False
        engines = self.registry.schedulable()
        if not engines:
            return []
        dispatches: list[Dispatch] = []
        # Bounded dispatch: an engine holds at most ``max_chunks_per_engine`` chunks. What a
        # policy assigns beyond that waits here, placed (``_held``), and goes as chunks finish.
        # An engine's room is ``cap - len(inflight)``: every dispatch below enters its map.
        cap = self.config.max_chunks_per_engine
        self._top_up()
        if self._held:
            schedulable = {e.engine_id for e in engines}
            for engine_id, held in self._held.items():
                if engine_id in schedulable:
                    inflight = self.engines[engine_id].inflight
                    while held and len(inflight) < cap and limit > 0:
                        a, limit = held.popleft(), limit - 1
                        self.kv.queue.released(a.request)
                        self._apply_into(dispatches, a)
        self.cut_short = limit <= 0
        for policy in self._policies.values():
            if not len(policy):
                continue
            # ``engines`` itself (one kept list) in the usual case: no engine is full.
            open_engines = engines if max(map(len, map(_INFLIGHT, engines))) < cap else [
                e for e in engines if len(e.inflight) < cap]
            if open_engines and not self.cut_short:
                assigned = policy.assign(open_engines, limit)
                limit -= len(assigned)
                self.cut_short = limit <= 0
                for a in assigned:
                    if len(self.engines[a.engine_id].inflight) >= cap:
                        self._held.setdefault(a.engine_id, deque()).append(a)
                        self.kv.queue.held(a.request)
                        self._move_kv_ahead(a)
                        continue
                    self._apply_into(dispatches, a)
        return dispatches

    def _top_up(self) -> None:
        """Give whole-request policies (``group``) their submitted requests a window at a
        time: such a policy deals everything it holds in one ``assign``, which for
        100,000 requests held the loop for seconds."""
        while self._unqueued:
            request = self._unqueued[0]
            policy = self.policy(request.group.rollout.policy)
            if len(policy) >= POLICY_WINDOW:
                return
            self._unqueued.popleft()
            self._enqueue(request)

    def _move_kv_ahead(self, a: Assignment) -> None:
        """A held request's engine is known: if its KV is on another host, start moving it
        there now (``HostPoolTable.move_ahead``), so its chunk does not wait for the move."""
        if len(self.kv.pools) < 2:
            return
        geometry = self.engines[a.engine_id].capabilities.kv_geometry
        if geometry is not None:
            self.kv.move_ahead(a.request, a.engine_id, geometry.fingerprint, self.kv_epoch)

    def _apply_into(self, dispatches: list[Dispatch], a: Assignment) -> None:
        dispatch = self._apply(a.request, a.engine_id, a.max_tokens)
        if dispatch is not None:  # else it waits for its KV (take_transfers)
            dispatches.append(dispatch)

    def _enqueue(self, request: Request) -> None:
        request.state, request.engine_id, request.task_id = RequestState.WAITING, None, None
        self.policy(request.group.rollout.policy).enqueue(request)

    def _apply(self, request: Request, engine_id: int, max_tokens: int) -> Dispatch | None:
        view = self.engines[engine_id]
        if request.state is not RequestState.WAITING:
            raise SchedulerError(f"policy assigned {request.request_id} which is not waiting")
        if view.state is not EngineState.READY:
            raise SchedulerError(f"policy assigned {request.request_id} to engine {engine_id} which is not ready")
        if not 1 <= max_tokens <= request.remaining_tokens:
            raise SchedulerError(f"policy gave {request.request_id} a chunk of {max_tokens} tokens")
        task_id, self._next_task_id = self._next_task_id, self._next_task_id + 1
        request.state, request.engine_id, request.task_id = RequestState.RUNNING, engine_id, task_id
        request.num_chunks += 1
        request.chunk_max_tokens = max_tokens
        request.group.rollout.num_chunks += 1
        previous = request.engine_history[-1] if request.engine_history else None
        request.migrated_from = previous if previous is not None and previous != engine_id else None
        if previous != engine_id:
            request.engine_history.append(engine_id)
        if request.first_scheduled_s is None:
            request.first_scheduled_s = self._clock()
        view.inflight[task_id] = request
        self._tasks[task_id] = (engine_id, request)
        return self._build(request, view, task_id, max_tokens)

    def _build(self, request: Request, view: EngineView, task_id: int, max_tokens: int) -> Dispatch | None:
        """The chunk task, or None while it waits for a KV transfer (it stays in flight)."""
        ignore_eos = request.sampling.ignore_eos
        if request.forced_length is not None:  # trace replay: exactly the trace's length, EOS ignored
            max_tokens = max(1, min(max_tokens, request.forced_length - request.num_generated_tokens))
            ignore_eos = True
        plan = self._kv_plan(request, view, task_id, max_tokens)
        if plan.transfer is not None:
            if plan.transfer.chunk_waits_since_s is None:
                plan.transfer.chunk_waits_since_s = self._clock()
            return None
        probe = request.sample_index == 0 and self.policy(request.group.rollout.policy).uses_probes
        task = build_chunk_task(request, task_id, max_tokens, ignore_eos, plan.kv, probe)
        return Dispatch(view.engine_id, task, request, kv_pool_full=plan.pool_full, kv_lost=plan.kv_lost)

    # ------------------------------------------------------------------ results
    def refuse_result(self, msg: ChunkFinished) -> str:
        """Why this result cannot be applied to its chunk ('' if it can, or if the chunk is
        unknown: ``chunk_finished`` ignores it). A refused result is the server's to turn
        into a failed chunk (``chunk_failed``)."""
        entry = self._tasks.get(msg.task_id)
        if entry is None or entry[0] != msg.engine_id:
            return ""
        engine_id, request = entry
        capabilities = self.engines[engine_id].capabilities
        return refuse_result(msg, budget_tokens=request.chunk_max_tokens, context_tokens=request.context_tokens,
                             vocab_size=capabilities.vocab_size if capabilities is not None else 0)

    def chunk_finished(self, msg: ChunkFinished) -> Completion | None:
        """Apply a finished chunk; None if the task is unknown (cancelled or stale)."""
        engine_id, task_id, finish_reason = msg.engine_id, msg.task_id, msg.finish_reason
        entry = self._tasks.get(task_id)
        if entry is None or entry[0] != engine_id:
            return None
        token_ids, logprobs = unpack_token_ids(msg.token_ids), unpack_logprobs(msg.logprobs)
        del self._tasks[task_id]
        request = entry[1]
        self.engines[engine_id].inflight.pop(task_id, None)
        rollout = request.group.rollout
        if self._decode is not None:
            token_ids, logprobs, finish_reason = cut_at_stop(self._decode, request, token_ids, logprobs, finish_reason)
        absorb_chunk(request, msg.token_ids, token_ids, logprobs)
        request.group.num_generated_tokens += len(token_ids)
        rollout.num_output_tokens += len(token_ids)
        rollout.per_engine_output_tokens[engine_id] = rollout.per_engine_output_tokens.get(engine_id, 0) + len(token_ids)
        request.engine_id, request.task_id = None, None
        self.kv.saved(request, msg.kv_saved_tokens)
        limit = self.engines[engine_id].capabilities.max_model_len
        at_budget = request.remaining_tokens <= 0 or request.context_tokens >= limit
        if request.forced_length is not None and request.num_generated_tokens >= request.forced_length \
                and not at_budget:
            finish_reason = "stop"  # a replayed sample ends at its trace length as at an EOS
        if request.trajectory is not None and (finish_reason == "stop" or at_budget):
            # A trajectory's turn ended: it waits for its environment (``turns.py``).
            turn_ended(request, "stop" if finish_reason == "stop" else "length", self._clock())
            request.state = RequestState.TOOL_WAIT
            done = Completion(request, turn_ended=True)
        elif finish_reason == "stop" or at_budget:
            done = self._finish(request, "stop" if finish_reason == "stop" else "length")
        else:
            self._enqueue(request)
            done = Completion(request, requeued=True)
        done.num_tokens = len(token_ids)
        return done

    def chunk_failed(self, engine_id: int, task_id: int) -> Request | None:
        """An engine could not run a chunk: put the request back (from its last chunk)."""
        entry = self._tasks.get(task_id)
        if entry is None or entry[0] != engine_id:
            return None
        del self._tasks[task_id]
        request = entry[1]
        request.num_failures += 1
        self.engines[engine_id].inflight.pop(task_id, None)
        self._enqueue(request)
        return request

    def resume(self, request: Request, new_segment: bool = False) -> None:
        """A waiting trajectory got its answer appended, or a new prompt (``new_segment``: its KV goes)."""
        if new_segment:
            self.kv.drop(waiting(request))
        self.policy(request.group.rollout.policy).turn_answered(waiting(request))
        self._enqueue(request)

    def end_trajectory(self, request: Request, reason: str) -> Completion:
        done = self._finish(waiting(request), reason)
        self.policy(request.group.rollout.policy).trajectory_ended(request)
        return done

    def _finish(self, request: Request, reason: str) -> Completion:
        self.kv.drop(request)  # the moment it finishes
        request.packed_generated = None
        request.state, request.finish_reason = RequestState.FINISHED, reason
        request.finished_s = self._clock()
        group, rollout = request.group, request.group.rollout
        group.num_finished += 1
        rollout.num_samples_done += 1
        done = Completion(request, sample_finished=True)
        if group.done:
            rollout.num_groups_done += 1
            done.group_finished = group
            if rollout.done:
                done.rollout_finished = rollout
        return done

    def preemptions_since_start(self, rollout: Rollout) -> int:
        start = rollout.preemptions_at_start
        return sum(max(0, v.load.num_preemptions - start.get(e, 0)) for e, v in self.engines.items())
