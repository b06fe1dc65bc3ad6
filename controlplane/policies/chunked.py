"""Divided rollout's machinery, shared by every chunked policy: chunk budgets, KV-budget
admission and placement. Subclasses only decide the *order* of waiting requests.

Chunk budget: ``min(chunk_size_tokens, remaining budget, room left in max_model_len)``.
After each chunk the request returns to the queue until EOS or its budget.

Admission (the paper's SELECTINSTANCE): an engine takes a chunk only if the tokens it
has reserved — context + chunk budget of every request in flight on it, rounded up to
KV blocks — plus this chunk's fit in ``kv_admission_fraction`` of its KV capacity. vLLM
then never needs to preempt. An idle engine takes any single chunk, so a request
larger than the admission budget still runs (alone) instead of waiting forever. A
request that fits nowhere keeps its place in the order while up to ``MAX_SKIPS``
requests behind it are tried (backfill), then the round ends and the skipped requests
go back in order, to be tried again when a chunk returns.

Placement: while the spread of in-flight requests across engines is <= the imbalance
threshold, the engine with the longest cached prefix of the request wins (the engine
of its previous chunk holds its whole context; an engine that ran a sibling holds the
prompt); above it, the least-loaded engine. Ties go to fewer in-flight, then lower id.
Moving the KV of a migrated request (pool or re-prefill) is the engines' business.
"""

from __future__ import annotations

from seer.config import SchedulerConfig
from seer.controlplane.policies.base import Assignment
from seer.controlplane.state import EngineView, Request, RequestState


MAX_SKIPS = 64


class _Budgets:
    """Per-engine reserved KV tokens and in-flight counts for one assignment round."""

    def __init__(self, engines: list[EngineView], fraction: float) -> None:
        self.engines = engines
        self.reserved = {e.engine_id: sum(_blocks(r.context_tokens + r.chunk_max_tokens, e)
                                          for r in e.inflight.values()) for e in engines}
        self.inflight = {e.engine_id: e.num_inflight for e in engines}
        self.capacity = {e.engine_id: int(e.capabilities.kv_capacity_tokens * fraction) for e in engines}

    def fits(self, engine: EngineView, tokens: int) -> bool:
        if self.inflight[engine.engine_id] == 0:
            return True  # an idle engine takes any one chunk: refusing would wait forever
        return self.reserved[engine.engine_id] + _blocks(tokens, engine) <= self.capacity[engine.engine_id]

    def take(self, engine: EngineView, tokens: int) -> None:
        self.reserved[engine.engine_id] += _blocks(tokens, engine)
        self.inflight[engine.engine_id] += 1

    def spread(self) -> int:
        counts = self.inflight.values()
        return max(counts) - min(counts)


def is_live(request: Request) -> bool:
    """Still waiting and not part of a cancelled rollout (queues drop the rest lazily)."""
    return request.state is RequestState.WAITING and not request.group.rollout.cancelled


def _blocks(tokens: int, engine: EngineView) -> int:
    block = max(1, engine.capabilities.block_size)
    return -(-tokens // block) * block


class ChunkedPolicy:
    """Base of ``divided``, ``context`` and ``oracle``. Subclasses implement the queue:
    ``_push``, ``_pop`` (best waiting request or None) and ``_unpop`` (put it back)."""

    name = "chunked"
    chunked = True

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._waiting_by_rollout: dict[str, int] = {}
        self._group_engines: dict[str, set[int]] = {}  # engines that hold a group's prompt

    # ------------------------------------------------------------------ queue plumbing
    def __len__(self) -> int:
        return sum(self._waiting_by_rollout.values())

    def enqueue(self, request: Request) -> None:
        rid = request.group.rollout.rollout_id
        self._waiting_by_rollout[rid] = self._waiting_by_rollout.get(rid, 0) + 1
        self._push(request)

    def discard_rollout(self, rollout_id: str) -> None:
        # Entries stay in the queue and are skipped when popped (rollout.cancelled).
        self._waiting_by_rollout.pop(rollout_id, None)

    def _next(self) -> Request | None:
        while (request := self._pop()) is not None:
            if not is_live(request):
                continue  # a cancelled rollout's leftovers
            self._waiting_by_rollout[request.group.rollout.rollout_id] -= 1
            return request
        return None

    def _give_back(self, request: Request) -> None:
        rid = request.group.rollout.rollout_id
        self._waiting_by_rollout[rid] = self._waiting_by_rollout.get(rid, 0) + 1
        self._unpop(request)

    # ------------------------------------------------------------------ assignment
    def assign(self, engines: list[EngineView]) -> list[Assignment]:
        if not engines:
            return []
        budgets = _Budgets(engines, self.config.kv_admission_fraction)
        max_model_len = min(e.capabilities.max_model_len for e in engines)
        out: list[Assignment] = []
        skipped: list[Request] = []
        while len(skipped) < MAX_SKIPS and (request := self._next()) is not None:
            budget = min(self.config.chunk_size_tokens, request.remaining_tokens,
                         max_model_len - request.context_tokens)
            engine = self._place(request, budget, budgets) if budget >= 1 else None
            if engine is None:
                # Too big for any engine's free KV right now: keep its place and let
                # smaller requests behind it fill the room (backfill), a bounded number.
                skipped.append(request)
                continue
            budgets.take(engine, request.context_tokens + budget)
            self._group_engines.setdefault(request.group.group_id, set()).add(engine.engine_id)
            self._dispatched(request)
            out.append(Assignment(request, engine.engine_id, budget))
        for request in reversed(skipped):
            self._give_back(request)
        return out

    def _place(self, request: Request, budget: int, budgets: _Budgets) -> EngineView | None:
        need = request.context_tokens + budget
        fitting = [e for e in budgets.engines if budgets.fits(e, need)]
        if not fitting:
            return None
        if self.config.placement == "migrate" and request.engine_history:
            # Every chunk on another engine than the last one (tests, pool benchmarks).
            fitting = [e for e in fitting if e.engine_id != request.engine_history[-1]] or fitting
        if budgets.spread() <= self.config.imbalance_threshold:
            return min(fitting, key=lambda e: (-self._cached_prefix(request, e), budgets.inflight[e.engine_id],
                                               e.engine_id))
        return min(fitting, key=lambda e: (budgets.inflight[e.engine_id], e.engine_id))

    def _cached_prefix(self, request: Request, engine: EngineView) -> int:
        if request.engine_history and request.engine_history[-1] == engine.engine_id:
            return request.context_tokens
        if engine.engine_id in self._group_engines.get(request.group.group_id, ()):
            return len(request.prompt_token_ids)
        return 0

    def _dispatched(self, request: Request) -> None:
        """Hook for subclasses that count service (starvation guard)."""

    # ------------------------------------------------------------------ queue (subclasses)
    def _push(self, request: Request) -> None:
        raise NotImplementedError

    def _pop(self) -> Request | None:
        raise NotImplementedError

    def _unpop(self, request: Request) -> None:
        raise NotImplementedError
