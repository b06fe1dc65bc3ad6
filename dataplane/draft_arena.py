"""The compiled draft index's arrays and its append kernels (numba): the layout, the
n-gram hash, and the loops that add a group's tokens and index their n-grams
(``_push``, ``_extend``), grow the table (``_rehash``) and read a sequence back
(``_tail``). ``seer.dataplane.draft_search`` drafts from these arrays;
``seer.dataplane.draft_index.NativeGroupIndex`` holds them and calls both.

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

Argument counts are kept small on purpose: numba's dispatch costs ~0.1 µs per argument,
which is most of the cost of a one-token append.
"""

from __future__ import annotations

import numba
import numpy as np

_SEED = np.uint64(0xCBF29CE484222325)  # FNV-1a offset basis and prime
_PRIME = np.uint64(0x100000001B3)
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
