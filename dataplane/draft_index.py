"""The compiled draft index: one group's sequences and n-gram index in flat arrays, with
the append and draft loops compiled by numba (``DraftStoreConfig.index = "native"``).

Owns ``NativeGroupIndex`` (the interface of ``drafts._GroupIndex`` over the arrays: slots,
growth, the calls into the kernels); the array layout and the append kernels are
``seer.dataplane.draft_arena``, the draft kernel and its work arrays (``DraftScratch``,
re-exported here) ``seer.dataplane.draft_search``. ``seer.dataplane.drafts`` owns the
interface and the pure-Python index that defines what a draft is. For the same appends
and queries the two return the same drafts, token for token and bit for bit in the
probabilities (``tests/unit/test_draft_index.py`` checks it on random sequences). This
one exists for speed (``benchmarks/draft_store_speed.py``).

Capacities grow by doubling from Python (``NativeGroupIndex._grow``) before a kernel runs,
so the append kernel never allocates. Memory per token: 4·(4 + W) bytes of arena plus the
table (16 bytes a slot, at most 60 % full, one key per distinct n-gram): 60-260 bytes at
W = 8, freed with the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from seer.dataplane.draft_arena import _COLS, _extend, _push, _rehash, _tail
from seer.dataplane.draft_search import _INFO, DraftScratch, _draft
from seer.dataplane.drafts import _PROMPT, _GroupIndex  # noqa: E402  (drafts imports this module lazily)

__all__ = ["DraftScratch", "NativeGroupIndex"]

_MAX_LOAD = 0.6  # table load factor before it doubles


class NativeGroupIndex:
    """One group's sequences and index in arrays; the interface of ``drafts._GroupIndex``."""

    __slots__ = ("lo", "hi", "width", "slot_of", "num_tokens", "_lengths", "_arena", "_table", "_slots", "_room",
                 "_scratch")

    def __init__(self, lo: int, hi: int, scratch: DraftScratch | None = None) -> None:
        self.lo, self.hi, self.width = lo, hi, hi - lo + 1
        self.slot_of: dict[str, int] = {}
        self.num_tokens = 0
        self._lengths: list[int] = []
        self._arena = np.empty((64, _COLS + self.width), np.int32)
        self._table = np.zeros((256, 2), np.int64)
        self._room = 0  # tokens that surely fit before the arena or table must grow
        self._slots = np.zeros((5, 4), np.int64)
        self._slots[0] = (0, 0, lo, hi)
        self._scratch = scratch if scratch is not None else DraftScratch(hi)

    # ---- sequences --------------------------------------------------------------

    def slot(self, key: str, limit: int, history: bool = False) -> int:
        slot = self.slot_of.get(key)
        if slot is None:
            slot = len(self._lengths)
            if slot >= limit:
                raise ValueError(f"group already holds {limit} sequences")
            if slot + 1 == len(self._slots):
                self._slots = np.concatenate([self._slots, np.zeros_like(self._slots)])
            self._slots[slot + 1] = (-1, 0, 1 if history else 0, 0)
            self.slot_of[key] = slot
            self._lengths.append(0)
        return slot

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def extend(self, slot: int, tokens: Sequence[int]) -> None:
        count = len(tokens)
        if count > self._room:
            self._grow(count)
        if count == 1:
            _push(self._arena, self._table, self._slots, slot, int(tokens[0]))
        elif count:
            _extend(self._arena, self._table, self._slots, slot, np.ascontiguousarray(tokens, np.int32).ravel())
        self._room -= count
        self._lengths[slot] += count
        self.num_tokens += count

    def tail(self, slot: int, count: int) -> list[int]:
        count = min(count, self._lengths[slot])
        if count <= 0:
            return []
        out = np.empty(count, np.int32)
        _tail(self._arena, int(self._slots[slot + 1, 0]), out)
        return out.tolist()

    def sequence(self, slot: int) -> list[int]:
        return self.tail(slot, self._lengths[slot])

    def _grow(self, count: int) -> None:
        """Room for ``count`` more tokens: arena rows, and table slots for the at most
        2·W keys a token adds (its own n-grams and one expanded occurrence per length)."""
        need = self.num_tokens + count
        if need > len(self._arena):
            arena = np.empty((max(need, 2 * len(self._arena)), self._arena.shape[1]), np.int32)
            arena[:self.num_tokens] = self._arena[:self.num_tokens]
            self._arena = arena
        keys = int(self._slots[0, 1])
        per_token = 2 * self.width
        if keys + count * per_token > _MAX_LOAD * len(self._table):
            size = len(self._table)
            while keys + count * per_token > _MAX_LOAD * size:
                size *= 2
            table = np.zeros((size, 2), np.int64)
            _rehash(self._table, table)
            self._table = table
        self._room = min(len(self._arena) - self.num_tokens, int((_MAX_LOAD * len(self._table) - keys) // per_token))

    # ---- drafting ---------------------------------------------------------------

    def draft(self, context: Sequence[int] | None, lo: int, max_spec: int, top_k: int, min_prob: float,
              max_occ: int, hi: int, own: str | None = None) -> tuple[list[list[int]], list[list[float]], int,
                                                                         tuple[int, int]]:
        """(paths, probs, matched length, (history continuations, all continuations)
        through path 0's first token); no draft: ([], [], 0, (0, 0)). The context is
        ``context`` or, when it is None, sequence ``own``'s tokens preceded by the
        prompt's (``own_context``)."""
        s = self._scratch.ensure(max_occ, max_spec, top_k)
        if hi != self.hi:  # a narrower pattern bound: the context the Python index would see
            context = self.own_context(own, hi) if context is None else context
        if context is None:
            slot = self.slot_of.get(own, -1) if own is not None else -1
            ctx, m = s.ctx[:hi], -1
            num_paths = _draft(self._arena, self._table, self._slots, ctx, m, slot, self.slot_of.get(_PROMPT, -1),
                               lo, max_spec, top_k, max_occ, min_prob, s.work, s.fwork, s.out)
        else:
            if len(context) > hi:
                context = context[-hi:]
            if len(context) == 0:
                return [], [], 0, (0, 0)
            ctx = np.ascontiguousarray(context, np.int32)
            num_paths = _draft(self._arena, self._table, self._slots, ctx, len(ctx), -1, -1, lo, max_spec, top_k,
                               max_occ, min_prob, s.work, s.fwork, s.out)
        if num_paths == 0:
            return [], [], 0, (0, 0)
        out = s.out
        if num_paths == 1:
            n = int(out[_INFO])
            base = _INFO + top_k
            return ([out[base:base + n].tolist()], [s.fwork[:n, 2].tolist()], int(out[0]),
                    (int(out[2]), int(out[3])))
        head = out[:_INFO + num_paths].tolist()
        base = _INFO + top_k
        paths, probs = [], []
        for k, n in enumerate(head[_INFO:]):
            paths.append(out[base + k * max_spec:base + k * max_spec + n].tolist())
            probs.append(s.fwork[k * max_spec:k * max_spec + n, 2].tolist())
        return paths, probs, head[0], (head[2], head[3])

    # The same reading of ``slot_of`` and ``tail`` as the Python index's.
    own_context = _GroupIndex.own_context
