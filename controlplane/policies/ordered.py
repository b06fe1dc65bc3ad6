"""The orders of the chunked policies.

* ``divided`` — Seer's divided rollout alone: waiting requests are served in arrival
  order (first come, first served), with chunking, admission and placement from
  ``ChunkedPolicy``.
* ``context`` — divided rollout + context-aware scheduling: the first request of every
  group is its *probe*; a probe's *first chunk* is served before everything else, so
  every group starts early and short groups reveal themselves. After that chunk the
  probe is ranked like its siblings (a probe that kept its priority on every chunk ran
  ahead of the rest and lengthened the tail: docs/benchmarks.md). Every request past
  its probe chunk is served by the highest 0.99 quantile of its remaining length first
  (``lengths.py``: the group's posterior from all its finished samples, conditioned on
  what the request has generated — the latest-start rule against a long outcome). Each
  chunk reserves its *expected* KV use plus its share of a margin on its engine's total
  (``_reserve``), and once the best request fits nowhere the room is backfilled with the
  smallest waiting requests. Every ``starvation_interval``-th dispatch goes to the waiting request of the
  group that has received the least service (generated tokens) so far. Ties: lower
  group index, then lower sample index (deterministic).
* ``oracle`` — longest *true* remaining length first, each chunk reserving exactly the
  KV it will reach (true lengths: a simulation's trace, or a daemon rollout's
  ``true_lengths`` recorded by an earlier seeded run, ``intake.py``): the densest schedule that never risks a preemption, the bar for ``context``.
* ``oracle-order`` — the first oracle: the same order with worst-case reservations.
* ``oracle-full`` — ``oracle`` admitting against each engine's whole KV, not
  ``kv_admission_fraction`` of it: exact reservations need no margin. Stronger than
  ``oracle`` where the KV budget binds, not where the critical path does.

Queues are heaps with lazy re-keying: an entry whose key grew while it waited (a
group's first sample finished below the max-length placeholder) is pushed back with its
current key when it reaches the top, so each round costs O(log n) per dispatch, not a
sort of everything. A key that *shrank* (a finished sample moved its group's estimate
up) would stay buried, so ``context`` re-indexes a group's waiting samples when one of its samples
finishes (it learns of finishes from the chunks that left the engines).
"""

from __future__ import annotations

import math
from statistics import NormalDist

from seer.config import SchedulerConfig
from seer.controlplane.policies.admission import Budgets, admission_margin, overflow_odds, steady_odds
from seer.controlplane.policies.base import register
from seer.controlplane.policies.chunked import ChunkedPolicy
from seer.controlplane.policies.queues import LazyHeap, is_live
from seer.controlplane.policies.tool_waits import ToolWaits
from seer.controlplane.policies.lengths import (CALIBRATION_STAGES, RANK_QUANTILE, RESERVE_Z, RolloutLengths,
                                                UseCalibration, chunk_use, remaining_quantile)
from seer.controlplane.prior import LengthPrior, prompt_key
from seer.controlplane.state import EngineView, Group, Request, RequestState, Rollout

GROUP_ORACLE_MIN_SD = 0.05  # ``oracle-group``: a group of equal lengths is still a distribution
STARVED = "starved"  # ``context``'s starvation guard heap, an index of its own (``_take``)
MARGIN_DECAY = 0.05  # weight of the latest chunk in the typical chunk's decayed means
MARGIN_STEP = 0.25  # the admission margin moves (and reservations are recomputed, O(n)) by more than this
# Heap keys are single ints packing what would be a tuple (first field in the high bits):
# a heap compares keys ~log n times per push and pop, and one int comparison is cheaper
# than a tuple's element by element (``benchmarks/sim_policy_speed.py``). The fields are
# bounded so the packing keeps the tuple's order: a sample index below 2**SAMPLE_BITS, a
# group index below 2**GROUP_BITS, a length below LENGTH_SPAN.
SAMPLE_BITS = 24
GROUP_BITS = 40
LENGTH_SPAN = 1 << 62  # a length field is stored as LENGTH_SPAN - length: longest first


def _caps(request: Request) -> tuple[int, int]:
    """(how far a trajectory's tokens after its prompt may run in all: its context budget;
    how far its current turn may take them: the turn's ``max_tokens`` within that budget)."""
    t = request.trajectory
    assert t is not None
    generated = len(request.generated_token_ids)
    return t.max_context_tokens - len(request.prompt_token_ids), generated + request.remaining_tokens


def _pack(first: int, group: Group, sample_index: int) -> int:
    """(first, group index, sample index) as one int with the same order."""
    return (first << GROUP_BITS | group.group_index) << SAMPLE_BITS | sample_index


@register
class DividedPolicy(ChunkedPolicy):
    """Arrival order (``ChunkedPolicy``'s FIFO)."""

    name = "divided"



def group_estimate(group: Group, request: Request) -> int:
    """L̂: the longest finished sample of the group, else the request's full budget."""
    finished = [r.num_generated_tokens for r in group.requests if r.state is RequestState.FINISHED
                and r.finish_reason != "abort"]
    return max(finished) if finished else request.sampling.max_tokens


def true_length(policy: str, request: Request) -> int:
    """``request``'s true output length, which the oracle policies order by."""
    if request.oracle_length is None:
        raise ValueError(f"the {policy} policy needs true output lengths (request {request.request_id} has "
                         "none); give it a simulation's trace or the rollout's true_lengths from an earlier seeded run")
    return request.oracle_length


class _HeapPolicy(ChunkedPolicy):
    """A ranked order (``queues.LazyHeap``): a subclass gives ``_key``."""

    ranked = True


@register
class ContextPolicy(_HeapPolicy):
    name = "context"
    uses_probes = True
    backfill_by_need = True
    takes_length_prior = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._num_dispatched = 0
        self._service: dict[Group, int] = {}  # tokens the group had generated at its last dispatch
        # The starvation guard's view of the same waiting requests: least service first.
        self._starved = LazyHeap(self._ticket, self._service_key)
        # group -> (num_finished, (mean, sd) of a new sample's log length): the posterior
        # changes only when the group gains a finished sample or the rollout's fit refreshes.
        self._estimates: dict[Group, tuple[int, tuple[float, float]]] = {}
        self._lengths: dict[str, tuple[Rollout, RolloutLengths]] = {}  # rollout id -> its length model
        # (group, generated) -> (posterior, ranking estimate, (mean, sd) of a full chunk's use,
        # mean of all it may still generate)
        self._estimate_cache: dict[tuple[Group, int], tuple[tuple[float, float], int, tuple[float, float], float]] = {}
        # The calibrations of expected use, one per stage of a sample (``_stage``), and each
        # chunk in flight's generated tokens at dispatch (its stage and its use on return).
        self.calibrations = self._fresh_calibrations()
        self._generated_at: dict[Request, int] = {}
        self.rank_quantile = RANK_QUANTILE
        # The margin of admission in standard deviations of an engine's total (``_margin``),
        # the overflow odds it stands for, and the typical chunk's (context, expected use).
        self.reserve_z = RESERVE_Z
        self.odds = 1.0 - NormalDist().cdf(RESERVE_Z)  # until a round chooses them from the step cost
        # (reserve_z, the odds between which the margin stays: ``admission.steady_odds``), or None.
        self._steady_odds: tuple[float, tuple[float, float]] | None = None
        self._chunk_shape = [0.0, 0.0]
        self.tool_waits = ToolWaits()  # trajectories' waits to come, and the seconds of a decode step (``_margin``)
        self._step_s = 0.0
        # Cross-iteration prior (beyond the paper; scheduler.length_prior).
        self.prior: LengthPrior | None = LengthPrior() if config.length_prior else None
        self._prompt_keys: dict[Group, bytes] = {}

    def _model(self, request: Request) -> RolloutLengths:
        rollout = request.group.rollout
        entry = self._lengths.get(rollout.rollout_id)
        if entry is None:
            # A trajectory's length runs over all its turns, to its context budget.
            budget = request.sampling.max_tokens if request.trajectory is None else _caps(request)[0]
            model = RolloutLengths(budget, len(rollout.groups), group_size=len(request.group.requests))
            entry = self._lengths[rollout.rollout_id] = (rollout, model)
        return entry[1]

    def _posterior(self, request: Request) -> tuple[float, float]:
        """(mean, sd) of a new sample's log length in ``request``'s group (``lengths.py``),
        recomputed only when the group gained a finished sample; with the prior and
        nothing finished, the prompt's past lengths stand in for the group's own."""
        g = request.group
        cached = self._estimates.get(g)
        if cached is None or cached[0] != g.num_finished:
            pseudo = None
            if not g.num_finished and self.prior is not None:
                past = self.prior.estimate(self._prompt_key(request))
                pseudo = math.log(max(1, past)) if past is not None else None
            cached = self._estimates[g] = (g.num_finished, self._model(request).group_posterior(g.group_index, pseudo))
        return cached[1]

    def _estimated(self, request: Request) -> tuple[tuple[float, float], int, tuple[float, float], float]:
        """(the group's posterior, the ranking estimate, (mean, sd) of a full next chunk's use,
        the mean of all it may still generate) of ``request``. Samples of a group at the same
        point (fresh siblings; siblings whose chunks end together) share them, so they are
        kept per (group, generated) until the group's next finish. Read ~10 times per
        decision (keys, reservations, placement): the posterior's cache is read inline.

        A trajectory's length is every token after its prompt, over all its turns (what
        its group's finished trajectories generated, tool and template tokens included):
        its ranking estimate and the mean still to come run to its context budget, while
        its next chunk can use no more than its turn allows (``_caps``)."""
        g = request.group
        known = self._estimates.get(g)
        posterior = known[1] if known is not None and known[0] == g.num_finished else self._posterior(request)
        generated = len(request.generated_token_ids)
        if request.trajectory is None:
            key = (g, generated)
        else:
            key = (g, generated, *_caps(request))
        cached = self._estimate_cache.get(key)
        if cached is None or cached[0] != posterior:
            mean, sd = posterior
            total, turn = (request.sampling.max_tokens,) * 2 if request.trajectory is None else _caps(request)
            cached = self._estimate_cache[key] = (
                posterior, remaining_quantile(mean, sd, generated, total, self.rank_quantile),
                chunk_use(mean, sd, generated, self._full_budget(request), turn),
                chunk_use(mean, sd, generated, total - generated, total)[0])
        return cached

    def _expected_work(self, request: Request) -> float:
        """The mean of what ``request`` may still generate (all its chunks), given its group's
        finished samples and what it has generated itself; a trajectory's over all its turns,
        for placement too (scoped to the turn, it lost on `search`: docs/benchmarks.md)."""
        return self._estimated(request)[3]

    def _estimate(self, request: Request) -> int:
        """The ranking estimate: a high quantile of what ``request`` may still generate,
        given its group's finished samples and what it has generated itself."""
        return self._estimated(request)[1]

    def _use(self, request: Request, budget: int) -> tuple[float, float]:
        """(mean, sd) of what a chunk of ``budget`` tokens will generate under the model."""
        if budget == self._full_budget(request):
            return self._estimated(request)[2]
        mean, sd = self._posterior(request)  # a budget cut by max_model_len: rare, not cached
        generated = request.num_generated_tokens
        return chunk_use(mean, sd, generated, budget, generated + request.remaining_tokens)

    def _reserve(self, request: Request, budget: int) -> int:
        """Admission: context + the chunk's *expected* use + its share of a margin on its
        engine's total, instead of context + budget (reserving the worst case halved the
        batch). An engine's total use is a sum of chunks: its mean is the sum of their
        means, its spread grows only as the square root of their number. A chunk that takes
        the share ``f = (context + mean) / capacity`` of an engine's KV comes with ``1 / f``
        like it, so RESERVE_Z standard deviations of their total shared out per chunk is
        ``RESERVE_Z * sd * sqrt(f)``: many small chunks pack close to their means, a few
        large ones keep a wide margin. Means are scaled by what returned chunks really used
        (``UseCalibration``). The engines' KV beyond ``kv_admission_fraction`` absorbs what is
        left (no preemption measured on the sweep, docs/benchmarks.md)."""
        mean, sd = self._use(request, budget)
        mean *= self.calibrations[self._stage(request.num_generated_tokens)].scale
        context = request.context_tokens
        capacity = self._reservations.largest_capacity
        share = min(1.0, (context + mean) / capacity) if capacity else 1.0
        # Whole samples (``_choose_chunking``): the expected demand fits the engines' KV, so no margin.
        margin = min(0.0, self.reserve_z) if self.whole(request) else self.reserve_z
        return context + min(budget, max(1, math.ceil(mean + margin * sd * math.sqrt(share))))

    def _prompt_key(self, request: Request) -> bytes:
        key = self._prompt_keys.get(request.group)
        if key is None:
            key = self._prompt_keys[request.group] = prompt_key(request.prompt_token_ids)
        return key

    def _key(self, request: Request) -> int:
        """(0, group index) for a probe's first chunk, ahead of everything else; else (1,
        longest ranking estimate first, group index, sample index). Packed (``_pack``). A
        trajectory's estimate adds its expected tool waits to come, as decode steps."""
        if self.uses_probes and request.sample_index == 0 and not request.generated_token_ids:
            return request.group.group_index  # below every packed key: those are >= 2**SAMPLE_BITS
        work = self._estimated(request)[1]
        if request.trajectory is not None and self._step_s > 0:
            work += int(self.tool_waits.wait_s(request) / self._step_s)
        return _pack(LENGTH_SPAN - work, request.group, request.sample_index)

    def turn_answered(self, request: Request) -> None:
        self.tool_waits.answered(request)

    def trajectory_ended(self, request: Request) -> None:
        self.tool_waits.ended(request)
        self._chunks_left([request])  # its length, for its group's model (its chunks came back while it waited)

    def _service_key(self, request: Request) -> int:
        """(least service first, group index, sample index), packed (``_pack``)."""
        return _pack(self._service.get(request.group, 0), request.group, request.sample_index)

    def _push(self, request: Request, ticket: int) -> None:
        super()._push(request, ticket)
        self._starved.push(request, ticket)

    def _unpop(self, request: Request, ticket: int, index: str | None) -> None:
        super()._unpop(request, ticket, index)
        if index in (None, STARVED):  # taken by the starvation guard, or a compaction dropped it
            self._starved.push(request, ticket)

    def _compact(self) -> None:
        super()._compact()
        # Per-group bookkeeping of finished or cancelled groups goes too.
        for table in (self._service, self._estimates, self._prompt_keys):
            for group in [g for g in table if g.done or g.rollout.cancelled]:
                del table[group]
        self.tool_waits.forget([g for g in self.tool_waits.turns if g.done or g.rollout.cancelled])
        for request in [r for r in self._generated_at if r.group.rollout.cancelled]:
            self.calibrations[self._stage(self._generated_at.pop(request))].dropped(request)
        for rid in [rid for rid, (r, _) in self._lengths.items() if r.done or r.cancelled]:
            del self._lengths[rid]
        self._estimate_cache = {k: v for k, v in self._estimate_cache.items()
                                if not (k[0].done or k[0].rollout.cancelled)}
        self._starved.compact()

    def _shrink(self) -> None:
        super()._shrink()
        self._service, self._estimates = dict(self._service), dict(self._estimates)
        self._generated_at, self._prompt_keys = dict(self._generated_at), dict(self._prompt_keys)

    def _starvation_turn(self) -> bool:
        interval = self.config.starvation_interval
        return bool(interval and self._num_dispatched and self._num_dispatched % interval == 0)

    def _peek(self) -> Request | None:
        return None if self._starvation_turn() else super()._peek()

    def _pop(self) -> Request | None:
        if self._starvation_turn():
            # Service only grows, so the lazy heap's stale keys are never too large.
            top = self._starved.pop()
            if top is not None:
                return self._take(top[2], STARVED) if is_live(top[2]) else self._take(top[2])
        return super()._pop()

    @staticmethod
    def _fresh_calibrations() -> list[UseCalibration]:
        """One calibration per stage of a sample (``_stage``), each at scale 1."""
        return [UseCalibration() for _ in range(CALIBRATION_STAGES)]

    def _stage(self, generated: int) -> int:
        """Which calibration a chunk starting at ``generated`` tokens belongs to: its ordinal
        among its sample's chunks, the last stage taking the rest. The model's error is not
        one factor for all chunks (measured: first chunks used 0.67x its expectation while
        third chunks, of samples that had outlived most of their group, used it in full;
        one scale cut the third chunks' reservations by a third, and 41 of them on one
        engine preempted: docs/notes/context-scheduling.md, "Calibrating by stage")."""
        return min(generated // self.config.chunk_size_tokens, CALIBRATION_STAGES - 1)

    def _admitted(self, request: Request, budget: int) -> None:
        generated = self._generated_at[request] = request.num_generated_tokens
        use = self._use(request, budget)[0]
        self.calibrations[self._stage(generated)].admitted(request, use)
        # The typical chunk, for the admission margin (``_margin``): decayed means.
        self._chunk_shape[0] += MARGIN_DECAY * (request.context_tokens - self._chunk_shape[0])
        self._chunk_shape[1] += MARGIN_DECAY * (use - self._chunk_shape[1])

    def _round_starts(self, engines: list[EngineView], budgets: Budgets) -> None:
        self._margin(engines, budgets)
        self._choose_chunking()

    def _chunking_changed(self) -> None:
        self._estimate_cache.clear()  # its chunk uses were for the old budgets
        super()._chunking_changed()

    def _margin(self, engines: list[EngineView], budgets: Budgets) -> None:
        """Set the admission margin from the step-cost model (``admission.overflow_odds``):
        the batch an engine runs is its share of all the work, up to what its KV holds of
        the typical chunk. Waiting requests' reservations are recomputed only when the
        margin moved by more than MARGIN_STEP (O(n), rare)."""
        context, use = self._chunk_shape
        if context <= 0:  # nothing dispatched yet: the rollout's prompts and the prior's use
            return
        capacity = self._reservations.largest_capacity
        work = len(self) + budgets.num_inflight  # the engines' chunks in flight, read this round
        batch = min(work / max(1, len(engines)), capacity / max(1.0, context + use)) if capacity else 1.0
        odds = self.odds = overflow_odds(self.cost, batch, context, use)
        self._step_s = self.cost.decode_step_s(batch, batch * (context + use))  # type: ignore[arg-type]
        steady = self._steady_odds
        if steady is None or steady[0] != self.reserve_z:
            steady = self._steady_odds = (self.reserve_z, steady_odds(self.reserve_z, MARGIN_STEP))
        low, high = steady[1]
        if low <= odds <= high:
            return  # the margin would move by MARGIN_STEP at most: it stays (no inv_cdf taken)
        margin = admission_margin(odds)
        if abs(margin - self.reserve_z) > MARGIN_STEP:
            self.reserve_z = margin
            self._renew_needs()

    def _calibrate(self, requests: list[Request]) -> None:
        for r in requests:
            generated = self._generated_at.pop(r, None)
            if generated is not None:
                self.calibrations[self._stage(generated)].returned(r, r.num_generated_tokens - generated)

    def _chunks_left(self, requests: list[Request]) -> None:
        self._calibrate(requests)
        if self._learn(requests):
            self._reindex()

    def _learn(self, requests: list[Request]) -> bool:
        """Feed the length model what these chunks showed: finished samples, and how far
        every sample got. True if the model's parameters changed (every key must be re-read)."""
        finished = []
        for r in requests:
            if r.finish_reason == "abort":
                continue
            done = r.state is RequestState.FINISHED
            model = self._model(r)
            model.progress(r.group.group_index, r.sample_index, r.num_generated_tokens, done)
            if done:
                finished.append(r)
                model.observe(r.group.group_index, r.num_generated_tokens)
                if self.prior is not None:
                    self.prior.observe(self._prompt_key(r), r.group.rollout.rollout_id, r.num_generated_tokens)
        refitted = False
        for _, model in self._lengths.values():
            refitted = model.refit() or refitted
        if refitted:
            return True
        # A finished sample moves its group's posterior, which can *lower* the heap key of
        # its waiting siblings; lazy re-keying only repairs keys that grew, so re-index them.
        for group in {r.group for r in finished}:
            before = self._estimates.get(group)
            if before is not None and before[0] == group.num_finished:
                continue
            for sibling in group.requests:
                if sibling.sample_index and sibling in self._ticket and is_live(sibling):
                    self._push(sibling, self._index(sibling))
        return False

    def _reindex(self) -> None:
        """The length model's parameters changed: every estimate, heap key and reservation
        is re-read (keys may have shrunk, which lazy re-keying does not repair). O(n)."""
        self._estimates.clear()
        self._estimate_cache.clear()
        self.calibrations = self._fresh_calibrations()  # they scaled the old parameters
        self._queue.rebuild((self._key(r), t, r) for r, t in self._ticket.items() if is_live(r))
        self._renew_needs()

    def _dispatched(self, request: Request) -> None:
        self._num_dispatched += 1
        self._service[request.group] = request.group.num_generated_tokens


@register
class OracleOrderPolicy(_HeapPolicy):
    """Longest true remaining length first, reserving each chunk's worst case (context +
    budget) like ``divided``: the first oracle, kept to compare with (docs/benchmarks.md)."""

    name = "oracle-order"

    def _remaining(self, request: Request) -> int:
        return true_length(self.name, request) - request.num_generated_tokens

    def _expected_work(self, request: Request) -> float:
        return min(self._remaining(request), request.remaining_tokens)

    def _key(self, request: Request) -> int:
        """(longest true remaining first, group index, sample index), packed (``_pack``)."""
        return _pack(LENGTH_SPAN - self._remaining(request), request.group, request.sample_index)


@register
class OraclePolicy(OracleOrderPolicy):
    """Longest true remaining length first, and each chunk reserves exactly the KV it will
    reach (context + what it will really generate in this chunk): as dense as a schedule
    can be that never risks a preemption."""

    name = "oracle"

    def _reserve(self, request: Request, budget: int) -> int:
        return request.context_tokens + min(budget, max(1, self._remaining(request)))


@register
class FullKVOraclePolicy(OraclePolicy):
    """``oracle`` admitting against each engine's whole KV. Its reservations are exact, so
    the ``kv_admission_fraction`` margin, kept for reservations that can be wrong, buys it
    nothing but sparser batches. Measured: +3.2-4.0 % over ``oracle`` on Qwen2-VL-72B and
    Kimi-K2, where the KV budget binds, and -1.3 % to +0.2 % on Moonlight, where the
    critical path of the longest samples does (docs/notes/context-scheduling.md, "A stronger oracle")."""

    name = "oracle-full"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.admission_fraction = 1.0


@register
class GroupOraclePolicy(ContextPolicy):
    """``context`` told each group's true length distribution from the start: the mean and
    spread of its samples' true log lengths stand in for what ``context`` learns from its
    probes and finished samples. Each sample's own length stays unknown (it is ranked and
    reserved from its group's distribution, conditioned on what it has generated, exactly
    as ``context`` does), and no probe goes first (there is nothing left to learn). So it
    is the best that learning *group* lengths can do with ``context``'s rules: the
    information-matched bar for ``context``, where ``oracle`` also knows every sample's
    own length (docs/notes/context-scheduling.md, "What group knowledge is worth")."""

    name = "oracle-group"
    uses_probes = False

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._true: dict[Group, tuple[float, float]] = {}

    def _posterior(self, request: Request) -> tuple[float, float]:
        g = request.group
        known = self._true.get(g)
        if known is None:
            logs = [math.log(max(1, true_length(self.name, r))) for r in g.requests]
            mean = sum(logs) / len(logs)
            spread = math.sqrt(sum((y - mean) ** 2 for y in logs) / max(1, len(logs) - 1))
            known = self._true[g] = (mean, max(GROUP_ORACLE_MIN_SD, spread))
        return known

    def _learn(self, requests: list[Request]) -> bool:
        return False  # it is told every group's distribution: nothing to learn, no key to repair

    def _compact(self) -> None:
        super()._compact()
        for group in [g for g in self._true if g.done or g.rollout.cancelled]:
            del self._true[group]
