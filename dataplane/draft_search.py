"""The compiled draft index's draft kernel (numba): ``_draft`` matches the longest
indexed suffix of a context, gathers the continuations of its newest occurrences into a
trie, and picks the top-k paths by the rule of ``seer.dataplane.drafts`` (the same
drafts as the Python index, bit for bit); ``DraftScratch`` holds its work arrays. Reads
the arrays of ``seer.dataplane.draft_arena`` (layout there) and never writes them.
"""

from __future__ import annotations

import numba
import numpy as np

from seer.dataplane.draft_arena import _ARENA, _COLS, _I32, _I64, _PRIME, _SEED, _SLOTS, _TABLE, _finish

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
