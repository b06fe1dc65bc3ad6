"""The compiled draft index: one group's sequences and n-gram index in flat arrays, with
the append and draft loops compiled by numba (``DraftStoreConfig.index = "native"``).

Owns the array layout and the kernels; ``seer.dataplane.drafts`` owns the interface and
the pure-Python index that defines what a draft is. For the same appends and queries the
two return the same drafts, token for token and bit for bit in the probabilities
(``tests/unit/test_draft_index.py`` checks it on random sequences). This one exists for
speed (``benchmarks/draft_store_speed.py``).

Layout (g = a token's arrival number in the group, over all its sequences):

- ``arena[g] = (token, previous g of its sequence, next g of its sequence, its slot,
  occurrence links...)``, -1 where there is none. A sequence is a linked list through
  the arena, so a group's sequences may grow interleaved in any order.
- An n-gram occurrence is the token g where it ends; its entry number is
  ``g * W + (n - lo)`` (W = hi - lo + 1 lengths are indexed). ``arena[g, 4 + n - lo]``
  links to the previous (older) occurrence of the same n-gram, so each n-gram's
  occurrences form a list, newest first: the order the Python index reads them in.
- ``table[i] = (hash, newest entry)``: open addressing from a 64-bit hash of the n-gram.
  A hash is never trusted alone: a hit is compared token by token (walking the arena
  backwards), so two n-grams with one hash never share a list.
- ``slots[0] = (tokens, keys in the table, lo, hi)``; ``slots[1 + s] = (last g, length,
  is history, 0)`` for sequence s.

Capacities grow by doubling from Python (``NativeGroupIndex._grow``) before a kernel runs,
so the append kernel never allocates. Memory per token: 4·(4 + W) bytes of arena plus the
table (16 bytes a slot, at most 60 % full, one key per distinct n-gram): 60-260 bytes at
W = 8, freed with the group.

Argument counts are kept small on purpose: numba's dispatch costs ~0.1 µs per argument,
which is most of the cost of a one-token append.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from seer.dataplane.drafts import _PROMPT, _GroupIndex  # noqa: E402  (drafts imports this module lazily)
_SEED = np.uint64(0xCBF29CE484222325)  # FNV-1a offset basis and prime
_PRIME = np.uint64(0x100000001B3)
_MAX_LOAD = 0.6  # table load factor before it doubles
_COLS = 4  # arena columns before the occurrence links

_I32 = numba.int32
_I64 = numba.int64
_ARENA = _I32[:, ::1]
_TABLE = _I64[:, ::1]
_SLOTS = _I64[:, ::1]


@numba.njit(_I64(numba.uint64), cache=True)
def _finish(h):  # pragma: no cover - compiled
    """splitmix64's finaliser (spreads FNV's bits over the table index); never 0 (empty)."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    h = (h ^ (h >> np.uint64(31))) | np.uint64(1)
    return np.int64(h >> np.uint64(1)) | np.int64(1)  # positive, odd: a valid key


@numba.njit(_I64(_ARENA, _I64, _I64), cache=True)
def _key_at(arena, g, n):  # pragma: no cover - compiled
    """The table key of the n-gram ending at arena token g; 0 if its sequence is shorter."""
    h = _SEED
    cur = g
    for _ in range(n):
        if cur < 0:
            return 0
        h = (h ^ np.uint64(np.uint32(arena[cur, 0]))) * _PRIME
        cur = arena[cur, 1]
    return _finish(h)


@numba.njit(_I64(_ARENA, _TABLE, _SLOTS, _I64, _I64, _I64), cache=True)
def _insert(arena, table, slots, g, n, key):  # pragma: no cover - compiled
    """Index the n-gram ending at g (hash ``key``) as its newest occurrence. Returns -1
    if the n-gram was new, else its previous newest entry (now linked behind g's)."""
    lo = slots[0, 2]
    width = slots[0, 3] - lo + 1
    mask = table.shape[0] - 1
    entry = g * width + (n - lo)
    i = key & mask
    while True:
        k = table[i, 0]
        if k == 0:
            table[i, 0] = key
            table[i, 1] = entry
            arena[g, _COLS + n - lo] = -1
            slots[0, 1] += 1
            return -1
        if k == key:
            head = table[i, 1]
            if head % width == n - lo:
                # Same hash and length: the same n-gram only if the tokens agree.
                a = head // width
                b = g
                same = True
                for _ in range(n):
                    if arena[a, 0] != arena[b, 0]:
                        same = False
                        break
                    a = arena[a, 1]
                    b = arena[b, 1]
                if same:
                    arena[g, _COLS + n - lo] = head
                    table[i, 1] = entry
                    return head
        i = (i + 1) & mask


@numba.njit(numba.void(_ARENA, _TABLE, _SLOTS, _I64, _I64), cache=True)
def _push(arena, table, slots, slot, token):  # pragma: no cover - compiled
    """Append one token to sequence ``slot`` and index the n-grams it ends.

    Lazily: the n-gram of length n + 1 ending here is indexed only if its suffix of
    length n occurred before (a first occurrence's longer n-grams are all new, so
    nothing could match them yet). When an n-gram gets its second occurrence, the first
    one is extended to n + 1 ("expanded"). Invariant: an indexed n-gram whose list has
    two or more occurrences has every occurrence of every n-gram one token longer
    indexed; a one-occurrence list is a dead end the draft kernel extends by comparing
    tokens. The lists are the same as indexing every length, so are the drafts;
    indexing costs one hash insert per token plus one per repeated n-gram."""
    lo = slots[0, 2]
    hi = slots[0, 3]
    width = hi - lo + 1
    g = slots[0, 0]
    row = slot + 1
    last = slots[row, 0]
    arena[g, 0] = token
    arena[g, 1] = last
    arena[g, 2] = -1
    arena[g, 3] = slot
    if last >= 0:
        arena[last, 2] = g
    slots[row, 0] = g
    length = slots[row, 1] + 1
    slots[row, 1] = length
    slots[0, 0] = g + 1
    h = _SEED
    cur = g
    top = min(hi, length)
    for n in range(1, top + 1):
        h = (h ^ np.uint64(np.uint32(arena[cur, 0]))) * _PRIME
        if n >= lo:
            head = _insert(arena, table, slots, g, n, _finish(h))
            if head < 0:
                return  # new: every longer n-gram ending here is new too
            if n < hi and arena[head // width, _COLS + head % width] == -1:
                # The n-gram's first occurrence was a dead end: index its n + 1.
                old = head // width
                key = _key_at(arena, old, n + 1)
                if key != 0:
                    _insert(arena, table, slots, old, n + 1, key)
        if n < top:
            cur = arena[cur, 1]


@numba.njit(numba.void(_ARENA, _TABLE, _SLOTS, _I64, _I32[::1]), cache=True)
def _extend(arena, table, slots, slot, tokens):  # pragma: no cover - compiled
    for t in tokens:
        _push(arena, table, slots, slot, t)


@numba.njit(numba.void(_TABLE, _TABLE), cache=True)
def _rehash(table, new_table):  # pragma: no cover - compiled
    mask = new_table.shape[0] - 1
    for j in range(table.shape[0]):
        key = table[j, 0]
        if key == 0:
            continue
        i = key & mask
        while new_table[i, 0] != 0:
            i = (i + 1) & mask
        new_table[i, 0] = key
        new_table[i, 1] = table[j, 1]


@numba.njit(numba.void(_ARENA, _I64, _I32[::1]), cache=True)
def _tail(arena, last, out):  # pragma: no cover - compiled
    """The len(out) tokens of a sequence ending at arena token ``last``, in order."""
    cur = last
    for k in range(out.shape[0] - 1, -1, -1):
        out[k] = arena[cur, 0]
        cur = arena[cur, 1]


# Work array columns of _draft: the continuation trie (node 0: root), in insertion order.
_TOK, _CNT, _FIRST, _LAST, _NEXT, _HIST, _HSLOT, _ORDER, _HKEY, _HVAL = range(10)
_WORK_COLS = 10
# _draft's output: info, then path lengths, then path tokens (top_k x max_spec).
_INFO = 4


@numba.njit(_I64(_ARENA, _TABLE, _SLOTS, _I32[::1], _I64, _I64, _I64, _I64, _I64, _I64, _I64, numba.float64,
                 _I64[:, ::1], numba.float64[:, ::1], _I64[::1]),
            cache=True)
def _draft(arena, table, slots, ctx, m, own, prompt, lo, max_spec, top_k, max_occ, min_prob, work, fwork,
           out):  # pragma: no cover - compiled
    """Draft by the rule of ``seer.dataplane.drafts`` for the context ``ctx[:m]`` or, with
    m = -1, for sequence ``own``'s last tokens preceded by the end of sequence ``prompt``
    when it has fewer than hi (-1: no such sequence; the context is built in ``ctx``).
    Returns the number of paths (0: no draft).

    ``out = (matched length, occurrences read, continuations from history through path
    0's first token, all continuations through it, path lengths[top_k], path tokens
    [top_k x max_spec], the context's hashes[hi + 1])``; path probabilities go to
    ``fwork[:, 2]`` in the same order. ``work`` rows are trie nodes (columns ``_TOK`` ..
    ``_ORDER``) and, in ``_HKEY`` / ``_HVAL``, a hash from (parent, token) to child; a
    node's children keep insertion order (newest continuation first: the tie-break).
    Every hash slot used is set back to -1 before returning, so ``work[:, _HKEY]`` comes
    in and leaves all -1."""
    index_lo = slots[0, 2]
    hi = slots[0, 3]
    width = hi - index_lo + 1
    mask = table.shape[0] - 1
    hmask = work.shape[0] - 1
    for q in range(_INFO):
        out[q] = 0
    if m < 0:
        m = 0
        for seq in (own, prompt):
            if seq < 0 or m >= ctx.shape[0]:
                continue
            cur = slots[seq + 1, 0]
            take = min(ctx.shape[0] - m, slots[seq + 1, 1])
            # Shift what is there (own tokens) right, then fill in front of it.
            for q in range(m - 1, -1, -1):
                ctx[q + take] = ctx[q]
            for q in range(take - 1, -1, -1):
                ctx[q] = arena[cur, 0]
                cur = arena[cur, 1]
            m += take
    top = min(hi, m)
    hashes = out[out.shape[0] - hi - 1:]
    h = _SEED
    for n in range(1, top + 1):
        h = (h ^ np.uint64(np.uint32(ctx[m - n]))) * _PRIME
        hashes[n] = _finish(h)
    for n in range(top, lo - 1, -1):
        key = hashes[n]
        i = key & mask
        entry = np.int64(-1)
        while True:
            k = table[i, 0]
            if k == 0:
                break
            if k == key:
                head = table[i, 1]
                if head % width == n - index_lo:
                    cur = head // width
                    same = True
                    for j in range(n):
                        if arena[cur, 0] != ctx[m - 1 - j]:
                            same = False
                            break
                        cur = arena[cur, 1]
                    if same:
                        entry = head
                        break
            i = (i + 1) & mask
        if entry < 0:
            continue
        matched = n
        if arena[entry // width, _COLS + entry % width] == -1:
            # One occurrence: a longer context suffix can only occur here too (and is
            # not indexed, see _push), so the match extends as far as the tokens agree.
            cur = entry // width
            for j in range(n):
                cur = arena[cur, 1]
            while matched < top and cur >= 0 and arena[cur, 0] == ctx[m - 1 - matched]:
                matched += 1
                cur = arena[cur, 1]
        # The continuations of the newest max_occ occurrences, into the trie.
        num_nodes = 1
        work[0, _CNT] = 0
        work[0, _FIRST] = -1
        work[0, _LAST] = -1
        work[0, _HIST] = 0
        read = 0
        while entry >= 0 and read < max_occ:
            g = entry // width
            read += 1
            cur = arena[g, 2]
            if cur >= 0:
                hist = slots[arena[g, 3] + 1, 2]
                parent = 0
                for _ in range(max_spec):
                    if cur < 0:
                        break
                    tok = arena[cur, 0]
                    hk = (np.int64(parent) << 32) | np.int64(np.uint32(tok))
                    j = np.int64((np.uint64(hk) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)) & hmask
                    child = -1
                    while work[j, _HKEY] != -1:
                        if work[j, _HKEY] == hk:
                            child = work[j, _HVAL]
                            break
                        j = (j + 1) & hmask
                    if child < 0:
                        child = num_nodes
                        num_nodes += 1
                        work[j, _HKEY] = hk
                        work[j, _HVAL] = child
                        work[child, _TOK] = tok
                        work[child, _CNT] = 0
                        work[child, _FIRST] = -1
                        work[child, _LAST] = -1
                        work[child, _NEXT] = -1
                        work[child, _HIST] = 0
                        work[child, _HSLOT] = j
                        if work[parent, _LAST] < 0:
                            work[parent, _FIRST] = child
                        else:
                            work[work[parent, _LAST], _NEXT] = child
                        work[parent, _LAST] = child
                    work[child, _CNT] += 1
                    work[child, _HIST] += hist
                    parent = child
                    cur = arena[cur, 2]
            entry = arena[g, _COLS + entry % width]
        for nd in range(1, num_nodes):
            work[work[nd, _HSLOT], _HKEY] = -1
        if num_nodes == 1:
            continue  # no occurrence is followed by a token: try a shorter pattern
        # Probabilities (fwork[:, 0]), parents before children; below min_prob: cut (0).
        fwork[0, 0] = 1.0
        work[0, _ORDER] = 0
        num_order = 1
        pos = 0
        while pos < num_order:
            nd = work[pos, _ORDER]
            pos += 1
            total = 0
            c = work[nd, _FIRST]
            while c >= 0:
                total += work[c, _CNT]
                c = work[c, _NEXT]
            c = work[nd, _FIRST]
            while c >= 0:
                p = fwork[nd, 0] * work[c, _CNT] / total
                if p >= min_prob:
                    fwork[c, 0] = p
                    work[num_order, _ORDER] = c
                    num_order += 1
                else:
                    fwork[c, 0] = 0.0
                c = work[c, _NEXT]
        for q in range(1, num_order):
            work[work[q, _ORDER], _HSLOT] = 0  # reused as "covered"
        out[0] = matched
        out[1] = read
        num_paths = 0
        base = _INFO + top_k
        for _ in range(top_k):
            # fwork[v, 1]: the most uncovered probability a path through v can still add.
            for q in range(num_order - 1, 0, -1):
                nd = work[q, _ORDER]
                below = 0.0
                c = work[nd, _FIRST]
                while c >= 0:
                    if fwork[c, 0] > 0.0 and fwork[c, 1] > below:
                        below = fwork[c, 1]
                    c = work[c, _NEXT]
                fwork[nd, 1] = (0.0 if work[nd, _HSLOT] else fwork[nd, 0]) + below
            length = 0
            nd = 0
            while True:
                pick = -1
                pick_best = 0.0
                c = work[nd, _FIRST]
                while c >= 0:
                    if fwork[c, 0] > 0.0 and fwork[c, 1] > pick_best:
                        pick = c
                        pick_best = fwork[c, 1]
                    c = work[c, _NEXT]
                if pick < 0:
                    break
                if num_paths == 0 and length == 0:
                    out[2] = work[pick, _HIST]
                    out[3] = work[pick, _CNT]
                slot = num_paths * max_spec + length
                out[base + slot] = work[pick, _TOK]
                fwork[slot, 2] = fwork[pick, 0]
                length += 1
                work[pick, _HSLOT] = 1
                nd = pick
            if length == 0:
                break
            out[_INFO + num_paths] = length
            num_paths += 1
        return num_paths
    return 0


class DraftScratch:
    """Work arrays of ``_draft``, shared by one store's groups (one draft at a time), sized
    for the largest request so far. ``out`` ends with the context's hashes (``hi`` is
    the store's longest pattern); ``ctx`` holds a context the kernel builds."""

    __slots__ = ("hi", "occ", "spec", "paths", "work", "fwork", "out", "ctx")

    def __init__(self, hi: int) -> None:
        self.hi = hi
        self.occ = self.spec = self.paths = 0
        self.ctx = np.empty(hi, np.int32)

    def ensure(self, max_occ: int, max_spec: int, top_k: int) -> DraftScratch:
        if max_occ <= self.occ and max_spec <= self.spec and top_k <= self.paths:
            return self
        self.occ, self.spec, self.paths = max(max_occ, self.occ), max(max_spec, self.spec), max(top_k, self.paths)
        nodes = self.occ * self.spec + 1
        outs = self.paths * self.spec
        rows = 1 << (2 * nodes - 1).bit_length()  # the (parent, token) hash: at most half full
        self.work = np.empty((rows, _WORK_COLS), np.int64)
        self.work[:, _HKEY] = -1
        self.fwork = np.empty((max(nodes, outs), 3), np.float64)
        self.out = np.empty(_INFO + self.paths + outs + self.hi + 1, np.int64)
        return self


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
