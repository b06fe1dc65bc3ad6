"""Owns the trainer-batch <-> Seer-groups mapping and the sampling translation, without I/O.

A GRPO trainer hands its rollout function a flat batch in which every prompt appears G
times in a row (TRL's ``RepeatSampler``: ``[p0]*G + [p1]*G + ...``, gathered across ranks
in rank order). Seer wants each distinct prompt once with ``group_size=G``. This module:

* ``unique_groups``: checks the batch really is whole, contiguous groups of G identical
  prompts and returns one prompt per group (a batch that is not is refused with the fix);
* ``rows_from_groups``: expands Seer's groups back to one row per input row, in input order
  (row ``i*G + j`` is sample ``j`` of group ``i``);
* ``process_slice``: which rows of the gathered batch belong to one rank;
* ``sampling_from_settings``: the trainer's sampling settings as Seer ``SamplingParams``,
  refusing the ones Seer would not honour exactly.

Everything here is pure (no sockets, no torch), so the unit tests pin it without engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from seer.protocol import GroupResult, SamplingParams


class SeerIntegrationError(ValueError):
    """A trainer-side setting or batch Seer cannot serve; the message names the fix."""


def unique_groups(rows: Sequence[Sequence[int]], group_size: int) -> list[list[int]]:
    """One prompt (token ids) per group of ``group_size`` identical, consecutive rows."""
    if group_size < 1:
        raise SeerIntegrationError(f"num_generations={group_size}: must be >= 1")
    if len(rows) == 0 or len(rows) % group_size:
        raise SeerIntegrationError(
            f"the trainer's batch has {len(rows)} rows, not a multiple of num_generations={group_size}: "
            f"Seer generates whole groups; make the generation batch size (per_device_train_batch_size * "
            f"num_processes * steps_per_generation) a multiple of num_generations")
    groups = []
    for start in range(0, len(rows), group_size):
        first = list(rows[start])
        for offset in range(1, group_size):
            if list(rows[start + offset]) != first:
                raise SeerIntegrationError(
                    f"rows {start} and {start + offset} of the trainer's batch hold different prompts, so "
                    f"rows {start}..{start + group_size - 1} are not one group of num_generations={group_size}: "
                    f"the batch must repeat each prompt G times in a row (TRL's RepeatSampler does); do not "
                    f"shuffle or re-sample the batch before the rollout function")
        groups.append(first)
    return groups


def rows_from_groups(prompts: Sequence[Sequence[int]], groups: Sequence[GroupResult],
                     group_size: int) -> dict[str, list[list[Any]]]:
    """Seer's groups as one row per input row: ``prompt_ids``, ``completion_ids``, ``logprobs``;
    for trajectories also ``env_mask`` (TRL's name for a loss mask: 1 = sampled by the
    model), ``env_reward`` and ``num_turns`` (extra fields TRL hands to reward functions)."""
    if len(groups) != len(prompts):
        raise SeerIntegrationError(f"Seer returned {len(groups)} groups for {len(prompts)} prompts")
    out: dict[str, list[list[Any]]] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for index, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        if group.group_index != index or len(group.samples) != group_size:
            raise SeerIntegrationError(
                f"Seer's group {group.group_index} at position {index} has {len(group.samples)} samples, "
                f"expected group {index} with {group_size}")
        for sample in sorted(group.samples, key=lambda s: s.sample_index):
            if len(sample.logprobs) != len(sample.token_ids):
                raise SeerIntegrationError(f"group {index} sample {sample.sample_index}: "
                                           f"{len(sample.token_ids)} tokens but {len(sample.logprobs)} logprobs")
            out["prompt_ids"].append(list(prompt))
            out["completion_ids"].append(list(sample.token_ids))
            out["logprobs"].append(list(sample.logprobs))
            if sample.turns:  # a trajectory: TRL masks what its environment appended, and its reward
                out.setdefault("env_mask", []).append(list(sample.loss_mask))
                out.setdefault("env_reward", []).append(sample.reward)
                out.setdefault("num_turns", []).append(len(sample.turns))
    return out


def process_slice(process_index: int, num_local_rows: int) -> slice:
    """Rows of the gathered batch that belong to rank ``process_index`` (equal shares, rank order)."""
    return slice(process_index * num_local_rows, (process_index + 1) * num_local_rows)


def sampling_from_settings(*, temperature: float, top_p: float, top_k: int | None, max_completion_length: int | None,
                           min_p: float | None = None, repetition_penalty: float = 1.0,
                           generation_kwargs: dict | None = None, seed: int | None = None) -> SamplingParams:
    """The trainer's sampling settings as Seer's; a setting Seer cannot honour exactly is refused."""
    if max_completion_length is None or max_completion_length < 1:
        raise SeerIntegrationError(f"max_completion_length={max_completion_length!r}: Seer needs a positive "
                                   "bound on the completion length; set max_completion_length in the config")
    if repetition_penalty != 1.0:
        raise SeerIntegrationError(f"repetition_penalty={repetition_penalty}: Seer does not apply penalties "
                                   "(their meaning across chunk edges is not kept yet); set repetition_penalty=1.0")
    if min_p not in (None, 0.0):
        raise SeerIntegrationError(f"min_p={min_p}: Seer does not offer min_p sampling; set min_p=None "
                                   "(use top_p / top_k)")
    if generation_kwargs:
        raise SeerIntegrationError(f"generation_kwargs={generation_kwargs!r}: Seer cannot apply extra generation "
                                   "arguments; set generation_kwargs=None and use temperature, top_p, top_k")
    top_k_seer = -1 if top_k in (None, 0, -1) else top_k  # TRL/transformers: 0 or None = off; Seer: -1
    try:
        return msgspec.convert({"max_tokens": max_completion_length, "temperature": temperature, "top_p": top_p,
                                "top_k": top_k_seer, "seed": seed}, SamplingParams)
    except msgspec.ValidationError as exc:
        raise SeerIntegrationError(f"the trainer's sampling settings are out of Seer's range: {exc} "
                                   "(temperature 0..1e6, 0 < top_p <= 1, top_k >= 0)") from None


__all__ = ["SeerIntegrationError", "process_slice", "rows_from_groups", "sampling_from_settings",
           "unique_groups"]
