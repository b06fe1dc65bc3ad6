"""A chunk as the engine receives it: the ``ChunkTask`` built from a request's state.

Owns the restating of a sample's whole-request sampling for one chunk of it (what is left
of ``min_tokens``, the sample's own seed on every chunk), the packing of its context
(prompt + generated so far) into the wire's int32 array, extended only by what is new,
whether a chunk is continued (``chunk_continues``) and the appending of a finished
chunk's tokens (``absorb_chunk``).
Pure: the scheduler (``scheduler.py``) decides the chunk, this module only writes it down.
"""

from __future__ import annotations

import msgspec

from seer.controlplane.state import Request
from seer.protocol import ChunkTask, EngineSampling, KVDescriptor, pack_token_ids


def build_chunk_task(request: Request, task_id: int, max_tokens: int, ignore_eos: bool, kv: KVDescriptor | None,
                     probe: bool) -> ChunkTask:
    """The task for a chunk of ``max_tokens`` of ``request``; ``kv``: what the engine loads
    and saves through the host pool (None: nothing); ``probe``: its group's probe."""
    s = request.sampling
    return ChunkTask(
        task_id=task_id,
        request_id=request.request_id,
        group_id=request.group.group_id,
        prompt_token_ids=packed_context(request),
        sampling=EngineSampling(
            max_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            # Whole-request promises, restated for what is left of the request.
            min_tokens=min(max_tokens, max(0, s.min_tokens - request.num_generated_tokens)),
            # The sample's own seed on every chunk: engines key sampling by (seed,
            # response position = num_generated_tokens + offset), so a seeded sample is
            # the same under every policy, chunk size and migration (docs/client.md).
            seed=s.seed,
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=ignore_eos,
        ),
        # A trajectory's turn may stop at any step, and its next turn continues it.
        kv=kv if kv is None or request.trajectory is None or not kv.save else msgspec.structs.replace(
            kv, save_each_step=True),
        # For the engine's drafter: where the chunk starts in the response, and
        # whether it is its group's probe (more drafts: the paper's lambda).
        num_generated_tokens=request.num_generated_tokens,
        probe=probe,
        # The rollout's speculative switch (RolloutRequest.speculative).
        draft=request.group.rollout.speculative,
    )


def packed_context(request: Request) -> bytes:
    """Prompt + generated tokens as the wire's int32 array: the group's packed prompt and
    the request's packed output, each extended only by what is new."""
    group, prompt = request.group, request.prompt_token_ids
    cached = group.packed_prompt
    if cached is None or cached[0] is not prompt:
        cached = group.packed_prompt = (prompt, pack_token_ids(prompt))
    generated = request.generated_token_ids
    packed = request.packed_generated
    if packed is None:
        packed = request.packed_generated = bytearray()
    if len(packed) < 4 * len(generated):
        packed += pack_token_ids(generated[len(packed) // 4:])
    return cached[1] + packed


def chunk_continues(request: Request, max_tokens: int, max_model_len: int) -> bool:
    """Whether a chunk of ``max_tokens`` will be continued (its KV worth saving): the rest of
    its sample, or a trajectory's next turn within its context budget."""
    context = request.context_tokens
    if request.trajectory is not None:
        return context + max_tokens < min(max_model_len, request.trajectory.max_context_tokens)
    return max_tokens < request.remaining_tokens and context + max_tokens < max_model_len


def absorb_chunk(request: Request, wire_tokens: bytes, token_ids: list[int], logprobs: list[float]) -> None:
    """Append a finished chunk's tokens (``wire_tokens``: as they came, int32; ``token_ids``
    may be fewer, cut at a stop string) to its request."""
    packed = request.packed_generated
    if packed is not None and len(packed) == 4 * len(request.generated_token_ids):
        # The wire's bytes extend the request's packed output (``packed_context``) as they
        # came, instead of packing the list again.
        packed += wire_tokens if 4 * len(token_ids) == len(wire_tokens) else wire_tokens[:4 * len(token_ids)]
    request.generated_token_ids.extend(token_ids)
    request.logprobs.extend(logprobs)
