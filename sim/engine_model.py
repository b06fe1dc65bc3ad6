"""A pure model of one continuously batching inference engine, in virtual seconds.

Owns one simulated engine's state: its running sequences (admission order), its
waiting queue, its KV accounting in tokens, the shared prompt prefixes in use and its
evictable prefix cache. No asyncio, no sockets, no wall clock: the caller passes the
virtual time in and gets durations back, so the paper-scale simulator
(``seer.sim.simulator``) and unit tests drive it alike.

Each iteration, like vLLM v1's scheduler: the running sequences must each have room
for one more token, otherwise the most recently admitted one is preempted (it loses its
KV, goes back to the front of the waiting queue and later re-prefills its whole
context); if nothing was preempted, waiting sequences are admitted first-come
first-served while their context fits; then the admitted ones are prefilled and every
running sequence decodes one token. A chunk ends with "length" when it has produced
its ``max_tokens`` and with "stop" when the request's true output runs out.

Prefix caching, as vLLM does it: a chunk may name a shared prefix (its group's prompt);
running sequences with the same prefix hold its KV once. When nothing running uses a
prefix, or a chunk finishes, its KV stays as evictable cache (least recently used goes
first when room is needed): a chunk continued on the same engine prefills only the
uncached tail, a sibling prefills only its own part. KV a chunk has in the global pool
(after a chunk elsewhere) is loaded at ``pool_s_per_token`` instead of recomputed.

Sequences are stored lazily (progress = engine steps since admission), so a step costs
O(1) whatever the batch, and a *segment* of identical steps (no admission, finish or
preemption in between) is committed at once: ``begin``/``cut``/``commit`` expose
segments to the simulator; ``step`` is the one-iteration API built on them.

Speculative decoding (optional, a ``SpecPlanner``): at the start of every segment the
planner gives each running sequence a draft length and a rate — expected tokens per step
(accepted drafts + 1), a real number — and the step then verifies B + K tokens:
``a + b·(B + K) + c·S`` plus the planner's drafting seconds. Progress becomes
rate × steps; sequences are rebased (their progress folded into their fields) at every
segment start so rates may change, and a segment lasts at most ``replan_steps`` so
acceptance that changes as siblings advance is re-read. Without a planner every rate is
the integer 1 and the arithmetic is exactly the plain engine's.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from seer.protocol import EngineLoad

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine iteration: ``a + b*B + c*sum(context of running)`` per decode
    step for a batch of B sequences, plus ``p`` per prefilled token and
    ``pool_s_per_token`` per token of KV loaded from the global KV pool."""

    a: float  # fixed cost of a decode step (weights read, launch, sampling)
    b: float  # per running sequence per step (its share of the GEMMs)
    c: float  # per context token of the running sequences per step (attention)
    p: float  # per prefilled (recomputed) token
    pool_s_per_token: float  # per token of KV pulled from the pool instead of recomputed

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.a + self.b * batch + self.c * context_tokens

    def verify_step_s(self, batch: int, num_drafts: int, context_tokens: float) -> float:
        """A step that verifies ``num_drafts`` drafted tokens on top of the batch's one
        token each: drafts cost what any scheduled token costs (``b``), and reading the
        KV is shared by a sequence's queries (``c`` stays per context token). An
        assumption: the linear model ignores the memory-bound plateau real GPUs have at
        small token counts, so it charges drafts more than a GPU would."""
        return self.a + self.b * (batch + num_drafts) + self.c * context_tokens

    @classmethod
    def cpu_smollm2(cls) -> CostModel:
        """Calibrated to this machine: one float32 vLLM engine, SmolLM2-135M, one core.

        Measured facts used:
          (1) 64 sequences x 128 tokens, 64-token prompts: 102 s wall (80 tok/s);
          (2) a single sequence decodes at ~10 tok/s (step ~0.1 s at context ~128);
          (3) re-prefilling 3,000 tokens cold took 4.65 s.
        Derivation:
          p = 4.65 s / 3000 = 1.55e-3 s per prefilled token.
          (1) is one prefill of 64 x 64 = 4096 tokens (6.35 s) plus 128 decode steps at
          B = 64 with contexts growing 64 -> 192, i.e. sum over steps of the batch's
          context = 1,044,480 token-steps:  128*(a + 64*b) + 1,044,480*c = 95.85 s.
          (2):  a + b + 128*c = 0.1 s.
          Two equations, three unknowns: the split between b and c is not measured, so
          c/b is set to SmolLM2's FLOP ratio: attention per context token per layer
          (2 * 2 * 9 heads * 64 = 2,304 FLOPs, x 30 layers = 69k) over the dense FLOPs
          per token (2 * 134.5M = 269M): c/b = 2.57e-4.
          Solving: b = 9.97e-3, c = 2.56e-6, a = 0.0897; rounded to a = 0.09, b = 0.01,
          c = 2.6e-6. Check: this model runs (1) in 102.5 s and (2) at 9.97 tok/s.
          (The "~1.0 s per step at B = 64" rule of thumb is the whole run's 102 s / 128
          steps = 0.8 s including prefill; the pure decode step here is ~0.75 s.)
        pool_s_per_token: SmolLM2's float32 KV is 30 layers x 2 x 3 heads x 64 x 4 B =
          46 KB per token; at the measured ~6 GB/s memory copy into shared memory that
          is ~7.7 us, rounded to 8e-6 s (an estimate; no pool exists yet to measure).
        """
        return cls(a=0.09, b=0.01, c=2.6e-6, p=1.55e-3, pool_s_per_token=8e-6)

    @classmethod
    def gpu_h800_like(cls) -> CostModel:
        """A large model on a GPU instance — ASSUMED numbers, not measurements.

        Chosen to give paper-like behaviour for a ~70B dense GQA model on one 8-GPU
        H800-class instance: a decode step of ~25 ms at small batch (a), +0.05 ms per
        running sequence (b: +12.8 ms at B = 256), +10 ns per context token of the batch
        (c: ~327 KB of bf16 KV per token read at ~30 TB/s of HBM), prefill at ~20k
        tokens/s (p), KV pulled from a pool over RDMA at ~2 us per token. Such an
        instance holds ~1M tokens of KV. Nothing here was measured; profile the real
        deployment before quoting absolute times.
        """
        return cls(a=0.025, b=5e-5, c=1e-8, p=5e-5, pool_s_per_token=2e-6)


class SpecRowInfo(NamedTuple):
    """A running sequence as the speculative-decoding planner sees it."""

    request_key: str
    prefix_key: str | None  # its group
    position: float  # output tokens the request has generated so far (all chunks)


class SpecPlanner(Protocol):
    """Chooses draft lengths for an engine's segment (``seer.sim.specdecode``)."""

    replan_steps: int  # longest segment before the plan is re-made

    def plan(self, engine_id: int, now: float, rows: Sequence[SpecRowInfo], cost: CostModel,
             context_tokens: float) -> tuple[list[float], int, float]:
        """(rate in tokens per step for each row, drafted tokens verified per step,
        drafting seconds per step)."""
        ...


class FinishedChunk(NamedTuple):
    task_id: int
    num_tokens: int  # generated by this chunk
    finish_reason: str  # "stop" | "length"


class SimEngineError(RuntimeError):
    """The engine cannot make progress (a sequence larger than its whole KV cache)."""


class _Seq:
    """One chunk on this engine. While running, its progress is ``engine._num_steps -
    start_step`` on top of the fields, which hold the values at ``start_step``."""

    __slots__ = ("task_id", "request_key", "prefix_key", "prefix_tokens", "context_tokens", "num_generated",
                 "max_tokens", "eos_in", "pooled_tokens", "start_step", "serial", "started_s", "rate", "load_s")

    def __init__(self, task_id: int, request_key: str, prefix_key: str | None, prefix_tokens: int,
                 context_tokens: int, max_tokens: int, eos_in: int, pooled_tokens: int) -> None:
        self.task_id = task_id
        self.request_key = request_key
        self.prefix_key = prefix_key  # shared prompt prefix (the group), or None
        self.prefix_tokens = prefix_tokens if prefix_key is not None else 0
        self.context_tokens = context_tokens
        self.num_generated = 0
        self.max_tokens = max_tokens
        self.eos_in = eos_in  # tokens until the request's true end (EOS included)
        self.pooled_tokens = pooled_tokens  # context tokens whose KV is in the global pool
        self.start_step = 0
        self.serial = 0  # identifies the current admission (stale finish-heap entries)
        self.started_s = -1.0  # first admission time (a preempted chunk keeps it)
        # Tokens per step; the integer 1 without speculative decoding. With it the token
        # fields above become real numbers (expected progress) until the chunk finishes.
        self.rate: float = 1
        self.load_s = 0.0  # waiting for its KV to arrive from a slower tier (sim/kv_tiers.py)

    def steps_to_finish(self) -> int:
        return min(self.max_tokens - self.num_generated, self.eos_in)

    def finish_steps(self) -> int:
        """Steps until this chunk's last token at its rate."""
        tokens = self.steps_to_finish()
        if self.rate == 1 and isinstance(tokens, int):
            return tokens
        return max(1, math.ceil(tokens / self.rate - 1e-9))

    @property
    def own_tokens(self) -> int:  # KV held alone (beyond the shared prefix), at start_step
        return self.context_tokens - self.prefix_tokens


class SimEngineModel:
    def __init__(self, engine_id: int, cost: CostModel, kv_capacity_tokens: int, *,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, spec: SpecPlanner | None = None) -> None:
        if kv_capacity_tokens < 2:
            raise ValueError(f"kv_capacity_tokens must be at least 2, got {kv_capacity_tokens}")
        self.engine_id = engine_id
        self.cost = cost
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_num_seqs = max_num_seqs
        self._running: dict[int, _Seq] = {}  # task_id -> seq, in admission order
        self._waiting: deque[_Seq] = deque()
        self._finish_heap: list[tuple[int, int, _Seq]] = []  # (finish step, serial, seq)
        self._num_steps = 0  # committed decode steps since the engine started
        self._running_tokens = 0  # KV held by running sequences and their prefixes, at ``_num_steps``
        self._prefixes: dict[str, list[int]] = {}  # prefix in use -> [tokens, running users]
        # Evictable KV, least recently used first: ("r", request) -> tokens beyond its
        # prefix, ("p", prefix) -> prefix tokens. Held KV is never in here.
        self._cache: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._cache_tokens = 0
        self._next_serial = 0
        # The open segment (see ``begin``): start time, prefill seconds, planned steps.
        self._segment: tuple[float, float, int] | None = None
        self.started_s: dict[int, float] = {}  # finished task_id -> first admission time
        self.busy_s = 0.0
        self.num_preemptions = self.num_steps = self.num_output_tokens = 0
        self.num_prefill_tokens = self.num_pool_tokens = 0  # recomputed / pulled from the pool
        self.spec = spec
        self._rate_sum: float = 0  # Σ rate of the running (only read with a planner)
        self._num_drafts = 0  # drafted tokens verified per step in the open segment
        self._draft_s = 0.0  # drafting seconds per step in the open segment
        self.num_seq_steps = self.num_draft_tokens = 0  # Σ batch and Σ drafts over committed steps

    # ------------------------------------------------------------------ queries
    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    @property
    def segment_open(self) -> bool:
        return self._segment is not None

    def load(self, now: float | None = None) -> EngineLoad:
        """Load at the last committed step, or at ``now`` inside an open segment."""
        tokens = self._running_tokens
        if self._segment is not None and now is not None:
            tokens += self._growth() * self._steps_done_by(now)
        return EngineLoad(num_running=len(self._running), num_waiting=len(self._waiting),
                          kv_usage=min(1.0, tokens / self.kv_capacity_tokens),
                          num_preemptions=self.num_preemptions)

    # ------------------------------------------------------------------ commands
    def add(self, task_id: int, request_key: str, context_tokens: int, max_tokens: int,
            true_remaining_tokens: int, *, prefix_key: str | None = None, prefix_tokens: int = 0,
            pooled_tokens: int = 0, load_s: float = 0.0) -> None:
        """Queue a chunk of request ``request_key``. ``prefix_key``/``prefix_tokens``: the
        first tokens of its context are a prefix shared with other requests (its group's
        prompt). ``pooled_tokens``: how much of its context has KV in the global pool;
        ``load_s``: seconds its start waits for that KV (a disk tier, sim/kv_tiers.py)."""
        if max_tokens < 1 or true_remaining_tokens < 1 or context_tokens < 1:
            raise ValueError(f"task {task_id}: context, max_tokens and true remaining tokens must be >= 1, "
                             f"got {context_tokens}, {max_tokens}, {true_remaining_tokens}")
        if not 0 <= prefix_tokens <= context_tokens:
            raise ValueError(f"task {task_id}: prefix_tokens must be in [0, {context_tokens}], "
                             f"got {prefix_tokens}")
        seq = _Seq(task_id, request_key, prefix_key, prefix_tokens, context_tokens, max_tokens,
                   true_remaining_tokens, pooled_tokens)
        seq.load_s = load_s
        self._waiting.append(seq)

    def abort(self, task_id: int) -> bool:
        """Drop a chunk between iterations; True if it was here."""
        if self._segment is not None:
            raise RuntimeError("abort() between iterations only: commit the open segment first")
        seq = self._running.get(task_id)
        if seq is not None:
            self._release(seq, (self._num_steps - seq.start_step) * seq.rate)
            self._rate_sum -= seq.rate
            seq.serial = -1  # its finish-heap entry is now stale
            return True
        queued = next((seq for seq in self._waiting if seq.task_id == task_id), None)
        if queued is not None:
            self._waiting.remove(queued)
        return queued is not None

    def step(self, now: float) -> tuple[float, list[FinishedChunk]]:
        """One scheduler iteration at ``now``: (its duration, the chunks it finished)."""
        end = self.begin(now, max_steps=1)
        return (0.0, []) if end is None else (end - now, self.commit())

    def begin(self, now: float, max_steps: int | None = None) -> float | None:
        """Start a segment at ``now``: preempt or admit, then plan as many identical decode
        steps as can run before the first finish or KV overflow. Returns the time the
        segment ends, or None if the engine has nothing to run."""
        if self._segment is not None:
            raise RuntimeError("begin() while a segment is open: commit it first")
        cap = self.kv_capacity_tokens
        preempted = False
        while self._running and self._running_tokens + len(self._running) > cap:
            if len(self._running) == 1:
                seq = next(iter(self._running.values()))
                raise SimEngineError(f"engine {self.engine_id}: task {seq.task_id} alone needs more than the "
                                     f"{cap} tokens of KV; raise kv_capacity_tokens or lower max_tokens")
            self._preempt(next(reversed(self._running.values())))
            preempted = True
        prefill_s = 0.0
        # vLLM v1 admits nothing in an iteration that had to preempt.
        while not preempted and self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            need = seq.context_tokens - (seq.prefix_tokens if seq.prefix_key in self._prefixes else 0)
            if self._running_tokens + need + len(self._running) + 1 > cap:
                if not self._running:
                    raise SimEngineError(f"engine {self.engine_id}: task {seq.task_id} needs {need + 1} "
                                         f"tokens of KV, the engine has {cap}; raise kv_capacity_tokens")
                break  # head-of-line: first come, first served
            self._waiting.popleft()
            prefill_s += self._admit(seq, now)
        if not self._running:
            return None
        while self._cache and self._running_tokens + self._cache_tokens > cap:
            self._evict_cached()
        if self.spec is not None:
            self._plan_spec(now)
        heap = self._finish_heap
        while heap[0][1] != heap[0][2].serial:
            heapq.heappop(heap)  # stale: preempted or aborted since it was pushed
        # Identical steps until the next finish among the running, or the KV is full.
        if self.spec is None:
            steps = min(heap[0][0] - self._num_steps, (cap - self._running_tokens) // len(self._running))
        else:
            room = (cap - self._running_tokens - self._num_drafts) / self._rate_sum
            steps = min(heap[0][0] - self._num_steps, int(room), self.spec.replan_steps)
        self._segment = (now, prefill_s, max(1, min(steps, max_steps or steps)))
        return self._end_s(self._segment[2])

    def cut(self, now: float) -> float:
        """Shorten the open segment to end at the first step boundary at or after ``now``
        (the step in progress completes; new work is admitted at that boundary)."""
        assert self._segment is not None, "cut() needs an open segment"
        start, prefill_s, steps = self._segment
        done = self._steps_done_by(now)
        cut = max(1, min(steps, done if done and self._end_s(done) >= now else done + 1))
        self._segment = (start, prefill_s, cut)
        return self._end_s(cut)

    def commit(self) -> list[FinishedChunk]:
        """Apply the open segment's steps; return the chunks that finished at its end."""
        assert self._segment is not None, "commit() needs an open segment"
        start, _, steps = self._segment
        end = self._end_s(steps)
        self._segment = None
        batch = len(self._running)
        growth = self._growth()
        self.busy_s += end - start
        self.num_steps += steps
        self._num_steps += steps
        self.num_output_tokens += growth * steps
        self._running_tokens += growth * steps
        self.num_seq_steps += batch * steps
        self.num_draft_tokens += self._num_drafts * steps
        finished: list[FinishedChunk] = []
        heap = self._finish_heap
        while heap and heap[0][0] <= self._num_steps:
            _, serial, seq = heapq.heappop(heap)
            if seq.serial != serial:
                continue  # preempted or aborted since this entry was pushed
            if self.spec is None:
                ran = self._num_steps - seq.start_step
                self._release(seq, ran, keep_cached=True)
                reason = "stop" if ran == seq.eos_in else "length"
                finished.append(FinishedChunk(seq.task_id, seq.num_generated + ran, reason))
            else:  # the last step overshot the chunk's end: verification stops at it
                ran = seq.steps_to_finish()
                overshoot = (self._num_steps - seq.start_step) * seq.rate - ran
                self._running_tokens -= overshoot
                self.num_output_tokens -= overshoot
                self._rate_sum -= seq.rate
                self._release(seq, ran, keep_cached=True)
                reason = "stop" if seq.eos_in <= seq.max_tokens - seq.num_generated else "length"
                finished.append(FinishedChunk(seq.task_id, round(seq.num_generated + ran), reason))
            self.started_s[seq.task_id] = seq.started_s
        while self._cache and self._running_tokens + self._cache_tokens > self.kv_capacity_tokens:
            self._evict_cached()
        return finished

    # ------------------------------------------------------------------ internals
    def _end_s(self, steps: int) -> float:
        """End time of the open segment after ``steps`` steps: each decode step costs
        a + b*B + c*S, and S grows by B tokens per step (closed-form sum)."""
        start, prefill_s, _ = self._segment  # type: ignore[misc]
        growth_s = self.cost.c * self._growth() * (steps * (steps - 1) // 2)
        return start + prefill_s + steps * self._first_step_s() + growth_s

    def _steps_done_by(self, now: float) -> int:
        """Largest j <= planned steps whose end is at or before ``now``: the root of the
        quadratic end(j) = now, then corrected by a step for floating-point rounding."""
        start, prefill_s, steps = self._segment  # type: ignore[misc]
        per_step = self._first_step_s()
        # end(j) - start - prefill = j * per_step + half_growth * j * (j - 1)
        half_growth = self.cost.c * self._growth() / 2
        elapsed = now - start - prefill_s
        if elapsed < 0:
            return 0
        if half_growth > 0:
            linear = per_step - half_growth
            j = int((-linear + math.sqrt(linear * linear + 4 * half_growth * elapsed)) / (2 * half_growth))
        else:
            j = int(elapsed / per_step) if per_step > 0 else steps
        j = max(0, min(steps, j))
        while j < steps and self._end_s(j + 1) <= now:
            j += 1
        while j > 0 and self._end_s(j) > now:
            j -= 1
        return j

    def _growth(self) -> float:
        """Tokens the running sequences add per step (the batch, without a planner)."""
        return len(self._running) if self.spec is None else self._rate_sum

    def _first_step_s(self) -> float:
        if self.spec is None:
            return self.cost.decode_step_s(len(self._running), self._running_tokens)
        return (self.cost.verify_step_s(len(self._running), self._num_drafts, self._running_tokens)
                + self._draft_s)

    def _plan_spec(self, now: float) -> None:
        """Rebase every running sequence to now (fold its progress into its fields) and
        give each its rate for the segment; rebuild the finish heap at the new rates."""
        assert self.spec is not None
        rows = []
        for seq in self._running.values():
            ran = (self._num_steps - seq.start_step) * seq.rate
            if ran:
                seq.context_tokens += ran
                seq.num_generated += ran
                seq.eos_in -= ran
                seq.start_step = self._num_steps
            rows.append(SpecRowInfo(seq.request_key, seq.prefix_key, seq.context_tokens - seq.prefix_tokens))
        rates, self._num_drafts, self._draft_s = self.spec.plan(self.engine_id, now, rows, self.cost,
                                                                self._running_tokens)
        heap = []
        for seq, rate in zip(self._running.values(), rates):
            seq.rate = rate
            self._next_serial += 1
            seq.serial = self._next_serial
            heap.append((self._num_steps + seq.finish_steps(), seq.serial, seq))
        heapq.heapify(heap)
        self._finish_heap = heap
        self._rate_sum = sum(rates)

    def _admit(self, seq: _Seq, now: float) -> float:
        """Move ``seq`` to running; return the seconds spent on its prefill / KV load."""
        cached = 0
        prefix = self._prefixes.get(seq.prefix_key) if seq.prefix_key is not None else None
        if prefix is not None:  # a running sibling holds the prefix: shared, free
            prefix[1] += 1
            cached = seq.prefix_tokens
        elif seq.prefix_key is not None:
            cached = self._uncache(("p", seq.prefix_key))
            self._prefixes[seq.prefix_key] = [seq.prefix_tokens, 1]
            self._running_tokens += seq.prefix_tokens
        own_hit = self._uncache(("r", seq.request_key))
        if cached == seq.prefix_tokens:  # the request's own blocks are usable only after its prefix
            cached += own_hit
        cached = min(cached, seq.context_tokens)
        pooled = min(seq.pooled_tokens, seq.context_tokens)
        from_pool = max(0, pooled - cached)
        prefill = seq.context_tokens - max(cached, pooled)
        self.num_prefill_tokens += prefill
        self.num_pool_tokens += from_pool
        self._next_serial += 1
        seq.serial = self._next_serial
        seq.start_step = self._num_steps
        if seq.started_s < 0:
            seq.started_s = now
        self._running[seq.task_id] = seq
        self._running_tokens += seq.own_tokens
        heapq.heappush(self._finish_heap, (self._num_steps + seq.steps_to_finish(), seq.serial, seq))
        load_s, seq.load_s = seq.load_s, 0.0
        return self.cost.p * prefill + self.cost.pool_s_per_token * from_pool + load_s

    def _release(self, seq: _Seq, ran: int, keep_cached: bool = False) -> None:
        """Take ``seq`` (which ran ``ran`` steps since admission) out of running; its KV
        becomes evictable cache if ``keep_cached`` (a finished chunk), else is dropped."""
        del self._running[seq.task_id]
        own = seq.own_tokens + ran
        self._running_tokens -= own
        if keep_cached:
            self._cache[("r", seq.request_key)] = own
            self._cache_tokens += own
        if seq.prefix_key is not None:
            prefix = self._prefixes[seq.prefix_key]
            prefix[1] -= 1
            if prefix[1] == 0:  # last user: the prefix becomes evictable (or is dropped)
                del self._prefixes[seq.prefix_key]
                self._running_tokens -= prefix[0]
                if keep_cached:
                    self._cache[("p", seq.prefix_key)] = prefix[0]
                    self._cache_tokens += prefix[0]

    def _uncache(self, key: tuple[str, str]) -> int:
        tokens = self._cache.pop(key, 0)
        self._cache_tokens -= tokens
        return tokens

    def _evict_cached(self) -> None:
        _, tokens = self._cache.popitem(last=False)
        self._cache_tokens -= tokens

    def _preempt(self, seq: _Seq) -> None:
        """Evict ``seq`` like vLLM's recompute preemption: its own KV is gone (even the part
        in the pool is not reused) and it re-prefills it when readmitted; a prefix that
        running siblings still hold stays."""
        ran = (self._num_steps - seq.start_step) * seq.rate
        self._release(seq, ran)
        self._rate_sum -= seq.rate
        seq.rate = 1
        seq.context_tokens += ran
        seq.num_generated += ran
        seq.eos_in -= ran
        seq.pooled_tokens = 0
        seq.serial = -1
        self._waiting.appendleft(seq)
        self.num_preemptions += 1
