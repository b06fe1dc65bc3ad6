"""Whether an engine's ``ChunkFinished`` can be applied to the chunk it answers.

Owns ``refuse_result``: a pure check of a result against the chunk the control plane sent
(its budget, the request's context) and the engine's hello (its vocabulary). A result
that fails it is never applied: the server treats it as a failed chunk (the request goes
back to the buffer from its last good chunk, counted as one failure; event
``chunk_result_rejected``) instead of letting malformed arrays raise halfway through
applying it, which left the chunk in flight with no deadline, or letting impossible
values into a sample (more tokens than the budget, ids outside the vocabulary, a KV
save past the context, a negative token count).

Timings (``elapsed_ms``, ``kv_load_ms``) are not checked here: they feed logs and the
chunk deadlines, which ignore values that are not finite and non-negative
(``deadlines.py``).
"""

from __future__ import annotations

from array import array

from seer.protocol import ChunkFinished

_ITEM_BYTES = 4  # int32 token ids, float32 logprobs
# Token counts that feed Prometheus counters and the KV-transfer log: a negative one made
# the counter raise after the chunk was half applied (found by tests/integration/test_engine_fuzz.py).
_COUNTS = ("num_prompt_tokens", "num_cached_tokens", "kv_loaded_tokens", "kv_load_failed_tokens")


def refuse_result(msg: ChunkFinished, *, budget_tokens: int, context_tokens: int, vocab_size: int) -> str:
    """Why ``msg`` cannot be the result of a chunk of ``budget_tokens`` tokens for a request
    with ``context_tokens`` tokens before it, on an engine with ``vocab_size`` ids ('' if it can)."""
    if len(msg.token_ids) % _ITEM_BYTES or len(msg.logprobs) % _ITEM_BYTES:
        return (f"token_ids ({len(msg.token_ids)} bytes) and logprobs ({len(msg.logprobs)} bytes) must be "
                "packed 4-byte arrays")
    num_tokens = len(msg.token_ids) // _ITEM_BYTES
    if len(msg.logprobs) // _ITEM_BYTES != num_tokens:
        return f"{num_tokens} token ids but {len(msg.logprobs) // _ITEM_BYTES} logprobs"
    if num_tokens > budget_tokens:
        return f"{num_tokens} tokens for a chunk of at most {budget_tokens}"
    if num_tokens:
        ids = array("i")
        ids.frombytes(msg.token_ids)
        if min(ids) < 0 or max(ids) >= vocab_size:
            return f"token ids from {min(ids)} to {max(ids)}, the engine's vocabulary is [0, {vocab_size})"
    for name in _COUNTS:
        if getattr(msg, name) < 0:
            return f"{name} {getattr(msg, name)} is negative"
    if not 0 <= msg.kv_saved_tokens <= context_tokens + num_tokens:
        return f"kv_saved_tokens {msg.kv_saved_tokens} outside [0, {context_tokens + num_tokens}] (the context)"
    return ""
