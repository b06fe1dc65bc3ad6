"""Placement by predicted drain time: which engine a chunk goes to when lengths are estimated.

Owns each engine's *expected work* — what its in-flight samples are expected still to
generate — and the rule that places a chunk where the engine is predicted to finish all of
its work first. Pure arithmetic over the step-cost model (``seer/stepcost.py``) and the
policy's length estimates; no I/O, no clock.

An engine that runs its samples side by side (continuous batching) takes as many steps
as its longest remaining sample needs, and each step costs ``a + b·B + c·S``. Summed over
the steps, its time to drain is

    T = a · L_max + b · W + c · X

with L_max its longest expected remaining sample, W the tokens all its samples are expected
still to generate and X the context each of those tokens attends to (a sample with context
C and x tokens to go adds ``x·C + x²/2``). When the KV budget, not the longest sample, sets
the number of steps, ``W / B`` (B the samples it runs at once) replaces L_max. A chunk goes
to the engine where T with it added, plus the seconds to bring its context there (nothing
where its KV is, the prompt's prefill where the group's prompt is not cached, the rest from
the host KV pool), is smallest. With the longest work placed first (``context``'s order),
that is the longest-processing-time rule with the engine's own economics: on a CPU, where a
step costs the same whatever the batch (a ≫ b), the engine holding the longest sample is
given less of the rest; counting chunks in flight instead put groups of long samples on
one engine and lost 3-6 % to per-sample routing (docs/benchmarks.md).

Without length estimates (``divided``), or with ``placement = "migrate"``, placement goes
by chunks in flight and cache affinity. While the spread of in-flight requests across engines is within a
tolerance, the engine with the longest cached prefix of the request wins (the engine
of its previous chunk holds its whole context; an engine that ran a sibling holds the
prompt); above it, the least-loaded engine. Ties go to fewer in-flight, then lower id.
The tolerance is ``imbalance_threshold`` (the paper's 32) or, on engines holding few
chunks, ``imbalance_fraction`` of the busiest engine's in-flight count: with 16 chunks
per engine a spread of 32 is never reached, and a continuation would go home to a
busy engine while another sat idle. Moving the KV of a migrated request (pool or
re-prefill) is the engines' business; through the pool it costs a fraction of a second
against the seconds a chunk decodes (docs/notes/context-scheduling.md, "Placement on small engines").
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection
from operator import attrgetter
from typing import TYPE_CHECKING

from seer.config import SchedulerConfig
from seer.controlplane.state import EngineView, Request
from seer.stepcost import CostModel

if TYPE_CHECKING:
    from seer.controlplane.policies.admission import Budgets

_ENGINE_ID = attrgetter("engine_id")


class EngineWork:
    """One engine's expected work in flight: the sums of T's terms and the longest sample."""

    __slots__ = ("tokens", "context_tokens", "_longest", "_count", "_known")

    def __init__(self) -> None:
        self.tokens = 0.0  # W: expected tokens still to generate
        self.context_tokens = 0.0  # X: Σ over those tokens of the context they attend to
        self._longest: list[tuple[float, int, Request]] = []  # max-heap of (-remaining, n, request)
        self._count = itertools.count()
        self._known: float | None = None  # the longest, while nothing entered or left since

    def add(self, request: Request, remaining: float, context: float) -> None:
        self.tokens += remaining
        self.context_tokens += remaining * context + remaining * remaining / 2
        heapq.heappush(self._longest, (-remaining, next(self._count), request))
        self._known = None

    def remove(self, remaining: float, context: float) -> None:
        self.tokens = max(0.0, self.tokens - remaining)
        self.context_tokens = max(0.0, self.context_tokens - (remaining * context + remaining * remaining / 2))
        self._known = None

    def longest(self, live: dict[Request, tuple[int, float, float]], engine_id: int) -> float:
        """The longest expected remaining sample still here (entries that left are dropped)."""
        if self._known is not None:
            return self._known
        heap = self._longest
        while heap:
            remaining, _, request = heap[0]
            entry = live.get(request)
            if entry is not None and entry[0] == engine_id and entry[1] == -remaining:
                self._known = -remaining
                return self._known
            heapq.heappop(heap)
        self._known = 0.0
        return 0.0

    def compact(self, live: dict[Request, tuple[int, float, float]], engine_id: int) -> None:
        """Drop every entry that left (``longest`` drops them only as they reach the top, and
        one kept request keeps its whole rollout alive)."""
        self._longest = [e for e in self._longest
                         if (entry := live.get(e[2])) is not None and entry[0] == engine_id and entry[1] == -e[0]]
        heapq.heapify(self._longest)
        self._known = None


class WorkLedger:
    """Every engine's expected work, kept as chunks are placed and leave."""

    def __init__(self) -> None:
        self._engines: dict[int, EngineWork] = {}
        self._of: dict[Request, tuple[int, float, float]] = {}  # request -> (engine, remaining, context)

    def entered(self, request: Request, engine_id: int, remaining: float) -> None:
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = self._engines[engine_id] = EngineWork()
        if request in self._of:
            self.left(request)
        context = float(request.context_tokens)
        self._of[request] = (engine_id, remaining, context)
        engine.add(request, remaining, context)

    def left(self, request: Request) -> None:
        entry = self._of.pop(request, None)
        if entry is not None:
            engine_id, remaining, context = entry
            self._engines[engine_id].remove(remaining, context)

    def forget(self, engine_id: int) -> None:
        """A lost engine is forgotten (its id never comes back): its work, and any entry of
        a request last placed there that has not left yet."""
        if self._engines.pop(engine_id, None) is not None:
            self._of = {r: entry for r, entry in self._of.items() if entry[0] != engine_id}

    def compact(self) -> None:
        """Let go of every request that left (after a rollout ended)."""
        for engine_id, engine in self._engines.items():
            engine.compact(self._of, engine_id)
        self._of = dict(self._of)  # at its current size (a dict keeps the table it grew to)

    def state(self, engine_id: int) -> tuple[float, float, float]:
        """(W, X, L_max) of the engine's work in flight."""
        engine = self._engines.get(engine_id)
        if engine is None:
            return 0.0, 0.0, 0.0
        return engine.tokens, engine.context_tokens, engine.longest(self._of, engine_id)

    def drain_s(self, cost: CostModel, engine_id: int, batch: int, remaining: float = 0.0,
                context: float = 0.0) -> float:
        """Predicted seconds for the engine to finish its work, with a sample of ``remaining``
        tokens to go and ``context`` tokens of context added."""
        tokens, attended, longest = self.state(engine_id)
        tokens += remaining
        attended += remaining * context + remaining * remaining / 2
        steps = max(longest, remaining, tokens / max(1, batch))
        return cost.a * steps + cost.b * tokens + cost.c * attended


def move_s(cost: CostModel, request: Request, engine: EngineView, prompt_cached: bool) -> float:
    """Seconds to bring ``request``'s context onto ``engine``: nothing on the engine of its
    last chunk; elsewhere the prompt's prefill unless the group's prompt is cached there,
    what the host KV pool holds of the rest (``request.kv_valid_tokens``: the daemon's pool
    table keeps it, the simulator its model of the pool) loaded from it and what it does not
    recomputed. An engine that cannot load from the pool (no KV geometry, not simulated)
    recomputes it all."""
    if request.engine_history and request.engine_history[-1] == engine.engine_id:
        return 0.0
    prompt = len(request.prompt_token_ids)
    context = request.context_tokens
    caps = engine.capabilities
    loads = caps is not None and (caps.kv_geometry is not None or caps.backend == "sim")
    pooled = min(request.kv_valid_tokens, context) if loads else 0
    have = max(pooled, prompt if prompt_cached else 0)
    loaded = max(0, pooled - (prompt if prompt_cached else 0))
    return cost.p * (context - have) + cost.pool_s_per_token * loaded


def by_affinity(request: Request, fitting: list[EngineView], budgets: Budgets, config: SchedulerConfig,
                holders: Collection[int]) -> EngineView | None:
    """Placement without length estimates (or with ``placement = "migrate"``): among
    ``fitting`` (the engines whose free KV admits the chunk), cache affinity while the
    in-flight spread is within the tolerance, the least-loaded engine above it (module
    docstring). ``holders``: engines that ran a sibling (they hold the group's prompt)."""
    if not fitting:
        return None
    if config.placement == "migrate" and request.engine_history:
        # Every chunk on another engine than the last one (tests, pool benchmarks).
        fitting = [e for e in fitting if e.engine_id != request.engine_history[-1]] or fitting
    if len(fitting) == 1:
        return fitting[0]
    inflight = budgets.inflight
    busiest, spread = budgets.load()
    if spread <= tolerance(config, busiest):
        # The longest cached prefix wins: the engine of the last chunk (the whole
        # context), then those holding the group's prompt, then the rest.
        last = request.engine_history[-1] if request.engine_history else None
        prompt = len(request.prompt_token_ids)
        if last is not None and request.context_tokens > prompt:
            for engine in fitting:
                if engine.engine_id == last:
                    return engine
        if prompt:
            if last is not None:  # its context is its prompt: it ranks with the holders
                holders = {*holders, last}
            cached = [e for e in fitting if e.engine_id in holders]
            if cached:
                fitting = cached
    return least_loaded(fitting, inflight)


def first_to_drain(request: Request, remaining: float, fitting: list[EngineView], inflight: dict[int, int],
                   holders: Collection[int], work: WorkLedger, cost: CostModel) -> EngineView:
    """The engine predicted to finish all its work first with ``request`` added, counting
    the seconds to bring its context there. The chunk's own terms (``b·x + c·x·(C + x/2)``)
    are the same everywhere and left out. Ties: fewer chunks in flight, then lower id."""
    a, b, c = cost.a, cost.b, cost.c
    last = request.engine_history[-1] if request.engine_history else None
    state = work.state
    # Seconds to move its context: by engine kind (its last engine, a holder of its prompt, other).
    to_holder = to_other = None
    best, best_key = fitting[0], None
    for engine in fitting:
        engine_id = engine.engine_id
        if engine_id == last:
            move = 0.0
        elif engine_id in holders:
            move = to_holder if to_holder is not None else (to_holder := move_s(cost, request, engine, True))
        else:
            move = to_other if to_other is not None else (to_other := move_s(cost, request, engine, False))
        tokens, attended, longest = state(engine_id)
        count = inflight[engine_id]
        steps = max(longest, remaining, (tokens + remaining) / (count + 1))
        key = (a * steps + b * tokens + c * attended + move, count, engine_id)
        if best_key is None or key < best_key:
            best, best_key = engine, key
    return best


def tolerance(config: SchedulerConfig, busiest: int) -> int:
    """The in-flight spread up to which cache affinity wins: ``imbalance_threshold`` (the
    paper's 32, sized for engines batching hundreds of sequences), or less on small engines
    -- a spread above ``imbalance_fraction`` of the busiest engine's in-flight chunks means
    the least-loaded engine has less than half the work and would sit idle while affinity
    queues its share elsewhere."""
    return min(config.imbalance_threshold, max(1, int(busiest * config.imbalance_fraction)))


def least_loaded(engines: list[EngineView], inflight: dict[int, int]) -> EngineView:
    """The engine with the fewest chunks in flight, ties to the lower id."""
    ids = list(map(_ENGINE_ID, engines))
    return engines[min(zip(map(inflight.__getitem__, ids), ids, range(len(ids))))[2]]
