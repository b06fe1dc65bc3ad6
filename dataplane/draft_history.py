"""Drafts from history: the responses of a prompt's earlier rollouts, kept to seed the
draft index when the prompt comes back (RL revisits its prompts every epoch; DAS, MLSys
2026, drafts from them).

Owns a bounded map from a prompt (its token ids; the same tokens are the same prompt,
whatever the group or rollout is called) to the responses of its latest rollout that
this engine saw, tagged with the weights version that generated them, and the rule that
decides which of them are still worth drafting from. Pure: no clock, no I/O.

- **Bounded**: at most ``max_tokens`` response tokens in all (int32, 4 bytes each) and
  ``max_responses`` per prompt; the prompt used least recently goes first.
- **Dropped when the weights moved too far, as measured**: a history entry's age is the
  number of weight updates since it was generated. ``observe`` takes the verifier's
  verdict on drafts whose first token came mostly from history, per age, and on the
  other drafts ("live": the group's own samples). History of an age whose measured
  acceptance is credibly below the live drafts' (its upper credible bound, mean + 2
  standard deviations of the Beta posterior, under the live mean) is no longer handed
  out, and its entries are dropped: once drafts from it dilute the group's own, it does
  more harm than good. No age limit is assumed; with unchanged weights (age 0) the same
  test applies.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from seer.specdecode import AcceptanceTracker

_LIVE = "live"


def prompt_key(prompt_token_ids: Sequence[int]) -> bytes:
    """A prompt's identity: a digest of its token ids."""
    return hashlib.blake2b(array("i", prompt_token_ids).tobytes(), digest_size=16).digest()


class _Entry:
    __slots__ = ("weights_version", "responses", "num_tokens")

    def __init__(self, weights_version: int, responses: list[array]) -> None:
        self.weights_version = weights_version
        self.responses = responses
        self.num_tokens = sum(len(r) for r in responses)


class DraftHistory:
    def __init__(self, max_tokens: int = 4_000_000, max_responses: int = 16) -> None:
        if max_tokens < 0 or max_responses < 1:
            raise ValueError(f"need max_tokens >= 0 and max_responses >= 1, got {max_tokens}, {max_responses}")
        self.max_tokens = max_tokens
        self.max_responses = max_responses
        self.weights_version = 0  # the engine's current weights: ages count from it
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.num_tokens = 0
        self.acceptance = AcceptanceTracker(prior_alpha=0.5, prior_strength=16.0)
        # History this many updates old or older is not used (None: no limit measured yet).
        self.retired_age: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def set_weights_version(self, weights_version: int) -> None:
        self.weights_version = max(self.weights_version, weights_version)
        self._drop_retired()

    def record(self, prompt_token_ids: Sequence[int], responses: Sequence[Sequence[int]],
               weights_version: int) -> None:
        """A rollout of this prompt ended (on this engine): keep its longest responses,
        replacing what an older rollout left."""
        kept = sorted((array("i", r) for r in responses if len(r)), key=len, reverse=True)[:self.max_responses]
        key = prompt_key(prompt_token_ids)
        old = self._entries.get(key)
        if old is not None and old.weights_version > weights_version:
            return  # a newer rollout is already here
        if old is not None:
            self.num_tokens -= self._entries.pop(key).num_tokens
        if not kept or not self._usable(self.weights_version - weights_version):
            return
        entry = _Entry(weights_version, kept)
        self._entries[key] = entry
        self.num_tokens += entry.num_tokens
        while self.num_tokens > self.max_tokens and self._entries:
            _, dropped = self._entries.popitem(last=False)
            self.num_tokens -= dropped.num_tokens

    def lookup(self, prompt_token_ids: Sequence[int]) -> tuple[list[array], int]:
        """(responses, age) of the prompt's latest rollout, or ([], -1) if there is none
        or history that old is retired."""
        key = prompt_key(prompt_token_ids)
        entry = self._entries.get(key)
        if entry is None:
            return [], -1
        age = self.weights_version - entry.weights_version
        if age < 0 or not self._usable(age):
            return [], -1
        self._entries.move_to_end(key)
        return list(entry.responses), age

    def observe(self, age: int | None, proposed: int, accepted: int) -> None:
        """The verifier's verdict on one draft of ``proposed`` tokens, ``accepted`` of
        them accepted: from history of ``age`` (None: a live draft)."""
        self.acceptance.record(_LIVE if age is None else f"age:{age}", proposed, accepted)
        if age is not None and self._usable(age) and not self.useful(age):
            self.retired_age = age
            self._drop_retired()

    def useful(self, age: int) -> bool:
        """Is history of this age credibly no worse than live drafts (its acceptance's
        upper credible bound at least the live mean)?"""
        live = self.acceptance.alpha(_LIVE)
        key = f"age:{age}"
        mean = self.acceptance.alpha(key)
        n = self.acceptance.prior_strength + self.acceptance.evidence(key)
        return mean + 2.0 * (mean * (1.0 - mean) / (n + 1.0)) ** 0.5 >= live

    def _usable(self, age: int) -> bool:
        # Older history is taken to be no better than younger: once an age is retired,
        # every older one is too.
        return self.retired_age is None or age < self.retired_age

    def _drop_retired(self) -> None:
        for key in [k for k, e in self._entries.items() if not self._usable(self.weights_version - e.weights_version)]:
            self.num_tokens -= self._entries.pop(key).num_tokens
