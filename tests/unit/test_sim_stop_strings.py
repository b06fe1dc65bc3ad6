"""The simulated engine honours stop strings as vLLM does (issue 38, point 6; docs/client.md
says they work under every policy): the chunk ends with the token that completed the
first stop string, with finish reason "stop", and not before ``min_tokens`` tokens."""

from __future__ import annotations

import asyncio

from seer.controlplane.tokenizer import ByteTokenizer
from seer.engines.sim_backend import SimBackend
from seer.protocol import ChunkTask, EngineSampling, pack_token_ids


def _generate(stop: list[str], max_tokens: int = 60, min_tokens: int = 0, seed: int = 5):
    async def run():
        backend = SimBackend(step_s=0.0, mean_output_tokens=10_000, max_model_len=4096)
        await backend.start()
        try:
            sampling = EngineSampling(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                                      min_tokens=min_tokens, seed=seed, stop=stop, stop_token_ids=[],
                                      ignore_eos=True)
            task = ChunkTask(task_id=1, request_id="r", group_id="g", prompt_token_ids=pack_token_ids([1, 70, 71]),
                             sampling=sampling)
            return await backend.generate(task)
        finally:
            await backend.shutdown()

    return asyncio.run(run())


def test_a_stop_string_ends_the_chunk_with_the_token_that_completed_it():
    """Without stop strings the chunk runs to max_tokens; with a two-character piece of that
    text as a stop string, the chunk ends right after its first occurrence, reason "stop"."""
    decode = ByteTokenizer().decode
    free = _generate([])
    text = decode(free.token_ids)
    assert free.finish_reason == "length" and len(text) == 60
    stop = text[20:22]
    first_end = text.find(stop) + len(stop)
    out = _generate([stop, "\x00never"])
    assert out.finish_reason == "stop"
    assert decode(out.token_ids) == text[:first_end]
    assert out.token_ids == free.token_ids[:first_end]  # same tokens up to the stop: seeded, schedule-free


def test_min_tokens_holds_stop_strings_back():
    """A stop string that completes within the first ``min_tokens`` tokens does not stop the
    chunk; the first occurrence ending after them does (vLLM's min_tokens rule)."""
    decode = ByteTokenizer().decode
    text = decode(_generate([]).token_ids)
    # A character that occurs within the first 10 tokens and again later (seeded: fixed).
    stop = next(c for c in text[:10] if text.find(c, 10) != -1)
    later = text.find(stop, 10)  # its first occurrence completing after 10 tokens (min_tokens = 10)
    out = _generate([stop], min_tokens=10)
    assert out.finish_reason == "stop" and len(out.token_ids) == later + 1
    assert len(_generate([stop]).token_ids) == text.find(stop) + 1 < later + 1  # without min_tokens: the first


def test_the_stop_window_only_looks_at_text_ending_in_the_new_characters():
    """``completes_stop`` finds a stop string that ends in the new text, also one that began
    before it, and never one that ended earlier (it was found, or not, then)."""
    from seer.engines.sim_backend import completes_stop

    assert completes_stop("xxab", 1, ["ab"])
    assert not completes_stop("abxx", 1, ["ab"])
    assert completes_stop("xabc", 1, ["abc"])
    assert not completes_stop("xabc", 0, ["abc"])
