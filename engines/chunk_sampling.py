"""What a chunk's vLLM request carries for seeded sampling and drafting.

Owns one decision of the vLLM backend, kept pure (plain values in, plain values out; no
vLLM import) so it is tested without an engine: from a ``ChunkTask`` and the engine's
speculative method, the seed vLLM gets and the ``SamplingParams.extra_args`` keys that
steer Seer's code inside vLLM.

A chunk *drafts* when its engine runs speculative decoding and the chunk's rollout did not
turn drafting off (``ChunkTask.draft``). Then:

* its seed is re-derived per chunk (``chunk_seed``): speculative steps are not
  position-keyed (engines/vllm_plugin.py), so without it every chunk would replay its
  sample's random stream from the start;
* with grouped SD it carries the proposer's arguments (``EXTRA_ARGS_KEY``); rows without
  them never get drafts (engines/proposer.py).

A chunk that does not draft keeps the sample's own seed and, when seeded, carries its
response offset (``POSITION_KEY``): vLLM's sampler then draws the token at response
position p from a generator keyed by (seed, p), the same under every policy, chunk size,
migration and engine count. On grouped-SD engines such a chunk's rows get no drafts;
vLLM still runs every step through its rejection sampler, where a row without drafts
draws one value per step like a plain step, so the plugin re-keys it there too
(engines/vllm_plugin.py), whatever other rows of the step draft.
"""

from __future__ import annotations

import hashlib
from typing import Any

from seer.engines.proposer import EXTRA_ARGS_KEY, draft_extra_args
from seer.engines.vllm_plugin import POSITION_KEY
from seer.protocol import ChunkTask


def chunk_seed(sample_seed: int, num_generated: int) -> int:
    """The vLLM seed of a chunk that starts after ``num_generated`` tokens when sampling is
    not position-keyed (speculative decoding): the first chunk keeps the sample seed, later
    chunks get fresh reproducible 62-bit seeds."""
    if num_generated == 0:
        return sample_seed
    digest = hashlib.blake2b(f"{sample_seed}@{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def drafts(task: ChunkTask, speculative_method: str | None) -> bool:
    """Does this chunk run with speculative decoding? ``speculative_method`` is the engine's
    (``None`` or "off": no SD). Only grouped SD honours ``task.draft``: vLLM's own drafters
    ("ngram", "suffix") draft for every request (the control plane refuses a rollout that
    asks otherwise of them), so their chunks keep the drafting seeds either way."""
    if speculative_method in (None, "off"):
        return False
    return task.draft if speculative_method == "grouped" else True


def vllm_seed(task: ChunkTask, speculative_method: str | None) -> int | None:
    """The seed to hand vLLM for this chunk (None: unseeded)."""
    seed = task.sampling.seed
    if seed is not None and drafts(task, speculative_method):
        return chunk_seed(seed, task.num_generated_tokens)
    return seed


def sampling_extras(task: ChunkTask, speculative_method: str | None) -> dict[str, Any]:
    """The Seer keys of this chunk's ``SamplingParams.extra_args`` (the KV connector's
    ``kv_transfer_params`` is added by the backend)."""
    extra: dict[str, Any] = {}
    drafting = drafts(task, speculative_method)
    if not drafting and task.sampling.seed is not None:
        extra[POSITION_KEY] = task.num_generated_tokens
    if drafting and speculative_method == "grouped":
        # Read by the proposer in the worker (runner.requests[rid].sampling_params).
        extra[EXTRA_ARGS_KEY] = draft_extra_args(task.group_id, task.request_id, task.num_generated_tokens,
                                                 task.probe)
    return extra


__all__ = ["chunk_seed", "drafts", "sampling_extras", "vllm_seed"]
