"""Test helper: the ``ChunkFinished`` an engine would send for a chunk's output."""

from __future__ import annotations

from seer.protocol import ChunkFinished, pack_logprobs, pack_token_ids


def finished(engine_id: int, task_id: int, token_ids: list[int], logprobs: list[float], finish_reason: str,
             kv_saved_tokens: int = 0) -> ChunkFinished:
    """The message a chunk that produced ``token_ids`` ends with (no prompt or timing details)."""
    return ChunkFinished(engine_id=engine_id, task_id=task_id, token_ids=pack_token_ids(token_ids),
                         logprobs=pack_logprobs(logprobs), finish_reason=finish_reason,  # type: ignore[arg-type]
                         num_prompt_tokens=0, num_cached_tokens=0, elapsed_ms=0.0, kv_saved_tokens=kv_saved_tokens)
