"""Deterministic discrete-event simulation of a rollout, driving the real scheduler core.

Owns the virtual clock and the event loop that joins the pure scheduler core
(``seer.controlplane.scheduler``, with whatever policy is named) to N engine models
(``seer.sim.engine_model``): the rollout is built like ``controlplane/intake.py``
builds it, the scheduler's dispatches go to the engine models, finished chunks go back
through ``chunk_finished``, and loads through ``engine_load`` — the same event API the
control-plane server uses, with virtual time instead of sockets. Results are a
``SimResult``; nothing here reads the wall clock, so the same inputs give the same result.

Time advances from one engine event to the next. An engine runs *segments* of
identical decode steps (see the engine model) and only produces events at a segment's
end — a finished chunk, a preemption, room to admit — so the loop costs O(events), not
O(tokens). Work dispatched to a busy engine cuts its segment at the step in progress,
exactly as a real engine admits new requests at the next iteration.

Speculative decoding is optional (``spec``, a ``SimSpecConfig``): the engines then ask one
shared ``SimSpecPlanner`` (``seer.sim.specdecode``) for draft lengths and expected tokens
per step at every segment, and the simulation tells it where each request stands when a
chunk ends. Without ``spec`` nothing changes.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from seer.config import SchedulerConfig
from seer.controlplane.scheduler import Completion, Dispatch, Scheduler
from seer.controlplane.state import Group, Request, Rollout, derive_sample_seed
from seer.controlplane.stats import tail_time_s
from seer.controlplane.trace import ChunkSpan
from seer.sim.engine_model import DEFAULT_MAX_NUM_SEQS, CostModel, SimEngineModel
from seer.sim.kv_tiers import PoolTiers, TierConfig
from seer.protocol import ChunkFinished, EngineCapabilities, SamplingParams, pack_logprobs, pack_token_ids
from seer.sim.specdecode import SimSpecConfig, SimSpecPlanner
from seer.sim.workloads import Trace

ROLLOUT_ID = "sim"
OUTPUT_TOKEN_ID = 1  # every simulated output token; only lengths matter here
VOCAB_SIZE = 32_000
_HAS_ORACLE_LENGTH = "oracle_length" in {f.name for f in dataclasses.fields(Request)}


class SimulationStalled(RuntimeError):
    """Work remains but no engine is running and the scheduler dispatches nothing."""


@dataclass
class SimResult:
    policy: str
    num_engines: int
    num_requests: int
    num_output_tokens: int
    makespan_s: float  # virtual seconds from submission to the last sample
    throughput_tokens_per_s: float
    tail_time_s: float  # from 90 % of samples finished to the last
    num_preemptions: int
    num_chunks: int
    num_migrations: int  # chunks dispatched to an engine other than the previous chunk's
    engine_busy_pct: list[float]
    engine_idle_pct: list[float]
    sample_finish_s: list[list[float]]  # [group][sample]
    # engine -> (start, end, group_index) per chunk, from first admission to finish
    timeline: dict[int, list[tuple[float, float, int]]] = field(default_factory=dict)
    # every chunk in finish order, for timelines (``seerctl bench --plot``); one small Struct per chunk
    spans: list[ChunkSpan] = field(default_factory=list)
    # With speculative decoding: output tokens per sequence-step (accepted + 1; 1.0 without)
    # and drafted tokens verified per sequence-step, over all engines.
    tokens_per_seq_step: float = 1.0
    drafts_per_seq_step: float = 0.0


def build_scheduler(policy: str, clock: Callable[[], float],
                    scheduler_config: SchedulerConfig | None, cost: CostModel | None = None) -> Scheduler:
    """The one place the simulator constructs the scheduler core: its step-cost fit starts
    from the simulated engines' own model (as if profiled) and follows their step records."""
    return Scheduler(scheduler_config or SchedulerConfig(policy=policy), clock,  # type: ignore[arg-type]
                     cost_prior=cost)


def build_rollout(trace: Trace, policy: str, seed: int,
                  rollout_id: str = ROLLOUT_ID) -> tuple[Rollout, dict[Request, int]]:
    """The rollout state ``controlplane/intake.py`` would build for this trace (same ids,
    same per-sample seeds), with placeholder prompt tokens, and each request's true length.
    Group i's prompt is the same token ids in every rollout (``placeholder_prompt``)."""
    rollout = Rollout(rollout_id=rollout_id, policy=policy, accepted_s=0.0)
    true_length: dict[Request, int] = {}
    for index, trace_group in enumerate(trace.groups):
        group = Group(group_id=f"{rollout_id}/{index}", rollout=rollout, group_index=index,
                      prompt_id=str(index))
        prompt = placeholder_prompt(index, trace_group.prompt_tokens)  # shared by the group, as intake shares it
        sampling = SamplingParams(max_tokens=trace_group.max_tokens, seed=seed)
        for j, length in enumerate(trace_group.output_tokens):
            request = Request(
                request_id=f"{rollout_id}/{index}/{j}",
                group=group,
                sample_index=j,
                prompt_token_ids=prompt,
                sampling=msgspec.structs.replace(sampling, seed=derive_sample_seed(seed, index, j)),
            )
            if _HAS_ORACLE_LENGTH:  # policies that may peek at the truth (``oracle``)
                request.oracle_length = length  # type: ignore[attr-defined]
            true_length[request] = length
            group.requests.append(request)
        rollout.groups.append(group)
    return rollout, true_length


def placeholder_prompt(group_index: int, num_tokens: int) -> list[int]:
    """Prompt token ids for trace group ``group_index``: its index in base VOCAB_SIZE - 1
    (digits + 1), zero-padded — distinct per group (while ``num_tokens`` holds the digits),
    the same across rollouts, as a prompt re-sampled in the next RL iteration is."""
    digits = []
    n = group_index
    while True:
        digits.append(n % (VOCAB_SIZE - 1) + 1)
        n //= VOCAB_SIZE - 1
        if not n:
            break
    return (digits + [0] * num_tokens)[:num_tokens]


def simulate_iterations(traces: list[Trace], policy: str, num_engines: int, cost: CostModel,
                        kv_capacity_tokens: int, scheduler_config: SchedulerConfig | None = None, seed: int = 0, *,
                        length_prior: bool = False,
                        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> list[SimResult]:
    """Several rollouts in sequence on one scheduler core, as one daemon runs successive RL
    iterations: the policy objects (and a ``context`` policy's cross-iteration length
    prior, if ``length_prior``) carry over; engines start each rollout idle and empty."""
    current: list[Simulation] = []  # the rollout being simulated: its virtual time is the clock
    scheduler = build_scheduler(policy, lambda: current[-1].now, scheduler_config, cost)
    if length_prior:
        from seer.controlplane.prior import LengthPrior

        target = scheduler.policy(policy)
        if not target.takes_length_prior:
            raise ValueError(f"policy {policy!r} takes no length prior (only 'context' does)")
        target.prior = LengthPrior()
    results = []
    for iteration, trace in enumerate(traces):
        sim = Simulation(trace, policy, num_engines, cost, kv_capacity_tokens, scheduler_config, seed, max_num_seqs,
                         scheduler=scheduler, rollout_id=f"{ROLLOUT_ID}{iteration}")
        current.append(sim)
        results.append(sim.run())
        scheduler.forget(sim.rollout.rollout_id)
    return results


def simulate(trace: Trace, policy: str, num_engines: int, cost: CostModel, kv_capacity_tokens: int,
             scheduler_config: SchedulerConfig | None = None, seed: int = 0, *,
             max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, spec: SimSpecConfig | None = None,
             tiers: TierConfig | None = None) -> SimResult:
    """Run ``trace`` as one rollout under ``policy`` on ``num_engines`` identical engines.

    ``scheduler_config`` carries the policies' knobs (chunk size, imbalance threshold,
    ...); its defaults suit the small bundled model, so paper-scale runs of chunked
    policies should pass e.g. ``SchedulerConfig(policy=..., chunk_size_tokens=8192)``.
    ``seed`` derives the per-sample sampling seeds exactly as intake does. ``spec``
    turns on simulated speculative decoding (module docstring). ``tiers``: a finite DRAM
    pool with an optional disk tier and prefetch (``sim/kv_tiers.py``); None: an unbounded pool.
    """
    return Simulation(trace, policy, num_engines, cost, kv_capacity_tokens, scheduler_config, seed,
                      max_num_seqs, spec=spec, tiers=tiers).run()


class Simulation:
    """One simulated rollout. ``simulate`` is the API; the object stays inspectable after
    ``run()`` (its ``rollout``, ``scheduler`` and ``engines``) for tests and analyses."""

    def __init__(self, trace: Trace, policy: str, num_engines: int, cost: CostModel, kv_capacity_tokens: int,
                 scheduler_config: SchedulerConfig | None, seed: int, max_num_seqs: int, *,
                 scheduler: Scheduler | None = None, rollout_id: str = ROLLOUT_ID,
                 spec: SimSpecConfig | None = None, tiers: TierConfig | None = None,
                 max_model_len: int | None = None) -> None:
        """``max_model_len``: the engines' context limit (default: the trace's longest prompt
        + max_tokens; a trajectory's whole context is longer, ``sim/agentic.py``)."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        longest = max_model_len or max(g.prompt_tokens + g.max_tokens for g in trace.groups)
        if kv_capacity_tokens <= longest:
            raise ValueError(f"kv_capacity_tokens={kv_capacity_tokens} cannot hold the longest sequence of "
                             f"the trace ({longest} tokens of context); raise it above {longest}")
        self.now = 0.0
        self.policy = policy
        # A scheduler passed in (``simulate_iterations``) must read this simulation's ``now``.
        self.scheduler = scheduler or build_scheduler(policy, lambda: self.now, scheduler_config, cost)
        self.uses_pool = self.scheduler.policy(policy).uses_kv_pool  # the global pool, unbounded here
        self.rollout, self.true_length = build_rollout(trace, policy, seed, rollout_id)
        # Probes (sample 0 of each group) are the rows λ favours.
        self.spec = None if spec is None else SimSpecPlanner(spec, {
            r.request_id for g in self.rollout.groups for r in g.requests if r.sample_index == 0})
        self.engines = [SimEngineModel(i, cost, kv_capacity_tokens, max_num_seqs=max_num_seqs, spec=self.spec)
                        for i in range(num_engines)]
        capabilities = EngineCapabilities(
            backend="sim", model="sim-cost-model", dtype="none",
            max_model_len=longest,
            vocab_size=VOCAB_SIZE, kv_capacity_tokens=kv_capacity_tokens, block_size=16)
        for engine in self.engines:
            self.scheduler.engine_joined(engine.engine_id, capabilities)
        # (segment end, engine id, version): a cut segment leaves a stale entry behind.
        self.events: list[tuple[float, int, int]] = []
        self.version = [0] * num_engines
        self.tasks: dict[int, Request] = {}  # in-flight task id -> request
        self.timeline: dict[int, list[tuple[float, float, int]]] = {e.engine_id: [] for e in self.engines}
        self.spans: list[ChunkSpan] = []
        self.last_engine: dict[str, int] = {}  # request id -> engine of its last finished chunk
        self.tiers = PoolTiers(tiers) if tiers is not None else None

    # Hooks for workloads with an environment (``sim/agentic.py``); none here.
    def _next_env_s(self) -> float | None:
        """When the environment next acts (None: never)."""
        return None

    def _env_due(self) -> None:
        """Apply what the environment does at ``now``."""

    def _chunk_returned(self, engine: SimEngineModel, request: Request, msg: ChunkFinished,
                        done: Completion | None) -> None:
        """A chunk was applied to the scheduler (``done``: its completion). The global pool
        now holds the KV its context ended with (what placement prices a move at), unless
        the policy runs without it (``Policy.uses_kv_pool``)."""
        request.kv_valid_tokens = request.context_tokens if self.uses_pool else 0

    def run(self) -> SimResult:
        self.scheduler.submit(self.rollout)
        self._start(self._dispatch())
        while not self.rollout.done:
            env_s = self._next_env_s()
            if not self.events and env_s is None:
                raise SimulationStalled(
                    f"at t={self.now:.3f} s no engine is running, {self.scheduler.num_waiting()} requests wait "
                    f"and policy {self.policy!r} dispatches none of them ({self.rollout.num_samples_done} of "
                    f"{self.rollout.num_samples} samples done); the policy may wait for engine capacity that "
                    "never frees — check kv_capacity_tokens against the trace's prompt + max_tokens")
            self.now = min(t for t in (self.events[0][0] if self.events else None, env_s) if t is not None)
            ended: list[int] = []
            # Every engine whose segment ends now, in engine order (deterministic).
            while self.events and self.events[0][0] == self.now:
                _, engine_id, version = heapq.heappop(self.events)
                if version == self.version[engine_id] and self.engines[engine_id].segment_open:
                    ended.append(engine_id)
            for engine_id in ended:
                self._commit(self.engines[engine_id])
            self._env_due()
            self._start(set(ended) | self._dispatch())
        return self._result()

    def _commit(self, engine: SimEngineModel) -> None:
        record, steps = engine.step_record()  # the engines report their steps, as real ones do
        self.scheduler.engine_steps(engine.engine_id, [record], weight=steps)
        for task_id, num_tokens, reason in engine.commit():
            request = self.tasks.pop(task_id)
            started_s = engine.started_s.pop(task_id)
            self.timeline[engine.engine_id].append((started_s, self.now, request.group.group_index))
            previous = self.last_engine.get(request.request_id, engine.engine_id)
            self.last_engine[request.request_id] = engine.engine_id
            self.spans.append(ChunkSpan(engine.engine_id, request.group.group_id, request.request_id, started_s,
                                        self.now, previous != engine.engine_id, task_id,
                                        num_tokens=num_tokens))
            context, prefilled = engine.admitted.pop(task_id)
            msg = ChunkFinished(
                engine_id=engine.engine_id, task_id=task_id, token_ids=pack_token_ids([OUTPUT_TOKEN_ID] * num_tokens),
                logprobs=pack_logprobs([0.0] * num_tokens), finish_reason=reason, num_prompt_tokens=context,
                num_cached_tokens=context - prefilled, elapsed_ms=0.0)
            self._chunk_returned(engine, request, msg, self.scheduler.chunk_finished(msg))
            if self.tiers is not None:
                self.tiers.returned(request.request_id, request.context_tokens, self.now,
                                    request.finished_s is not None)
            if self.spec is not None:
                self.spec.chunk_finished(request.request_id, request.group.group_id, request.num_generated_tokens,
                                         request.finished_s is not None)
        self.scheduler.engine_load(engine.engine_id, engine.load())

    def _dispatch(self) -> set[int]:
        """Ask the scheduler for work at ``now``; hand it to the engines; return their ids."""
        if not self.scheduler.num_waiting():
            return set()
        for engine in self.engines:  # policies may read load: make it current, not last-segment
            if engine.segment_open:
                self.scheduler.engine_load(engine.engine_id, engine.load(self.now))
        touched: set[int] = set()
        for dispatch in self.scheduler.schedule():
            request = dispatch.request
            self.tasks[dispatch.task.task_id] = request
            self.engines[dispatch.engine_id].add(
                dispatch.task.task_id, request.request_id, request.context_tokens,
                dispatch.task.sampling.max_tokens, prefix_key=request.group.group_id,
                prefix_tokens=len(request.prompt_token_ids), **self._chunk_args(dispatch))
            touched.add(dispatch.engine_id)
        return touched

    def _chunk_args(self, dispatch: Dispatch) -> dict:
        """What the engine model needs beyond the task: tokens to its true end, its pooled KV."""
        request = dispatch.request
        true_length = self.true_length[request]
        # A sample cut off by its budget never emits EOS: its end is a "length" finish.
        truncated = true_length >= request.sampling.max_tokens
        eos_in = request.remaining_tokens + 1 if truncated else true_length - request.num_generated_tokens
        # After its first chunk a request's KV lives in the global pool (unbounded
        # unless ``tiers`` models DRAM, disk and prefetch).
        pooled, load_s = request.kv_valid_tokens, 0.0
        if self.tiers is not None:
            pooled, load_s = self.tiers.dispatch(request.request_id, request.context_tokens, self.now)
        return {"true_remaining_tokens": eos_in, "pooled_tokens": pooled, "load_s": load_s}

    def _start(self, engine_ids: set[int]) -> None:
        """Give each engine its next segment: new, or cut short to admit new work."""
        for engine_id in sorted(engine_ids):
            engine = self.engines[engine_id]
            end = engine.cut(self.now) if engine.segment_open else engine.begin(self.now)
            if end is not None:
                self.version[engine_id] += 1
                heapq.heappush(self.events, (end, engine_id, self.version[engine_id]))

    def _result(self) -> SimResult:
        finish = [[r.finished_s if r.finished_s is not None else float("nan") for r in g.requests]
                  for g in self.rollout.groups]
        flat = [t for row in finish for t in row]
        makespan = max(flat) if flat else 0.0
        tokens = self.rollout.num_output_tokens
        busy = [100.0 * e.busy_s / makespan if makespan > 0 else 0.0 for e in self.engines]
        seq_steps = sum(e.num_seq_steps for e in self.engines)
        requests = [r for g in self.rollout.groups for r in g.requests]
        return SimResult(
            policy=self.policy,
            num_engines=len(self.engines),
            num_requests=len(requests),
            num_output_tokens=tokens,
            makespan_s=makespan,
            throughput_tokens_per_s=tokens / makespan if makespan > 0 else 0.0,
            tail_time_s=tail_time_s(flat),
            num_preemptions=sum(e.num_preemptions for e in self.engines),
            num_chunks=self.rollout.num_chunks,
            num_migrations=sum(len(r.engine_history) - 1 for r in requests),
            engine_busy_pct=busy,
            engine_idle_pct=[100.0 - b for b in busy],
            sample_finish_s=finish,
            timeline=self.timeline,
            spans=self.spans,
            tokens_per_seq_step=sum(e.num_output_tokens for e in self.engines) / max(1, seq_steps),
            drafts_per_seq_step=sum(e.num_draft_tokens for e in self.engines) / max(1, seq_steps),
        )
