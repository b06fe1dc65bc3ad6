"""Divided rollout's machinery, shared by every chunked policy: chunk budgets, KV-budget
admission and placement. Subclasses only decide the *order* of waiting requests.

Chunk budget: ``min(chunk_size_tokens, remaining budget, room left in max_model_len)``.
After each chunk the request returns to the queue until EOS or its budget.

Admission (``admission.py``, the paper's SELECTINSTANCE): an engine takes a chunk only
while the context + chunk budget of everything in flight on it fits in its KV budget. A
request that fits nowhere keeps its place in the order while up to ``MAX_SKIPS``
requests behind it are tried (backfill), then the round ends and the skipped requests
go back in order, to be tried again when a chunk returns. A round ends at once when
even the smallest waiting chunk fits nowhere (``_needs``: a lazy min-heap of every
waiting request's chunk size), so a full cluster costs O(1) per round, not
``MAX_SKIPS`` queue operations.

Waiting requests sit in queues (``queues.py``: the order, a FIFO or a lazy heap by
``_key``; the need heap; ``context``'s starvation guard) under *tickets*: each time a
request becomes waiting it gets a fresh one, and an entry is live only while its ticket
is the request's current one, so whichever queue serves it retires the others lazily.
A subclass writes only its order (``ranked`` and ``_key``) and its hooks.

Placement: ``placement.place``.
"""

from __future__ import annotations

import itertools
import sys

from seer.config import SchedulerConfig
from seer.controlplane.policies.admission import Budgets, Reservations
from seer.controlplane.policies.base import Assignment, Policy
from seer.controlplane.policies.placement import WorkLedger, by_affinity, first_to_drain
from seer.controlplane.policies.queues import FifoQueue, LazyHeap, is_live
from seer.controlplane.state import EngineView, Group, Request
from seer.stepcost import CostModel, StepCostFit

MAX_SKIPS = 64
WHOLE_BELOW = 0.9  # whole samples once the expected demand is below this share of the KV capacity
COMPACT_SLACK = 1024  # dead index entries tolerated beyond twice the live ones

# The index a request was taken from this round (``_take``); a skipped request goes back
# into that one only -- its entries in the other indexes never left, and pushing them
# again would duplicate them (the heaps would grow every round nothing fits).
QUEUE = "queue"  # the policy's own order (``_pop``)
NEEDS = "needs"  # backfill by need (``_next_smallest``)
KEPT = "kept"  # looked at in place (``_take_peeked`` with ``stay``): no entry left any index


class ChunkedPolicy(Policy):
    """Base of ``divided``, ``context`` and the oracles. A subclass gives its order: arrival
    order (the default), or ``ranked = True`` and ``_key(request)`` (smaller is served
    sooner; a key may only grow while the request waits, ``queues.LazyHeap``)."""

    chunked = True
    tells_order = True
    # False: a FIFO in arrival order; True: a lazy heap by ``_key``.
    ranked = False
    # Once the best-ranked request fits nowhere: False, try the next ones in rank order
    # (up to MAX_SKIPS); True, fill the room with the smallest waiting requests instead
    # (O(log n) each, and short work packs next to the long work that blocked).
    backfill_by_need = False

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        # The share of each engine's KV a round may reserve: a margin for reservations that
        # can be wrong (``kv_admission_fraction``); ``oracle-full``'s exact ones take it all.
        self.admission_fraction = config.kv_admission_fraction
        self._waiting_by_rollout: dict[str, int] = {}
        self._group_engines: dict[Group, set[int]] = {}  # engines that hold a group's prompt
        self._reservations = Reservations()
        self._tickets = itertools.count()
        self._ticket: dict[Request, int] = {}  # waiting request -> its current ticket
        self._needs = LazyHeap(self._ticket)  # (chunk need upper bound, ticket, request)
        # The policy's order, and the key each request taken from it this round had.
        self._queue: FifoQueue | LazyHeap = LazyHeap(self._ticket, self._key) if self.ranked else FifoQueue(
            self._ticket)
        self._popped_key: dict[Request, int | None] = {}
        self._need_of: dict[Request, int] = {}  # waiting request -> its next chunk's reservation
        # Requests taken from the queue this round (ticket, compaction generation, the index
        # taken from): a skipped one goes back with the same ticket, so its entries in the
        # other indexes stay live.
        self._taken: dict[Request, tuple[int, int, str]] = {}
        self._needs_dropped: set[Request] = set()
        self._stale_needs: list[tuple[int, Request]] = []  # (ticket, request) ``_smallest_need`` dropped  # taken this round, need entry dropped meanwhile
        self._generation = 0  # bumped by every compaction (which drops taken requests' entries)
        self._needs_capacity = 0  # the engines' largest admission capacity the needs were computed with
        # Every engine's expected work in flight (``_expected_work`` of its samples): placement
        # puts a chunk where the engine is predicted to drain first (``placement.py``).
        self._work = WorkLedger()
        # The fleet's step cost, fitted online by the scheduler (``seer/stepcost.py``); the
        # scheduler sets it. None (a policy built alone, in unit tests): the prior below.
        self.step_cost: StepCostFit | None = None  # type: ignore[assignment]  # (declared on Policy)
        self._prior_cost = CostModel.cpu_smollm2()
        # Rollouts sent as whole samples instead of chunks (``_choose_chunking``: rollout id
        # -> (rollout, whole)), and the expected KV footprint (context + expected work) of
        # every waiting request, summed.
        self._whole: dict[str, tuple[object, bool]] = {}
        self._whole_ids: set[str] = set()  # those of ``_whole`` that go whole (read per chunk: ``_full_budget``)
        self._footprint: dict[Request, float] = {}
        self._waiting_footprint = 0.0

    # ------------------------------------------------------------------ queue plumbing
    def __len__(self) -> int:
        return sum(self._waiting_by_rollout.values())

    def enqueue(self, request: Request) -> None:
        rid = request.group.rollout.rollout_id
        self._waiting_by_rollout[rid] = self._waiting_by_rollout.get(rid, 0) + 1
        self._push(request, self._index(request))

    def discard_rollout(self, rollout_id: str) -> None:
        # Entries stay in the queues and are skipped when popped (rollout.cancelled) until
        # ``rollout_ended`` drops them.
        self._waiting_by_rollout.pop(rollout_id, None)

    def rollout_ended(self, rollout_id: str, engines: list[EngineView]) -> None:
        # Every request of a rollout reaches every other through its groups, so one entry
        # left in a queue, a reservation or a per-group table keeps all of it alive: read
        # the engines (the cancelled chunks' reservations leave), then drop the dead entries
        # and the finished or cancelled groups' bookkeeping. O(waiting requests), once per rollout.
        self._whole.pop(rollout_id, None)
        self._whole_ids.discard(rollout_id)
        if engines:
            self._read_engines(engines)
        self._drop_dead()
        self._work.compact()
        self._reservations.compact()
        self._shrink()

    def engine_forgotten(self, engine_id: int) -> None:
        self._work.forget(engine_id)  # (``_reservations`` forgets engines as they leave)
        for holders in self._group_engines.values():
            holders.discard(engine_id)

    def _shrink(self) -> None:
        """Re-make the per-request and per-group tables at their current size: a dict keeps
        the table it grew to (a 200,000-sample rollout's: megabytes each) after its entries
        are deleted."""
        self._group_engines = dict(self._group_engines)
        tickets = dict(self._ticket)  # the queues hold this very map: shrink it in place
        self._ticket.clear()
        self._ticket.update(tickets)
        self._taken, self._footprint = dict(self._taken), dict(self._footprint)
        self._waiting_by_rollout = dict(self._waiting_by_rollout)

    def _read_engines(self, engines: list[EngineView]) -> Budgets:
        """The engines' free admission tokens now; the chunks that left them since the last
        read go to the work ledger and the length model."""
        budgets = Budgets(engines, self.admission_fraction, self._reservations)
        if self._reservations.largest_capacity != self._needs_capacity:
            self._renew_needs()
        if self._reservations.departed:
            for request in self._reservations.departed:
                self._work_left(request)
            self._chunks_left(self._reservations.departed)
            self._reservations.departed = []
        return budgets

    def _index(self, request: Request) -> int:
        if len(self._needs.entries) > 2 * len(self._ticket) + COMPACT_SLACK:
            self._drop_dead()
        ticket = self._ticket[request] = next(self._tickets)
        self._footprint_in(request)
        # context + min(chunk, remaining) bounds this request's next chunk from above and
        # equals it unless max_model_len cuts it; ``assign`` takes the min with that.
        need = self._need_of[request] = self._reserve(request, self._full_budget(request))
        self._needs.push(request, ticket, need)
        return ticket

    def _renew_needs(self) -> None:
        """Every waiting request's next reservation again, once the engines' capacity changed
        (engines joined or left): a reservation may depend on it (``context``'s does), and
        needs computed before any engine was known would hold for good. O(n), rare."""
        self._needs_capacity = self._reservations.largest_capacity
        self._need_of = {r: self._reserve(r, self._full_budget(r)) for r in self._ticket}
        self._needs.rebuild((need, self._ticket[r], r) for r, need in self._need_of.items())

    def _current(self, request: Request, ticket: int) -> bool:
        return self._ticket.get(request) == ticket

    def _take(self, request: Request, index: str = QUEUE) -> Request:
        """Retire a request's entries everywhere: it leaves the queue (until ``_give_back``).
        ``index``: the one whose entry was popped to take it."""
        self._taken[request] = (self._ticket.pop(request), self._generation, index)
        self._footprint_out(request)
        if not self._ticket:  # the queue ran dry: drop what finished rollouts left behind
            self._drop_dead()
        return request

    def _smallest_need(self) -> int | None:
        heap = self._needs.entries
        if heap and self._ticket.get(heap[0][2]) == heap[0][1]:  # the usual case, inlined: a current top
            return heap[0][0]
        dropped = self._stale_needs
        top = self._needs.settle(dropped)
        if dropped:
            for ticket, request in dropped:
                taken = self._taken.get(request)
                if taken is not None and taken[0] == ticket:  # taken this round: its give-back re-adds it
                    self._needs_dropped.add(request)
            dropped.clear()
        return top[0] if top is not None else None

    def _drop_dead(self) -> None:
        self._generation += 1
        for request in [r for r in self._ticket if r.group.rollout.cancelled]:
            del self._ticket[request]
            self._footprint_out(request)
        self._need_of = {r: n for r, n in self._need_of.items() if r in self._ticket}
        self._needs.compact()
        for group in [g for g in self._group_engines if g.done or g.rollout.cancelled]:
            del self._group_engines[group]
        self._compact()

    def _next(self) -> Request | None:
        while (request := self._pop()) is not None:
            if not is_live(request):
                continue  # a cancelled rollout's leftovers
            self._took(request)
            return request
        return None

    def _next_smallest(self) -> Request | None:
        """Backfill by need: the waiting request with the smallest next reservation."""
        if self._smallest_need() is None:
            return None
        request = self._needs.pop_top()[2]
        self._take(request, NEEDS)
        self._took(request)
        return request

    def _peek(self) -> Request | None:
        """The request ``_next`` would return, left in its place (dead entries above it
        dropped, grown keys re-keyed); None when that is not known so: the queue would run
        dry, or the top is a cancelled rollout's (``_next`` handles both). ``_take_peeked``
        takes it."""
        if len(self._ticket) < 2:
            return None  # taking the last one compacts the queues: leave that to ``_next``
        top = self._queue.settle()
        return top[2] if top is not None and is_live(top[2]) else None

    def _take_peeked(self, request: Request, stay: bool) -> None:
        """Take the request ``_peek`` returned, as ``_next`` would have; ``stay``: leave its
        queue entry in place (it is given back this round)."""
        self._popped_key[request] = self._queue.top()[0] if stay else self._queue.pop_top()[0]
        self._take(request, KEPT if stay else QUEUE)
        self._took(request)

    def _took(self, request: Request) -> None:
        rid = request.group.rollout.rollout_id
        self._waiting_by_rollout[rid] -= 1
        if not self._waiting_by_rollout[rid]:
            del self._waiting_by_rollout[rid]

    def _give_back(self, request: Request) -> None:
        """A request taken this round but not dispatched returns to its place, same ticket:
        the entry it was taken by goes back, or every entry if a compaction dropped them."""
        rid = request.group.rollout.rollout_id
        self._waiting_by_rollout[rid] = self._waiting_by_rollout.get(rid, 0) + 1
        ticket, generation, index = self._taken.pop(request)
        self._ticket[request] = ticket
        self._footprint_in(request)
        stale = generation != self._generation  # a compaction dropped its other entries
        if stale:
            self._need_of[request] = self._reserve(request, self._full_budget(request))
        if stale or index == NEEDS or request in self._needs_dropped:
            self._needs.push(request, ticket, self._need_of[request])
        self._unpop(request, ticket, None if stale else index)

    # ------------------------------------------------------------------ assignment
    def assign(self, engines: list[EngineView], limit: int = sys.maxsize) -> list[Assignment]:
        if not engines:
            return []
        budgets = self._read_engines(engines)
        self._round_starts(engines, budgets)
        max_model_len = self._reservations.max_model_len  # of these engines (``Budgets`` refreshed it)
        out: list[Assignment] = []
        skipped: list[Request] = []
        backfill_by_need = self.backfill_by_need
        while len(skipped) < MAX_SKIPS and len(out) < limit:
            smallest = self._smallest_need()
            if smallest is None:
                break
            if min(smallest, max_model_len) > budgets.room and not self._head_fits_shared(budgets, max_model_len):
                break  # not even the smallest chunk fits anywhere (nor the next one beside its group's prompt)
            by_need = backfill_by_need and bool(skipped)
            # A by-need policy's best request is looked at in place: in a full cluster it
            # fits nowhere most rounds, and popping it only to push it back cost O(log n).
            peeked = self._peek() if backfill_by_need and not by_need else None
            request = peeked if peeked is not None else self._next_smallest() if by_need else self._next()
            if request is None:
                break
            full = self._full_budget(request)  # the budget ``_index`` reserved for
            budget = min(full, max_model_len - request.context_tokens)
            need = self._need_of.get(request) if budget == full else None
            need = self._reserve(request, budget) if need is None else need
            fits_somewhere = 1 <= budget and budgets.fits_somewhere(need, request)
            if peeked is not None:
                self._take_peeked(request, stay=not fits_somewhere)
            engine = self._place(request, need, budgets) if fits_somewhere else None
            if engine is None:
                # Too big for any engine's free KV right now: keep its place and let
                # smaller requests behind it fill the room (backfill), a bounded number.
                skipped.append(request)
                continue
            budgets.take(engine, request, need)
            self._work_entered(request, engine.engine_id)
            self._need_of.pop(request, None)
            self._admitted(request, budget)
            self._group_engines.setdefault(request.group, set()).add(engine.engine_id)
            self._dispatched(request)
            out.append(Assignment(request, engine.engine_id, budget))
        for request in reversed(skipped):
            self._give_back(request)
        self._taken.clear()
        self._needs_dropped.clear()
        return out

    def _head_fits_shared(self, budgets: Budgets, max_model_len: int) -> bool:
        """Does the next request in order fit beside its group's prompt, on an engine where
        the group runs (needs count the prompt in full, so a round would stop although a
        sibling fits)? O(1) unless its group is held (then O(engines holding it))."""
        head = self._queue.head()  # what ``_next`` would serve, no index changed (None: not known so)
        if head is None or not self._reservations.group_holders(head.group):
            return False
        full = self._full_budget(head)
        budget = min(full, max_model_len - head.context_tokens)
        if budget < 1:
            return False
        need = self._need_of.get(head) if budget == full else None
        return budgets.fits_somewhere(self._reserve(head, budget) if need is None else need, head)

    def _full_budget(self, request: Request) -> int:
        """The budget of ``request``'s next chunk unless max_model_len cuts it."""
        if self._whole_ids and request.group.rollout.rollout_id in self._whole_ids:  # ``whole``, inlined: a hot path
            return request.remaining_tokens
        return min(self.config.chunk_size_tokens, request.remaining_tokens)

    def whole(self, request: Request) -> bool:
        """Does ``request``'s rollout go as whole samples (``_choose_chunking``)?"""
        return request.group.rollout.rollout_id in self._whole_ids

    @property
    def whole_samples(self) -> bool:
        """The latest rollout decided goes as whole samples (for status)."""
        return bool(self._whole) and next(reversed(self._whole.values()))[1]

    def _choose_chunking(self) -> None:
        """Chunks or whole samples, once per rollout, at its first round. Chunks bound what
        each admission adds to an engine's KV; when the engines' KV holds the expected
        footprint of every unfinished sample at once (what is reserved in flight plus the
        waiting samples' context + expected work, below WHOLE_BELOW of the capacity), no
        admission has anything to bound, and every chunk edge would only cost: on the real
        CPU engines a rollout that fitted ran 5 % slower in chunks than per-sample routing,
        the chunks of one wave ending together and their engines running near-empty steps
        while the control plane, on cores the engines saturate, dealt out the next ones
        (docs/notes/cost-aware-scheduling.md). Such a rollout goes as whole samples, as under
        per-sample routing. A rollout that does not fit keeps its chunks to its end, also
        once the rest fits: at paper scale the chunks' rebalancing in the tail is worth 1-3 %."""
        for rollout in [r for r in self._whole.values() if r[0].done or r[0].cancelled]:
            del self._whole[rollout[0].rollout_id]  # type: ignore[attr-defined]
            self._whole_ids.discard(rollout[0].rollout_id)  # type: ignore[attr-defined]
        new = [rid for rid in self._waiting_by_rollout if rid not in self._whole]
        if not new:
            return
        capacity = sum(self._reservations.capacities_now())
        if not capacity:
            return  # no engine read yet: decide once one is
        whole = (self.config.placement != "migrate" and self.config.chunking == "auto"
                 and self._waiting_footprint + sum(self._reservations.totals_now()) <= capacity * WHOLE_BELOW
                 and bool(self._footprint))
        rollouts = {r.group.rollout.rollout_id: r.group.rollout for r in self._ticket}
        for rid in new:
            if rid in rollouts:
                self._whole[rid] = (rollouts[rid], whole)
                if whole:
                    self._whole_ids.add(rid)
        if whole:
            self._chunking_changed()

    def _chunking_changed(self) -> None:
        """Hook: the chunk budgets changed (reservations computed for the old ones are stale)."""
        self._renew_needs()

    def _reserve(self, request: Request, budget: int) -> int:
        """KV tokens a chunk of ``budget`` tokens reserves on its engine until it returns:
        by default its whole worst case, context + budget (never a preemption)."""
        return request.context_tokens + budget

    @property
    def cost(self) -> CostModel:
        """The step-cost model decisions use: the scheduler's online fit, else the prior."""
        return self.step_cost.model if self.step_cost is not None else self._prior_cost

    @property
    def places_by_drain(self) -> bool:
        """Placement by predicted drain time (the policy estimates lengths), else by chunks in flight."""
        return type(self)._expected_work is not ChunkedPolicy._expected_work

    def _expected_work(self, request: Request) -> float | None:
        """The tokens ``request`` is expected still to generate, for balancing engines by
        their work; None (``divided``: no length model) balances by chunks in flight."""
        return None

    def _footprint_in(self, request: Request) -> None:
        work = self._expected_work(request)
        if work is not None:
            self._footprint_out(request)
            value = self._footprint[request] = request.context_tokens + work
            self._waiting_footprint += value

    def _footprint_out(self, request: Request) -> None:
        value = self._footprint.pop(request, None)
        if value is not None:
            self._waiting_footprint = max(0.0, self._waiting_footprint - value)

    def _work_entered(self, request: Request, engine_id: int) -> None:
        remaining = self._expected_work(request)
        if remaining is not None:
            self._work.entered(request, engine_id, remaining)

    def _work_left(self, request: Request) -> None:
        self._work.left(request)

    def _place(self, request: Request, need: int, budgets: Budgets) -> EngineView | None:
        """The engine for this chunk among those it fits on, or None: by predicted drain time
        where the policy estimates lengths, else by cache affinity (``placement.py``)."""
        fitting = budgets.fitting(need, request)
        holders = self._group_engines.get(request.group, ())
        if len(fitting) > 1 and self.config.placement != "migrate" and (
                remaining := self._expected_work(request)) is not None:
            return first_to_drain(request, remaining, fitting, budgets.inflight, holders, self._work, self.cost)
        return by_affinity(request, fitting, budgets, self.config, holders)

    def _admitted(self, request: Request, budget: int) -> None:
        """Hook: a chunk of ``budget`` tokens of ``request`` was admitted."""

    def _round_starts(self, engines: list[EngineView], budgets: Budgets) -> None:
        """Hook: an assignment round starts (what left the engines is already learned from;
        ``budgets``: their free KV and chunks in flight now)."""

    def _dispatched(self, request: Request) -> None:
        """Hook for subclasses that count service (starvation guard)."""

    def _chunks_left(self, requests: list[Request]) -> None:
        """Hook: these requests' chunks left their engines since the last round (finished
        samples among them may change what their group's waiting requests are worth)."""

    # ------------------------------------------------------------------ the order
    def _key(self, request: Request) -> int:
        """A ``ranked`` policy's order: smaller is served sooner; it may only grow while the
        request waits (``queues.LazyHeap``)."""
        raise NotImplementedError(f"{type(self).__qualname__} is ranked and must define _key")

    def _push(self, request: Request, ticket: int) -> None:
        self._queue.push(request, ticket)

    def _pop(self) -> Request | None:
        """The best current entry of the order, taken (``_take``), or None."""
        top = self._queue.pop()
        if top is None:
            return None
        request = top[2]
        if self.ranked and is_live(request):
            self._popped_key[request] = top[0]  # it goes back under this key if skipped
        return self._take(request)

    def _unpop(self, request: Request, ticket: int, index: str | None) -> None:
        """Put a request taken this round back at its place: its entry in ``index`` if that
        is one of this policy's own (``QUEUE``, or a subclass's), else nothing; ``None``: a
        compaction since it was taken dropped its entries, re-add it to every own index."""
        key = self._popped_key.pop(request, None) if self._popped_key else None
        if index in (None, QUEUE):
            self._queue.push_back(request, ticket, key)

    def _compact(self) -> None:
        """Drop dead entries (a subclass with indexes of its own compacts them too)."""
        self._queue.compact()
        self._popped_key = {r: k for r, k in self._popped_key.items() if r in self._taken}

    # ------------------------------------------------------------------ queue reading (KV tiers)
    def upcoming(self, k: int) -> list[Request]:
        """The next ``k`` waiting requests in the order ``assign`` takes them (if each fits),
        without taking them or touching the queue. Ignores what only ``assign`` decides
        (``context``'s starvation guard, backfill of requests that fit nowhere)."""
        return self._queue.upcoming(k)

    def needed_last(self, requests: list[Request]) -> list[Request]:
        """Those of ``requests`` that wait in this queue, the one this policy would serve
        *last* first (the inverse of ``upcoming``); O(m log m) for m requests, the queue
        untouched. The rest (running, placed but not sent, finished, another policy's)
        are left out. For the KV pool's disk tier: who gives up DRAM first."""
        waiting = [r for r in requests if r in self._ticket and is_live(r)]
        return sorted(waiting, key=self._serve_key, reverse=True)

    def _serve_key(self, request: Request) -> tuple:
        """Sort key of a waiting request in serve order (smaller: served sooner; a skipped
        request keeps its ticket, so arrival order is ticket order)."""
        return (self._key(request) if self.ranked else 0, self._ticket[request])
