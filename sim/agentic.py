"""Agentic (multi-turn) workloads in the simulator: trajectories, their tool waits, and the
KV a trajectory's next turn finds or recomputes.

Owns the ``AgenticTrace`` value (per group, per sample, its turns ``(decode, tool_s,
tool_tokens)``: the format ``benchmarks/agentic_traces.py`` writes), its reading and
scaling, and ``AgenticSimulation``: the simulator (``sim/simulator.py``) with an
environment. Every sample is a trajectory built as intake builds a ``replay_turns`` one
(``turns.new_trajectory`` with the trace's decode lengths; each turn decodes exactly its
length through the scheduler's forced-length path). At a turn end (``Completion.turn_ended``)
the simulated environment waits the turn's ``tool_s`` of virtual time and answers through
``turns.answer`` — a tokenizer whose turn suffix is ``tool_tokens`` + the trace's
``template_tokens`` ids — then ``Scheduler.resume``; after the last turn it answers "done"
and the trajectory ends (``Scheduler.end_trajectory``, "stop").

KV: each engine model keeps an LRU prefix cache (``SimEngineModel``): a trajectory's next
turn on the engine that still holds its KV prefills only what is new (its appended answer
and its last sampled token, ``fresh_tokens``), hits counted in whole blocks as vLLM's
prefix cache does. With ``pool`` (the host KV pool, unbounded here) the KV a chunk ended
with is loaded elsewhere at the cost model's ``pool_s_per_token``; without it a turn on an
engine that lacks its KV recomputes its whole context. Recomputed tokens are counted as
the daemon counts them (``turns.recomputed_tokens``: prefilled beyond what was new).
"""

from __future__ import annotations

import heapq
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from seer.config import SchedulerConfig
from seer.controlplane import turns
from seer.controlplane.scheduler import Completion, Dispatch
from seer.controlplane.state import Request
from seer.protocol import ChatMessage, ChunkFinished, TrajectorySpec, TurnInput
from seer.sim.engine_model import DEFAULT_MAX_NUM_SEQS, CostModel, SimEngineModel
from seer.sim.simulator import VOCAB_SIZE, SimResult, Simulation
from seer.sim.workloads import Trace, TraceGroup

TOOL_TOKEN_ID = 2  # every appended (tool / template) token; only counts matter here
_TOOL_MESSAGE = [ChatMessage(role="tool", content="")]  # its length is the tokenizer's to say


class Turn(NamedTuple):
    decode: int  # tokens the model samples this turn
    tool_s: float  # seconds its environment takes to answer (0 after the last turn)
    tool_tokens: int  # tokens of the answer (0 after the last turn)


@dataclass(frozen=True)
class AgenticGroup:
    prompt_tokens: int
    samples: tuple[tuple[Turn, ...], ...]  # per sample, its turns


@dataclass(frozen=True)
class AgenticTrace:
    name: str
    groups: tuple[AgenticGroup, ...]
    max_context: int  # prompt + every token after it (TrajectorySpec.max_total_tokens)
    template_tokens: int = 0  # chat-template tokens appended with each tool answer

    @property
    def trajectories(self) -> list[tuple[Turn, ...]]:
        return [s for g in self.groups for s in g.samples]

    @property
    def num_turns(self) -> int:
        return sum(len(s) for s in self.trajectories)

    @property
    def max_decode(self) -> int:
        return max(t.decode for s in self.trajectories for t in s)

    @property
    def max_turns(self) -> int:
        return max(len(s) for s in self.trajectories)

    def context_tokens(self) -> list[int]:
        """Each trajectory's whole context at its end."""
        return [g.prompt_tokens + sum(t.decode + (t.tool_tokens + self.template_tokens if t.tool_tokens else 0)
                                      for t in s) for g in self.groups for s in g.samples]


def alone_s(trace: AgenticTrace, cost: CostModel) -> float:
    """The longest trajectory run alone: its turns' steps at batch 1 on an engine that keeps
    its KV (its prompt, then each answer and last token prefilled) plus its tool waits. No
    policy finishes a rollout sooner on engines of this cost."""
    longest = 0.0
    for group in trace.groups:
        for sample in group.samples:
            context, total, fresh = group.prompt_tokens, 0.0, group.prompt_tokens
            for t in sample:
                total += cost.p * fresh + t.decode * (cost.a + cost.b) + cost.c * (
                    t.decode * context + t.decode * (t.decode - 1) / 2) + t.tool_s
                appended = t.tool_tokens + trace.template_tokens if t.tool_tokens else 0
                context += t.decode + appended
                fresh = appended + 1
            longest = max(longest, total)
    return longest


def agentic_trace(data: dict, name: str = "agentic", prompt_tokens: list[int] | None = None,
                  template_tokens: int | None = None) -> AgenticTrace:
    """A trace from its JSON form (``{"trajectories": [group][sample][turn], "max_context",
    "prompt_tokens", "template_tokens"}``); ``prompt_tokens``: each group's own (a real
    run's), else the file's one size for all. ValueError on a malformed trace."""
    groups = data.get("trajectories")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, list) and g for g in groups):
        raise ValueError("\"trajectories\" must be a non-empty list of groups, each a non-empty list of samples")
    prompts = prompt_tokens or [int(data.get("prompt_tokens", 100))] * len(groups)
    if len(prompts) < len(groups):
        raise ValueError(f"{len(groups)} groups but {len(prompts)} prompt sizes")
    out = []
    for i, group in enumerate(groups):
        samples = []
        for j, sample in enumerate(group):
            if not isinstance(sample, list) or not sample:
                raise ValueError(f"trajectories[{i}][{j}] must be a non-empty list of turns")
            try:
                samples.append(tuple(Turn(int(t["decode"]), float(t["tool_s"]), int(t["tool_tokens"])) for t in sample))
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"trajectories[{i}][{j}]: every turn needs decode, tool_s, tool_tokens") from None
            bad = [k for k, t in enumerate(samples[-1]) if t.decode < 1 or t.tool_s < 0
                   or (k < len(sample) - 1 and t.tool_tokens < 1)]
            if bad:
                raise ValueError(f"trajectories[{i}][{j}][{bad[0]}] is {sample[bad[0]]!r}: decode >= 1, tool_s >= 0, "
                                 "tool_tokens >= 1 except on the last turn")
        out.append(AgenticGroup(prompt_tokens=int(prompts[i]), samples=tuple(samples)))
    template = int(data.get("template_tokens", 0)) if template_tokens is None else template_tokens
    trace = AgenticTrace(name=name, groups=tuple(out), max_context=int(data.get("max_context", 0)),
                         template_tokens=template)
    longest = max(trace.context_tokens())
    if not trace.max_context:
        trace = AgenticTrace(name, trace.groups, longest + 1, template)
    return trace


def load_agentic_trace(path: str | Path, **kwargs: object) -> AgenticTrace:
    return agentic_trace(json.loads(Path(path).read_text()), name=Path(path).stem, **kwargs)  # type: ignore[arg-type]


def scale_trace(trace: AgenticTrace, tokens: float = 1.0, seconds: float = 1.0) -> AgenticTrace:
    """Every token count (prompts, decodes, tool answers, the context budget) times
    ``tokens``, every tool wait times ``seconds``; the template around an answer stays."""
    def turn(t: Turn) -> Turn:
        return Turn(max(1, round(t.decode * tokens)), t.tool_s * seconds,
                    max(1, round(t.tool_tokens * tokens)) if t.tool_tokens else 0)

    groups = tuple(AgenticGroup(max(1, round(g.prompt_tokens * tokens)),
                                tuple(tuple(turn(t) for t in s) for s in g.samples)) for g in trace.groups)
    return AgenticTrace(f"{trace.name}x{tokens:g}", groups, round(trace.max_context * tokens), trace.template_tokens)


class _ToolTokens:
    """A tokenizer for ``turns.answer``: the answer renders to ``n`` ids; no EOS."""

    eos_token_id = None

    def __init__(self, n: int) -> None:
        self.n = n

    def encode_turn_suffix(self, messages: list, ended_with_eos: bool) -> list[int]:  # noqa: ARG002
        return [TOOL_TOKEN_ID] * self.n


@dataclass
class AgenticResult:
    policy: str
    num_engines: int
    num_trajectories: int
    num_turns: int
    off_trace: int  # trajectories whose turns did not decode the trace's lengths
    finish_reasons: dict[str, int]
    makespan_s: float
    sampled_tokens: int
    sampled_tok_per_s: float
    recomputed_tokens: int  # prefilled beyond what was new (turns.recomputed_tokens)
    prefilled_tokens: int
    reused_tokens: int  # from an engine's prefix cache or the pool
    pool_loaded_tokens: int
    engine_idle_frac: float  # mean over engines of the share of the makespan with nothing to run
    num_preemptions: int
    engine_switches: int  # a turn started on another engine than its previous one ended on, + moves within
    sim: SimResult = field(repr=False)


class AgenticSimulation(Simulation):
    """One simulated agentic rollout (``simulate_agentic`` is the API)."""

    def __init__(self, trace: AgenticTrace, policy: str, num_engines: int, cost: CostModel, kv_capacity_tokens: int,
                 scheduler_config: SchedulerConfig | None = None, seed: int = 0, *, pool: bool = True,
                 block_tokens: int = 16, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 min_load_tokens: int | None = None) -> None:
        max_decode = trace.max_decode  # each turn's budget (sampling.max_tokens), as the real replay sets it
        first = Trace(trace.name, tuple(TraceGroup(g.prompt_tokens, max_decode, tuple(s[0].decode for s in g.samples))
                                        for g in trace.groups))
        super().__init__(first, policy, num_engines, cost, kv_capacity_tokens, scheduler_config, seed, max_num_seqs,
                         max_model_len=trace.max_context)
        self.trace, self.block_tokens = trace, block_tokens
        self.uses_pool = self.uses_pool and pool  # no pool: nothing is loaded, every move re-prefills
        self.min_load_tokens = min_load_tokens  # None: a block
        spec = TrajectorySpec(max_turns=min(1000, trace.max_turns), max_total_tokens=trace.max_context)
        self.turns_of: dict[Request, tuple[Turn, ...]] = {}
        for group, trace_group in zip(self.rollout.groups, trace.groups):
            for request, sample in zip(group.requests, trace_group.samples):
                replay = [t.decode for t in sample]  # as intake builds RolloutRequest.replay_turns
                request.trajectory = turns.new_trajectory(spec, trace.max_context, replay)
                request.forced_length = replay[0]
                request.oracle_length = None  # a trajectory has no single true length
                self.turns_of[request] = sample
        self._env: list[tuple[float, int, Request]] = []  # (answer time, order, trajectory)
        self._order = itertools.count()

    def _chunk_args(self, dispatch: Dispatch) -> dict:
        request = dispatch.request
        t = request.trajectory
        assert t is not None
        if request.num_chunks <= 1:
            fresh = 1  # its prompt, which a sibling may have cached (vLLM computes the last token anyway)
        elif t.turns[-1].num_chunks == 0:
            fresh = t.turns[-2].appended_tokens + 1  # the answer and the last token sampled before it
        else:
            fresh = 1  # the previous chunk's last sampled token
        return {"true_remaining_tokens": dispatch.task.sampling.max_tokens + 1,  # forced lengths: no EOS
                "pooled_tokens": request.kv_valid_tokens,
                "fresh_tokens": fresh, "block_tokens": self.block_tokens, "min_load_tokens": self.min_load_tokens}

    def _chunk_returned(self, engine: SimEngineModel, request: Request, msg: ChunkFinished,
                        done: Completion | None) -> None:
        super()._chunk_returned(engine, request, msg, done)
        if done is None:
            return
        # What the daemon does with a finished chunk of a trajectory (controlplane/sessions.py).
        done.recomputed_tokens = turns.recomputed_tokens(request, msg)
        request.group.rollout.num_recomputed_tokens += done.recomputed_tokens
        turns.chunk_done(request, msg, done.recomputed_tokens)
        if done.turn_ended:
            t = request.trajectory
            assert t is not None
            turn = self.turns_of[request][min(len(t.turns), len(self.turns_of[request])) - 1]
            heapq.heappush(self._env, (self.now + turn.tool_s, next(self._order), request))

    def _next_env_s(self) -> float | None:
        return self._env[0][0] if self._env else None

    def _env_due(self) -> None:
        while self._env and self._env[0][0] <= self.now:
            _, _, request = heapq.heappop(self._env)
            t = request.trajectory
            assert t is not None
            k = len(t.turns) - 1
            sample = self.turns_of[request]
            last = k >= len(sample) - 1
            turn = sample[min(k, len(sample) - 1)]
            msg = TurnInput(call_id="sim", rollout_id=request.group.rollout.rollout_id,
                            group_index=request.group.group_index, sample_index=request.sample_index, turn=k,
                            outcome="done" if last else "continue", messages=[] if last else _TOOL_MESSAGE,
                            tool_name="" if last else "sim", tool_s=turn.tool_s)
            ended = turns.answer(request, msg, _ToolTokens(turn.tool_tokens + self.trace.template_tokens),  # type: ignore[arg-type]
                                 VOCAB_SIZE)
            if ended is None:
                self.scheduler.resume(request)
            else:
                request.kv_valid_tokens = 0
                self.scheduler.end_trajectory(request, ended)

    def run(self) -> AgenticResult:  # type: ignore[override]
        sim = super().run()
        requests = [r for g in self.rollout.groups for r in g.requests]
        records = [(r, r.trajectory.turns) for r in requests if r.trajectory is not None]
        switches = off_trace = 0
        finish: dict[str, int] = {}
        for request, recs in records:
            finish[request.finish_reason or ""] = finish.get(request.finish_reason or "", 0) + 1
            off_trace += [t.end - t.start for t in recs] != [t.decode for t in self.turns_of[request]]
            for k, t in enumerate(recs):
                switches += max(0, len(t.engine_ids) - 1)
                prev = recs[k - 1] if k else None
                if prev is not None and prev.engine_ids and t.engine_ids and prev.engine_ids[-1] != t.engine_ids[0]:
                    switches += 1
        sampled = self.rollout.num_output_tokens
        return AgenticResult(
            policy=self.policy, num_engines=len(self.engines), num_trajectories=len(records),
            num_turns=sum(len(recs) for _, recs in records), off_trace=off_trace, finish_reasons=finish,
            makespan_s=sim.makespan_s, sampled_tokens=sampled,
            sampled_tok_per_s=sampled / sim.makespan_s if sim.makespan_s > 0 else 0.0,
            recomputed_tokens=self.rollout.num_recomputed_tokens,
            prefilled_tokens=sum(t.prefilled_tokens for _, recs in records for t in recs),
            reused_tokens=sum(t.reused_tokens for _, recs in records for t in recs),
            pool_loaded_tokens=sum(e.num_pool_tokens for e in self.engines),
            engine_idle_frac=sum(sim.engine_idle_pct) / 100 / max(1, len(sim.engine_idle_pct)),
            num_preemptions=sim.num_preemptions, engine_switches=switches, sim=sim)


def simulate_agentic(trace: AgenticTrace, policy: str, num_engines: int, cost: CostModel, kv_capacity_tokens: int,
                     scheduler_config: SchedulerConfig | None = None, seed: int = 0, *, pool: bool = True,
                     block_tokens: int = 16, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                     min_load_tokens: int | None = None) -> AgenticResult:
    """Run ``trace``'s trajectories as one rollout under ``policy`` on ``num_engines``
    identical engines of ``kv_capacity_tokens`` each; ``pool``: an (unbounded) host KV pool
    keeps every trajectory's KV between turns; ``block_tokens``: the prefix cache's block."""
    return AgenticSimulation(trace, policy, num_engines, cost, kv_capacity_tokens, scheduler_config, seed, pool=pool,
                             block_tokens=block_tokens, max_num_seqs=max_num_seqs, min_load_tokens=min_load_tokens).run()


__all__ = ["AgenticResult", "AgenticSimulation", "AgenticTrace", "Turn", "agentic_trace", "alone_s", "load_agentic_trace",
           "scale_trace", "simulate_agentic"]
