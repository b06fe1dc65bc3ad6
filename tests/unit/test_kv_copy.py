"""The fused copy path (engines/kv_copy.py): bytes, checksums and cuts at bad blocks."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from seer.dataplane.kvpool import KVPoolSegment
from seer.engines.kv_copy import PageCopier
from seer.protocol import PoolGeometry

GEOM = PoolGeometry(num_layers=3, num_kv_heads=2, head_size=4, block_size=16, dtype="float32")


@pytest.fixture
def seg():
    s = KVPoolSegment.create(f"seertest-kvcopy-{os.getpid()}-{secrets.token_hex(4)}", GEOM, 8)
    yield s
    s.close()
    s.unlink()


def layers(seed: int | None, blocks: int = 10) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (blocks, GEOM.layer_bytes), dtype=np.uint8) if seed is not None
            else np.zeros((blocks, GEOM.layer_bytes), dtype=np.uint8) for _ in range(GEOM.num_layers)]


def test_the_fused_sums_are_the_pools_checksums_and_the_bytes_land_in_place(seg):
    """A save of scattered engine blocks writes each page into its pool block layer by
    layer, and the sum it returns equals KVPoolSegment.checksum of that block."""
    src = layers(1)
    copier = PageCopier(src)
    pool_ids, vllm_ids = [5, 0, 3], [7, 2, 9]
    sums = copier.copy(seg, pool_ids, vllm_ids, to_pool=True)
    for j, (p, v) in enumerate(zip(pool_ids, vllm_ids)):
        assert int(sums[j]) == seg.checksum(p)
        for i in range(GEOM.num_layers):
            assert bytes(seg.blocks[p, i]) == src[i][v].tobytes()


def test_save_seals_and_load_reproduces_the_pages(seg):
    """save() seals tags that first_bad accepts with checksums; load() into other engine
    blocks gives the same pages and reports every block good."""
    src, dst = layers(2), layers(None)
    PageCopier(src).save(seg, [1, 2, 4], [0, 1, 2], key=7, first_index=0, weights_version=3)
    assert seg.first_bad([1, 2, 4], 7, 0, 3, verify_checksums=True) is None
    assert PageCopier(dst).load(seg, [1, 2, 4], [5, 6, 8], key=7, first_index=0, weights_version=3) == 3
    for i in range(GEOM.num_layers):
        for s, d in zip([0, 1, 2], [5, 6, 8]):
            assert np.array_equal(dst[i][d], src[i][s])


@pytest.mark.parametrize("verify", [True, False])
def test_load_cuts_at_the_first_corrupted_or_mistagged_block(seg, verify):
    """A flipped byte in block 2 of 3 cuts the load there when checksums are verified
    (and only then); a wrong tag on block 1 cuts it at 1 either way."""
    src = layers(3)
    PageCopier(src).save(seg, [0, 1, 2], [0, 1, 2], key=1, first_index=0, weights_version=0)
    seg.blocks[2, 1, 9] ^= 0x10
    dst = PageCopier(layers(None))
    assert dst.load(seg, [0, 1, 2], [3, 4, 5], 1, 0, 0, verify_checksums=verify) == (2 if verify else 3)
    seg.invalidate([1])
    assert dst.load(seg, [0, 1, 2], [3, 4, 5], 1, 0, 0, verify_checksums=verify) == 1


def test_pages_of_unequal_or_odd_width_are_refused():
    """The copy works in 64-bit words over equal pages; anything else is an error naming the widths."""
    with pytest.raises(ValueError, match="multiple of 8"):
        PageCopier([np.zeros((2, 12), np.uint8)])
    with pytest.raises(ValueError, match=r"\[8, 16\]"):
        PageCopier([np.zeros((2, 8), np.uint8), np.zeros((2, 16), np.uint8)])
