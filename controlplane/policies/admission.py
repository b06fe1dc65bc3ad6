"""KV-budget admission for the chunked policies (the paper's SELECTINSTANCE test).

Owns each engine's *reservation*: the tokens that its in-flight chunks may occupy by the
time they finish — what the policy reserves for each chunk (at most context + chunk
budget), rounded up to KV blocks. An engine takes another chunk only while its
reservation plus that chunk stays within ``kv_admission_fraction`` of its KV capacity. An
idle engine takes any single chunk: a request larger than the budget then runs alone
instead of waiting forever.

A group's prompt is held once per engine. The engines' prefix caches share the full KV
blocks of a prompt between the group's samples running together, so a chunk's
reservation is split into its *own* part and its group's *shared* part (the prompt's full
blocks), and an engine's total counts the shared part once for every group with a chunk
in flight there. Counting the prompt in every sibling's reservation over-reserved the KV of
a G = 16 group with a 100-token prompt by 1,500 tokens (docs/benchmarks.md).

Reservations are kept across assignment rounds. A chunk's reservation is fixed from
dispatch to finish (its context and budget change only when it returns), so an
engine's total changes only by the tasks that entered or left its in-flight set since
the last round; re-summing every chunk of every engine on every round was most of a
paper-scale simulation's time. A round's ``Budgets`` start from ``Reservations.snapshot``,
which re-reads only the engines whose in-flight map moved (their versions compared with
those last read, in one list comparison).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress, repeat
from operator import attrgetter, le, ne
from statistics import NormalDist

from seer.controlplane.state import EngineView, Request
from seer.stepcost import CostModel

UNBOUNDED = 1 << 62  # the room of an idle engine
_VERSION = attrgetter("inflight.version")
_CAPABILITIES = attrgetter("capabilities")
_BLOCK_SIZE = attrgetter("capabilities.block_size")


def blocks(tokens: int, engine: EngineView) -> int:
    """``tokens`` rounded up to the engine's KV blocks."""
    block = max(1, engine.capabilities.block_size)
    return -(-tokens // block) * block


def worst_case(request: Request, engine: EngineView) -> int:
    """The reservation of a chunk in flight that no ``add`` recorded (an engine read afresh):
    its context + budget, rounded up to blocks."""
    return blocks(request.context_tokens + request.chunk_max_tokens, engine)


def shared_tokens(request: Request, block_size: int) -> int:
    """The KV a chunk of ``request`` shares with its running siblings on an engine: its
    prompt's full blocks (an engine caches and shares whole blocks only)."""
    block = max(1, block_size)
    return len(request.prompt_token_ids) // block * block


class _Held:
    """One engine's in-flight reservations: each request's own part and, once per group
    with a chunk in flight, the group's shared prompt blocks. ``holders`` (shared by every
    engine's ``_Held``) maps a group to the engines where it has chunks in flight."""

    __slots__ = ("view", "own", "groups", "total", "block", "holders")

    def __init__(self, view: EngineView, holders: dict[object, set[int]]) -> None:
        self.view = view
        self.own: dict[Request, int] = {}  # request -> its reservation beyond the shared prompt
        self.groups: dict[object, int] = {}  # group -> its chunks in flight here
        self.total = 0
        self.block = max(1, view.capabilities.block_size) if view.capabilities is not None else 1
        self.holders = holders

    def enter(self, request: Request, reserved: int) -> None:
        """A chunk reserving ``reserved`` tokens (its shared prompt included) is in flight here."""
        if request in self.own:  # left and came back between two reads: one entry, not two
            self.leave(request)
        shared = shared_tokens(request, self.block)
        group = request.group
        count = self.groups.get(group, 0)
        self.groups[group] = count + 1
        own = max(0, reserved - shared)
        self.own[request] = own
        self.total += own
        if not count:
            self.total += shared
            self.holders.setdefault(group, set()).add(self.view.engine_id)

    def leave(self, request: Request) -> None:
        self.total -= self.own.pop(request)
        group = request.group
        count = self.groups[group] - 1
        if count:
            self.groups[group] = count
        else:
            del self.groups[group]
            self.total -= shared_tokens(request, self.block)
            self._not_holding(group)

    def clear(self) -> None:
        """The engine left: it holds no group any more."""
        for group in self.groups:
            self._not_holding(group)

    def _not_holding(self, group: object) -> None:
        engines = self.holders.get(group)
        if engines is not None:
            engines.discard(self.view.engine_id)
            if not engines:
                del self.holders[group]


_NONE: frozenset[int] = frozenset()
MARGIN_BOUND = 2.0  # the admission margin stays within +-2 standard deviations of an engine's total
_NORMAL = NormalDist()


def overflow_odds(cost: CostModel, batch: float, context: float, use: float) -> float:
    """The chance of overflowing an engine's KV that admission should accept: the critical
    ratio ``g / (g + h)`` of a newsvendor. Reserving KV for a chunk's end is a bet on how
    much of it the chunk will use:

    * ``g``, a reserved token left unused: the engine runs a sequence fewer for the chunk's
      steps, and each step's fixed cost ``a`` is shared by one sequence fewer. Per token of
      reservation that is ``(a / batch) * (use / (context + use))`` seconds.
    * ``h``, a token of overflow: vLLM preempts a sequence and later recomputes its whole
      context to make room for a chunk's growth, ``p * context / use`` seconds per token.

    Where preemption is cheap next to the step's fixed cost (this CPU: a re-prefill costs a
    few steps, a step ~0.13 s whatever the batch) the odds are high and admission packs
    engines like per-sample routing does; where it is dear (long contexts on a GPU) they are
    low and admission keeps its margin."""
    batch, context, use = max(1.0, batch), max(1.0, context), max(1.0, use)
    g = cost.a / batch * use / (context + use)
    h = cost.p * context / use
    return g / (g + h) if g + h > 0 else 0.5


def admission_margin(odds: float) -> float:
    """The margin, in standard deviations of an engine's total use, that accepts
    overflowing with probability ``odds`` (negative: admit beyond the expected use)."""
    odds = min(max(odds, 1e-6), 1 - 1e-6)
    return max(-MARGIN_BOUND, min(MARGIN_BOUND, _NORMAL.inv_cdf(1.0 - odds)))


def steady_odds(margin: float, step: float) -> tuple[float, float]:
    """The odds ``(lo, hi)`` between which ``admission_margin`` stays within ``step`` of
    ``margin`` (``abs(admission_margin(odds) - margin) <= step`` at both ends, and the
    margin falls as the odds rise, so everywhere between); ``(1.0, 0.0)``, an empty
    interval, if no odds give such a margin. A policy that moves its margin only by more
    than ``step`` tests its odds against these instead of taking ``inv_cdf`` every round.
    Found by bisection on the very test, so the ends agree with it to the last bit."""
    def steady(odds: float) -> bool:
        return abs(admission_margin(odds) - margin) <= step

    inside = 1.0 - _NORMAL.cdf(max(-MARGIN_BOUND, min(MARGIN_BOUND, margin)))
    if not steady(inside):
        return 1.0, 0.0
    return (0.0 if steady(0.0) else _edge(steady, inside, 0.0),
            1.0 if steady(1.0) else _edge(steady, inside, 1.0))


def _edge(steady: Callable[[float], bool], inside: float, outside: float) -> float:
    """The last point from ``inside`` (steady) towards ``outside`` (not) that is steady."""
    for _ in range(80):
        middle = (inside + outside) / 2
        if middle in (inside, outside):
            break
        if steady(middle):
            inside = middle
        else:
            outside = middle
    return inside


class Reservations:
    """Per-engine reserved tokens, updated by difference each time they are read. The
    requests whose chunks left an engine since (finished, returned, failed or aborted)
    collect in ``departed`` for the policy to look at and clear. Chunks are recorded when
    the policy assigns them (``add``), so one that starts and ends between two reads is
    still seen leaving."""

    def __init__(self) -> None:
        # engine_id -> its reservations (``_Held``: the view it was computed for, own parts, groups, total)
        self._by_engine: dict[int, _Held] = {}
        self._holders: dict[object, set[int]] = {}  # group -> engines where it has chunks in flight
        # engine_id -> its in-flight map's ``version`` when last read (``state.Inflight``
        # counts every change): an unchanged version means an unchanged set, and the engine
        # is skipped in O(1).
        self._fingerprint: dict[int, int] = {}
        # engine_id -> its version when last read, and the requests ``add`` gave it since:
        # what ``_replay`` needs to apply only the changes (``_fingerprint`` is dropped by ``add``).
        self._read: dict[int, int] = {}
        self._added: dict[int, list[Request]] = {}
        self.departed: list[Request] = []
        self._capacity_key: tuple | None = None
        self._capacity: dict[int, int] = {}
        self.largest_capacity = 0  # the most tokens admission may reserve on one engine (0: none read yet)
        self.max_model_len = 0  # the shortest max_model_len of the engines of ``capacities``
        self.block_size: int | None = None  # the engines' one block size (None: they differ)
        # ``snapshot``'s engines (with their capabilities and the fraction), their free
        # admission tokens in the engines' order, their in-flight counts keyed in that order,
        # and the in-flight versions they were read at (``add`` marks its engine's unread: -1).
        self._engines: list[EngineView] = []
        self._fraction: float | None = None
        self._caps: list[object] = []
        self.position: dict[int, int] = {}  # engine id -> its index in ``snapshot``'s engines
        self._free: list[int] = []
        self._counts: dict[int, int] = {}
        self.idle = 0  # engines of ``_counts`` with no chunk in flight (``Budgets.take`` keeps it too)
        self.num_inflight = 0  # the sum of ``_counts``, kept the same way (read every round: ``context``'s margin)
        self._read_versions: list[int] = []

    def reserved(self, engine: EngineView) -> int:
        """The engine's reserved tokens now."""
        entry = self._by_engine.get(engine.engine_id)
        current = engine.inflight
        fingerprint = current.version
        if entry is not None and entry.view is engine and self._fingerprint.get(engine.engine_id) == fingerprint:
            return entry.total
        self._fingerprint[engine.engine_id] = fingerprint
        since = self._read.get(engine.engine_id)
        self._read[engine.engine_id] = fingerprint
        ours = self._added.pop(engine.engine_id, [])
        if entry is None or entry.view is not engine:  # new, or rejoined as a new view
            if entry is not None:
                self.departed.extend(entry.own)
                entry.clear()
            entry = self._by_engine[engine.engine_id] = _Held(engine, self._holders)
            for request in current.values():
                entry.enter(request, worst_case(request, engine))
            return entry.total
        departed = self._replay(current, entry.own, since, ours)
        if departed is not None:  # the usual round: at most one chunk left, the rest ours
            for request in departed:
                entry.leave(request)
                self.departed.append(request)
            return entry.total
        now = set(current.values())
        if len(now) != len(entry.own) or not now.issuperset(entry.own):
            for request in [r for r in entry.own if r not in now]:
                entry.leave(request)
                self.departed.append(request)
            for request in now.difference(entry.own):
                entry.enter(request, worst_case(request, engine))
        return entry.total

    @staticmethod
    def _replay(current: object, held: dict[Request, int], since: int | None, ours: list[Request]) -> list[Request] | None:
        """The requests that left an engine since version ``since``, from its change log,
        when that gives exactly what the full comparison would: every request that arrived
        meanwhile is held (assigned through ``add``), everything ``add`` gave it since
        (``ours``) did arrive, and at most one held request left (several would be reported
        in ``held``'s order by the rescan). None: rescan."""
        log = current.changes_since(since) if since is not None else None
        if log is None:
            return None
        if len(log) == 1:  # the usual read: one chunk arrived (ours) or one left
            added, request = log[0]
            if added:
                return [] if request in held and all(r is request for r in ours) else None
            if ours:
                return None
            return [request] if added is False and request in held else []
        last: dict[Request, bool] = {}
        for added, request in log:
            if added is not None:
                last[request] = added
        for request in ours:
            if not last.get(request):
                return None  # assigned but not (or no longer) in flight: the rescan reports it
        left = []
        for request, added in last.items():
            if added:
                if request not in held:
                    return None
            elif request in held:
                left.append(request)
        return left if len(left) <= 1 else None

    def snapshot(self, engines: list[EngineView], fraction: float) -> tuple[list[int], dict[int, int]]:
        """(free admission tokens: capacity - reserved, in the engines' order; chunks in
        flight, keyed by engine id in that order) of every engine. Only the engines whose
        in-flight map changed since they were last read (a few of them, each round) are read
        again: their in-flight versions are compared with what was read, all at once.

        Not copies: the round (``Budgets.take``) changes them in place, and ``add``, which
        every take calls first, marks that engine unread, so the next snapshot reads it
        again from its in-flight map."""
        if engines != self._engines or fraction != self._fraction or list(map(_CAPABILITIES, engines)) != self._caps:
            # Other engines (views compared by identity, what they said by value): read
            # every one, then refresh capacities (which forgets engines that left), so
            # their departures are reported in that order.
            totals = [self.reserved(e) for e in engines]
            capacity = self.capacities(engines, fraction)
            self._engines, self._fraction, self._caps = list(engines), fraction, list(map(_CAPABILITIES, engines))
            self.position = {e.engine_id: i for i, e in enumerate(engines)}
            self._free = [capacity[e.engine_id] - total for e, total in zip(engines, totals)]
            self._counts = {e.engine_id: len(e.inflight) for e in engines}
            self.idle = sum(1 for count in self._counts.values() if not count)
            self.num_inflight = sum(self._counts.values())
            self._read_versions = list(map(_VERSION, engines))
        else:
            versions = list(map(_VERSION, engines))
            read = self._read_versions
            if versions != read:
                for engine in compress(engines, map(ne, versions, read)):
                    engine_id = engine.engine_id
                    self._free[self.position[engine_id]] = self._capacity[engine_id] - self.reserved(engine)
                    count = len(engine.inflight)
                    self.idle += (not count) - (not self._counts[engine_id])
                    self.num_inflight += count - self._counts[engine_id]
                    self._counts[engine_id] = count
                self._read_versions = versions
        return self._free, self._counts

    def capacities(self, engines: list[EngineView], fraction: float) -> dict[int, int]:
        """engine id -> tokens admission may reserve on it, kept while the engines are the same."""
        # The views and what they said in their hellos (a view re-admitted keeps its identity
        # but may bring other capabilities; compared by value).
        key = (fraction, list(map(id, engines)), list(map(_CAPABILITIES, engines)))
        if self._capacity_key != key:
            self._capacity_key = key
            # Forget engines that left (lost or stopped): their entries would keep their last
            # in-flight requests, and through them whole rollouts, alive for good.
            live = {e.engine_id for e in engines}
            for engine_id in [k for k in self._by_engine if k not in live]:
                gone = self._by_engine.pop(engine_id)
                gone.clear()
                self.departed.extend(gone.own)
                self._fingerprint.pop(engine_id, None)
                self._read.pop(engine_id, None)
                self._added.pop(engine_id, None)
            self._capacity = {e.engine_id: int(e.capabilities.kv_capacity_tokens * fraction) for e in engines}
            self.largest_capacity = max(self._capacity.values(), default=0)
            self.max_model_len = min((e.capabilities.max_model_len for e in engines), default=0)
            sizes = set(map(_BLOCK_SIZE, engines))
            self.block_size = max(1, sizes.pop()) if len(sizes) == 1 else None
        return self._capacity

    def add(self, engine: EngineView, request: Request, reserved: int) -> int:
        """The policy just assigned ``request`` a chunk on ``engine`` reserving ``reserved``
        tokens, its shared prompt included (the engine's total counts that once per group).
        Returns what the engine's total grew by."""
        entry = self._by_engine[engine.engine_id]
        before = entry.total
        self._fingerprint.pop(engine.engine_id, None)  # its set changes: read it again next time
        position = self.position.get(engine.engine_id)
        if position is not None:
            self._read_versions[position] = -1
        self._added.setdefault(engine.engine_id, []).append(request)
        entry.enter(request, reserved)
        return entry.total - before

    def compact(self) -> None:
        """Re-make the per-group table at its current size (a dict keeps the table it grew to)."""
        self._holders = dict(self._holders)
        for entry in self._by_engine.values():
            entry.holders = self._holders  # shared by every engine's entry

    def capacities_now(self) -> list[int]:
        """Every engine's admission capacity as last read (``capacities``)."""
        return list(self._capacity.values())

    def totals_now(self) -> list[int]:
        """Every engine's reserved tokens as last read or added."""
        return [entry.total for entry in self._by_engine.values()]

    def reserved_by(self, engine_id: int) -> int:
        """The engine's reserved tokens as last read or added (0 if never)."""
        entry = self._by_engine.get(engine_id)
        return entry.total if entry is not None else 0

    def group_holders(self, group: object) -> set[int]:
        """The engines where ``group`` has a chunk in flight (its prompt's blocks reserved there)."""
        return self._holders.get(group, _NONE)


class Budgets:
    """Free admission tokens and in-flight counts of every live engine during one assignment round."""

    def __init__(self, engines: list[EngineView], fraction: float, reservations: Reservations) -> None:
        self.engines = engines
        self._reservations = reservations
        # free: capacity - reserved, in the engines' order; inflight: keyed by id in that order.
        self.free, self.inflight = reservations.snapshot(engines, fraction)
        self._position = reservations.position
        # One block size for every engine (the usual case): ``fitting`` runs without a Python loop.
        self._block = reservations.block_size
        self.room = self._room()

    def fitting(self, tokens: int, request: Request | None = None) -> list[EngineView]:
        """The engines that admit a chunk reserving ``tokens``, in order: those whose free
        tokens hold it rounded up to their blocks, and idle ones (an idle engine takes any
        one chunk: refusing would wait forever). With ``request``, an engine where its group
        has a chunk in flight holds its prompt's blocks already and needs only the rest. One
        pass, the per-decision cost of placement."""
        holders = self._reservations.group_holders(request.group) if request is not None else _NONE
        block = self._block
        if block is not None:
            tokens = -(-tokens // block) * block
            if not holders:
                if not self.some_idle:
                    return list(compress(self.engines, map(le, repeat(tokens), self.free)))
                return [e for e, free, num in zip(self.engines, self.free, self.inflight.values())
                        if tokens <= free or not num]
            if self.some_idle:
                shared = shared_tokens(request, block)  # type: ignore[arg-type]
                return [e for e, free, num in zip(self.engines, self.free, self.inflight.values())
                        if tokens - (shared if e.engine_id in holders else 0) <= free or not num]
            return self._fitting_beside(tokens, tokens - shared_tokens(request, block), holders)  # type: ignore[arg-type]
        return [e for e, free, num in zip(self.engines, self.free, self.inflight.values())
                if not num or blocks(tokens, e) - (shared_tokens(request, e.capabilities.block_size)  # type: ignore[arg-type]
                                                   if e.engine_id in holders else 0) <= free]

    def _fitting_beside(self, tokens: int, beside: int, holders: set[int]) -> list[EngineView]:
        """``fitting`` with no idle engine, for a request whose group holds its prompt on
        ``holders``: the engines with ``beside`` (``tokens`` less the prompt) free, found in
        one pass in C (in a full cluster: the engine a chunk just left), less those of them
        that hold no prompt of the group and lack ``tokens``. A Python pass over every
        engine here was the per-decision cost of placement."""
        free, engines = self.free, self.engines
        fit = compress(engines, map(le, repeat(beside), free))
        if beside >= tokens:
            return list(fit)
        return [e for e in fit if e.engine_id in holders or tokens <= free[self._position[e.engine_id]]]

    def fits_somewhere(self, tokens: int, request: Request) -> bool:
        """Would ``fitting(tokens, request)`` find an engine? O(1) unless the chunk fits only
        where its group's prompt is held (then O(engines holding the group))."""
        if tokens <= self.room:
            return True
        holders = self._reservations.group_holders(request.group)
        if not holders or self._block is None:
            return False
        need = -(-tokens // self._block) * self._block - shared_tokens(request, self._block)
        if need > self.room:  # the room is the most any engine has free (none is idle here): no holder has it
            return False
        position, free = self._position, self.free
        return any(need <= free[position[e]] for e in holders if e in position)

    @property
    def some_idle(self) -> bool:
        """An engine has no chunk in flight: ``_room`` makes the room UNBOUNDED exactly then
        (an idle engine takes any one chunk)."""
        return self.room == UNBOUNDED

    def take(self, engine: EngineView, request: Request, tokens: int) -> None:
        engine_id = engine.engine_id
        grew = self._reservations.add(engine, request, blocks(tokens, engine))
        position = self._position[engine_id]
        free = self.free[position]
        self.free[position] = free - grew
        count = self.inflight[engine_id]
        self.inflight[engine_id] = count + 1
        self._reservations.num_inflight += 1
        if not count:
            self._reservations.idle -= 1
        if self.some_idle or free >= self.room:
            self.room = self._room()
        # else: this engine's free KV was below the room, and only it shrank: the room holds.

    @property
    def num_inflight(self) -> int:
        """Chunks in flight on all these engines: ``sum(inflight.values())``, kept as it changes."""
        return self._reservations.num_inflight

    def load(self) -> tuple[int, int]:
        """(in-flight chunks of the busiest engine, its spread over the least busy one)."""
        counts = self.inflight.values()
        busiest = max(counts)
        return busiest, busiest - min(counts)

    def _room(self) -> int:
        """The most tokens one engine could still take: a chunk needing more fits nowhere."""
        if self._reservations.idle:  # ``0 in self.inflight.values()``, counted as they change
            return UNBOUNDED
        return max(0, max(self.free, default=0))
