"""Stop strings that straddle a chunk boundary.

Within a chunk the engine finds stop strings itself (vLLM matches them on the text it
generated in *that* request). A chunked request's next chunk is a new engine request
whose prompt holds everything generated so far, so a stop string that begins in one
chunk and ends in the next is invisible to the engine. This module finds it in the
control plane, after the chunk: it decodes the tail of what was generated before plus the
new tokens and looks for a stop string that ends inside the new text.

The result has vLLM's token-level meaning: the sample keeps every token up to and
including the one that completed the stop string and finishes with reason "stop".
Decoding pieces and joining them equals decoding the whole for byte-level BPE tokenizers
(SmolLM2, Llama 3, Qwen); the tail is long enough to hold the longest stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seer.controlplane.state import Request

Decode = Callable[[list[int]], str]


def straddling_stop(decode: Decode, previous: Sequence[int], new: Sequence[int], stops: Sequence[str]) -> int | None:
    """How many of ``new`` tokens to keep if a stop string begins in ``previous`` (the
    request's earlier generated tokens) and ends in ``new``; None if none does."""
    if not stops or not previous or not new:
        return None
    longest = max(len(s) for s in stops)
    # A token decodes to at least one character here (byte-level BPE, possibly a partial
    # UTF-8 sequence shown as one replacement character), so this many tokens cover it.
    tail = list(previous[-(longest + 1):])
    head_text = decode(tail)
    text = decode(tail + list(new))
    start = max(0, len(head_text) - longest + 1)
    best: int | None = None
    for stop in stops:
        i = text.find(stop, start)
        while i != -1 and i < len(head_text):  # must begin before the new text
            end = i + len(stop)
            if end > len(head_text):
                best = end if best is None else min(best, end)
                break
            i = text.find(stop, i + 1)
    if best is None:
        return None
    # The first token whose text completes the match.
    for k in range(1, len(new) + 1):
        if len(decode(tail + list(new[:k]))) >= best:
            return k
    return len(new)


def cut_at_stop(decode: Decode, request: Request, token_ids: list[int], logprobs: list[float],
                finish_reason: str) -> tuple[list[int], list[float], str]:
    """A finished chunk's tokens, logprobs and finish reason, cut after a stop string that
    straddles its start (also after a "stop": the engine may have stopped at a later stop
    string, or EOS, while an earlier one straddled the edge). A trajectory's stop strings
    are matched within its current turn only."""
    stops = request.sampling.stop
    if finish_reason not in ("length", "stop") or not stops:
        return token_ids, logprobs, finish_reason
    turn = request.trajectory.turn_start if request.trajectory is not None else 0
    keep = straddling_stop(decode, request.generated_token_ids[turn:], token_ids, stops)
    if keep is None:
        return token_ids, logprobs, finish_reason
    return token_ids[:keep], logprobs[:keep], "stop"
