"""Turning a trainer's RolloutRequest into scheduler state, or a precise refusal.

Pure: given the request, the tokenizer, the limits and the engines' capabilities, it
returns a ``Rollout`` or raises ``RequestRejected`` whose message names the offending
prompt or field and the fix. Nothing is partially accepted: a rollout is all or none.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from seer.controlplane.policies import POLICIES
from seer.controlplane.state import Group, Request, Rollout, derive_sample_seed
from seer.controlplane.tokenizer import Tokenizer
from seer.protocol import Prompt, RolloutRequest


class RequestRejected(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    max_group_size: int
    max_prompts: int
    max_model_len: int
    vocab_size: int


def build_rollout(req: RolloutRequest, tokenizer: Tokenizer, limits: Limits, policy: str, now_s: float) -> Rollout:
    if not req.prompts:
        raise RequestRejected("empty_rollout", "the rollout has no prompts; send at least one prompt")
    if len(req.prompts) > limits.max_prompts:
        raise RequestRejected(
            "too_many_prompts",
            f"the rollout has {len(req.prompts)} prompts, the limit is {limits.max_prompts} "
            "(server.max_prompts_per_rollout); split it into several rollouts",
        )
    if not 1 <= req.group_size <= limits.max_group_size:
        raise RequestRejected(
            "bad_group_size",
            f"group_size must be between 1 and {limits.max_group_size} (server.max_group_size), "
            f"got {req.group_size}",
        )
    if policy not in POLICIES:
        raise RequestRejected("unknown_policy", f"unknown policy {policy!r}; available: {', '.join(sorted(POLICIES))}")
    sampling = req.sampling
    if sampling.min_tokens > sampling.max_tokens:
        raise RequestRejected(
            "bad_sampling",
            f"sampling.min_tokens ({sampling.min_tokens}) exceeds sampling.max_tokens ({sampling.max_tokens})",
        )
    for token_id in sampling.stop_token_ids:
        if token_id >= limits.vocab_size:
            raise RequestRejected(
                "bad_sampling", f"sampling.stop_token_ids has {token_id}, outside the vocabulary (size {limits.vocab_size})"
            )

    rollout = Rollout(rollout_id=req.rollout_id, policy=policy, accepted_s=now_s)
    for index, prompt in enumerate(req.prompts):
        prompt_id = prompt.id if prompt.id is not None else str(index)
        token_ids = _tokenize(prompt, index, prompt_id, tokenizer, limits)
        budget = limits.max_model_len - len(token_ids)
        if budget < 1:
            raise RequestRejected(
                "prompt_too_long",
                f"prompt {index} (id {prompt_id!r}) has {len(token_ids)} tokens; the model allows "
                f"{limits.max_model_len} in all (model.max_model_len), leaving no room to generate. "
                "Shorten the prompt or raise model.max_model_len",
            )
        if sampling.max_tokens > budget:
            raise RequestRejected(
                "prompt_too_long",
                f"prompt {index} (id {prompt_id!r}) has {len(token_ids)} tokens and max_tokens is "
                f"{sampling.max_tokens}: {len(token_ids) + sampling.max_tokens} > model.max_model_len "
                f"{limits.max_model_len}. Lower max_tokens to at most {budget} or shorten the prompt",
            )
        group = Group(group_id=f"{req.rollout_id}/{index}", rollout=rollout, group_index=index, prompt_id=prompt_id)
        for j in range(req.group_size):
            group.requests.append(
                Request(
                    request_id=f"{req.rollout_id}/{index}/{j}",
                    group=group,
                    sample_index=j,
                    prompt_token_ids=token_ids,
                    sampling=msgspec.structs.replace(sampling, seed=derive_sample_seed(sampling.seed, index, j)),
                )
            )
        rollout.groups.append(group)
    return rollout


def _tokenize(prompt: Prompt, index: int, prompt_id: str, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if getattr(prompt, k) is not None]
    where = f"prompt {index} (id {prompt_id!r})"
    if len(given) != 1:
        raise RequestRejected(
            "bad_prompt",
            f"{where} must have exactly one of `prompt`, `messages`, `prompt_token_ids`; it has "
            f"{', '.join(given) or 'none'}",
        )
    if prompt.prompt_token_ids is not None:
        ids = prompt.prompt_token_ids
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestRejected(
                "bad_token_ids",
                f"{where} has token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})"
                + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""),
            )
    elif prompt.messages is not None:
        if not prompt.messages:
            raise RequestRejected("bad_prompt", f"{where} has an empty `messages` list")
        try:
            ids = tokenizer.encode_chat(prompt.messages)
        except ValueError as exc:
            raise RequestRejected("bad_prompt", f"{where}: {exc}") from None
    else:
        ids = tokenizer.encode(prompt.prompt or "")
    if not ids:
        raise RequestRejected("bad_prompt", f"{where} is empty; it needs at least one token")
    return list(ids)
