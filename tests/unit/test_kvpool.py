"""The host KV pool's bytes and bookkeeping: ``PoolGeometry``, ``KVPoolSegment`` and
``PoolAllocator`` (dataplane/geometry.py, dataplane/kvpool.py).

Segments are real /dev/shm files of a few KiB per block, each with a unique name; the
``pool_names`` fixture unlinks every one it handed out and fails the test if one is left.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import (
    HEADER_BYTES,
    MAGIC,
    KVPoolSegment,
    PoolAllocator,
    PoolError,
    blocks_for_bytes,
    segment_bytes,
    shm_path,
)

# 3 layers x 2 heads x 8 tokens x (K + V) x 16 elements x 4 B = 2 KiB per layer, 6 KiB a block.
GEOM = PoolGeometry(num_layers=3, num_kv_heads=2, head_size=16, block_size=8, dtype="float32")
NUM_BLOCKS = 6
SHM = Path("/dev/shm")


@pytest.fixture
def pool_names():
    """Hands out unique segment names; unlinks them all afterwards and checks that none
    is left in /dev/shm."""
    prefix = f"seertest-kvpool-{os.getpid()}-{secrets.token_hex(4)}"
    names: list[str] = []

    def new() -> str:
        names.append(f"{prefix}-{len(names)}")
        return names[-1]

    yield new
    for name in names:
        (SHM / name).unlink(missing_ok=True)
    assert not list(SHM.glob(f"{prefix}*")), "a test left a pool segment behind"


@pytest.fixture
def segment(pool_names):
    seg = KVPoolSegment.create(pool_names(), GEOM, NUM_BLOCKS)
    yield seg
    seg.close()
    seg.unlink()


def fill(seg: KVPoolSegment, blocks: list[int], seed: int) -> None:
    """Write distinct pseudo-random bytes into ``blocks`` (as an engine's save would)."""
    rng = np.random.default_rng(seed)
    for b in blocks:
        seg.blocks[b] = rng.integers(0, 256, size=seg.blocks[b].shape, dtype=np.uint8)


# ---------------------------------------------------------------------- geometry

def test_geometry_sizes_follow_the_paged_layout():
    """A block holds block_size tokens of K and V for every head and layer."""
    assert GEOM.layer_bytes == 2 * 8 * 2 * 16 * 4 == 2048
    assert GEOM.bytes_per_block == 3 * 2048
    assert GEOM.bytes_per_token == 3 * 2048 // 8
    bf16 = msgspec.structs.replace(GEOM, dtype="bfloat16")
    assert bf16.bytes_per_block == GEOM.bytes_per_block // 2


def test_geometry_fingerprint_changes_with_every_field():
    """Engines with any difference in block shape, dtype or page layout never share blocks."""
    variants = [msgspec.structs.replace(GEOM, **{f: v}) for f, v in [
        ("num_layers", 4), ("num_kv_heads", 1), ("head_size", 32), ("block_size", 16),
        ("dtype", "bfloat16"), ("layout", "paged-v2")]]
    prints = {GEOM.fingerprint, *(g.fingerprint for g in variants)}
    assert len(prints) == len(variants) + 1
    assert msgspec.json.decode(msgspec.json.encode(GEOM), type=PoolGeometry).fingerprint == GEOM.fingerprint


def test_blocks_for_bytes_rounds_down_but_gives_at_least_one():
    assert blocks_for_bytes(GEOM, 10 * GEOM.bytes_per_block + 5) == 10
    assert blocks_for_bytes(GEOM, 1) == 1


# ---------------------------------------------------------------------- segment lifecycle

def test_create_makes_a_segment_of_the_documented_size_and_attach_sees_it(pool_names):
    """The creator's header tells an attacher the geometry and block count; both map the
    same bytes."""
    name = pool_names()
    seg = KVPoolSegment.create(name, GEOM, NUM_BLOCKS)
    other = KVPoolSegment.attach(name)
    try:
        assert (SHM / name).stat().st_size == segment_bytes(GEOM, NUM_BLOCKS)
        assert other.geometry == GEOM and other.num_blocks == NUM_BLOCKS
        assert seg.blocks.shape == (NUM_BLOCKS, GEOM.num_layers, GEOM.layer_bytes)
        assert not seg.blocks.any()  # a fresh pool is zeroed
        fill(seg, [4], seed=1)
        assert np.array_equal(other.blocks[4], seg.blocks[4])
        other.blocks[2, 1, :3] = [7, 8, 9]
        assert list(seg.blocks[2, 1, :3]) == [7, 8, 9]
    finally:
        other.close()
        seg.close()
        seg.unlink()
    assert not (SHM / name).exists()


def test_create_refuses_an_existing_name_and_a_pool_without_blocks(pool_names, segment):
    with pytest.raises(FileExistsError):
        KVPoolSegment.create(segment.path.name, GEOM, NUM_BLOCKS)
    with pytest.raises(PoolError, match="at least one block"):
        KVPoolSegment.create(pool_names(), GEOM, 0)


@pytest.mark.parametrize("name", ["", "a/b", "../etc"])
def test_a_pool_name_must_be_a_plain_file_name(name):
    with pytest.raises(PoolError, match="invalid pool name"):
        shm_path(name)


def test_attaching_a_missing_segment_says_so(pool_names):
    with pytest.raises(PoolError, match="does not exist"):
        KVPoolSegment.attach(pool_names())


def test_attaching_a_foreign_file_is_refused(pool_names):
    """A /dev/shm file that does not start with the pool's magic is not a pool."""
    name = pool_names()
    (SHM / name).write_bytes(b"NOTAPOOL" + bytes(2 * HEADER_BYTES))
    with pytest.raises(PoolError, match="bad magic"):
        KVPoolSegment.attach(name)


def test_attaching_a_file_smaller_than_the_header_is_refused(pool_names):
    name = pool_names()
    (SHM / name).write_bytes(MAGIC + bytes(100))
    with pytest.raises(PoolError, match="too small"):
        KVPoolSegment.attach(name)


def test_attaching_a_truncated_segment_is_refused(pool_names):
    """A segment shorter than its header's geometry promises is refused, not mapped
    (reading past its end would crash the engine)."""
    name = pool_names()
    seg = KVPoolSegment.create(name, GEOM, NUM_BLOCKS)
    seg.close()
    os.truncate(SHM / name, segment_bytes(GEOM, NUM_BLOCKS) - GEOM.bytes_per_block)
    with pytest.raises(PoolError, match="truncated"):
        KVPoolSegment.attach(name)


def test_close_with_a_view_still_held_does_not_raise(segment):
    """An engine that still holds a view of the blocks can close its mapping."""
    view = segment.blocks[0]
    segment.close()
    assert view.shape == (GEOM.num_layers, GEOM.layer_bytes)


# ---------------------------------------------------------------------- tags and checksums

KEY, VERSION = 41, 3


def test_sealed_blocks_are_good_for_their_key_index_and_version(segment, pool_names):
    """After seal, first_bad finds nothing wrong, in this mapping and in another one."""
    blocks = [5, 0, 3]
    fill(segment, blocks, seed=2)
    segment.seal(blocks, KEY, 0, VERSION)
    assert segment.first_bad(blocks, KEY, 0, VERSION) is None
    other = KVPoolSegment.attach(segment.path.name)
    try:
        assert other.first_bad(blocks, KEY, 0, VERSION) is None
        assert other.first_bad(blocks[:2], KEY, 0, VERSION) is None  # a prefix is fine
    finally:
        other.close()


def test_first_index_offsets_the_tagged_block_indices(segment):
    """Blocks sealed as a request's blocks 2 and 3 match only as indices 2 and 3."""
    fill(segment, [1, 4], seed=3)
    segment.seal([1, 4], KEY, 2, VERSION)
    assert segment.first_bad([1, 4], KEY, 2, VERSION) is None
    assert segment.first_bad([1, 4], KEY, 0, VERSION) == 0
    assert segment.first_bad([4], KEY, 3, VERSION) is None
    assert segment.first_bad([4, 1], KEY, 2, VERSION) == 0  # swapped: wrong indices


def test_a_corrupted_byte_is_the_first_bad_block(segment):
    """One flipped byte in block 2 of 4 makes index 2 bad; earlier blocks stay good.
    Without checksum verification only tags are compared."""
    blocks = [0, 1, 2, 3]
    fill(segment, blocks, seed=4)
    segment.seal(blocks, KEY, 0, VERSION)
    segment.blocks[2, 2, 1000] ^= 0x10
    assert segment.first_bad(blocks, KEY, 0, VERSION) == 2
    assert segment.first_bad(blocks[:2], KEY, 0, VERSION) is None
    assert segment.first_bad(blocks, KEY, 0, VERSION, verify_checksums=False) is None


def test_a_zeroed_block_is_bad(segment):
    """A torn write that left a block zeroed is detected."""
    blocks = [0, 1]
    fill(segment, blocks, seed=5)
    segment.seal(blocks, KEY, 0, VERSION)
    segment.blocks[1] = 0
    assert segment.first_bad(blocks, KEY, 0, VERSION) == 1


def test_a_block_of_another_key_or_weights_version_is_bad(segment):
    """A block sealed for another request, or under other weights, never matches."""
    fill(segment, [0, 1, 2], seed=6)
    segment.seal([0, 1], KEY, 0, VERSION)
    segment.seal([2], KEY + 1, 2, VERSION)
    assert segment.first_bad([0, 1, 2], KEY, 0, VERSION) == 2
    assert segment.first_bad([0, 1], KEY + 1, 0, VERSION) == 0
    assert segment.first_bad([0, 1], KEY, 0, VERSION + 1) == 0
    segment.seal([1], KEY, 1, VERSION + 1)
    assert segment.first_bad([0, 1], KEY, 0, VERSION) == 1


def test_unsealed_invalidated_or_out_of_range_blocks_are_bad(segment):
    """A block never sealed, invalidated before a rewrite, or outside the pool is a miss."""
    fill(segment, [0, 1, 2], seed=7)
    segment.seal([0, 1], KEY, 0, VERSION)
    assert segment.first_bad([0, 1, 2], KEY, 0, VERSION) == 2  # block 2 never sealed
    segment.invalidate([1])
    assert segment.first_bad([0, 1], KEY, 0, VERSION) == 1
    assert segment.first_bad([0, NUM_BLOCKS], KEY, 0, VERSION) == 1
    assert segment.first_bad([-1], KEY, 0, VERSION) == 0


def test_resealing_after_a_rewrite_makes_the_block_good_again(segment):
    fill(segment, [3], seed=8)
    segment.seal([3], KEY, 0, VERSION)
    fill(segment, [3], seed=9)
    assert segment.first_bad([3], KEY, 0, VERSION) == 0
    segment.seal([3], KEY, 0, VERSION)
    assert segment.first_bad([3], KEY, 0, VERSION) is None


def test_the_checksum_depends_on_every_word(segment):
    """Changing any single 8-byte word of a block changes its checksum."""
    fill(segment, [0], seed=10)
    base = segment.checksum(0)
    flat = segment.blocks[0].reshape(-1)
    for offset in (0, 8, GEOM.layer_bytes, GEOM.bytes_per_block - 1):
        flat[offset] ^= 0x01
        assert segment.checksum(0) != base, offset
        flat[offset] ^= 0x01
    assert segment.checksum(0) == base


# ---------------------------------------------------------------------- allocator

def test_reserve_grows_a_request_block_list_and_keeps_its_prefix():
    """Block i holds tokens [i*bs, (i+1)*bs): growing keeps earlier blocks in place,
    asking for fewer tokens never shrinks."""
    a = PoolAllocator(num_blocks=8, block_size=16)
    first = list(a.reserve(1, 10))
    assert len(first) == 1
    grown = list(a.reserve(1, 33))
    assert len(grown) == 3 and grown[:1] == first
    assert list(a.reserve(1, 16)) == grown
    assert a.blocks_of(1) == grown and a.num_used == 3 and a.num_free == 5
    other = a.reserve(2, 16)
    assert len(other) == 1 and not set(other) & set(grown)


def test_a_full_pool_refuses_changes_nothing_and_counts_the_refusal():
    a = PoolAllocator(num_blocks=4, block_size=16)
    held = list(a.reserve(1, 48))
    assert not a.can_reserve(2, 32)
    assert a.reserve(2, 32) is None
    assert a.reserve(1, 80) is None  # growing past the pool is refused too
    assert a.num_refused == 2
    assert a.blocks_of(1) == held and a.blocks_of(2) == [] and a.num_free == 1
    assert a.can_reserve(2, 16) and a.reserve(2, 16) is not None
    assert a.num_refused == 2


def test_release_gives_blocks_back_and_peak_used_remembers():
    a = PoolAllocator(num_blocks=6, block_size=4)
    a.reserve(1, 12)
    a.reserve(2, 8)
    assert a.peak_used == 5
    released = a.release(1)
    assert len(released) == 3 and a.num_free == 4 and a.blocks_of(1) == []
    assert a.release(1) == [] and a.release(99) == []
    assert a.peak_used == 5
    again = a.reserve(3, 16)  # the released blocks are usable again
    assert len(again) == 4 and set(released) <= set(again)
    assert a.peak_used == 6


def test_release_all_frees_every_request():
    a = PoolAllocator(num_blocks=5, block_size=4)
    for key in (1, 2, 3):
        a.reserve(key, 5)
    a.release_all()
    assert a.num_free == 5 and a.num_used == 0
    assert all(a.blocks_of(k) == [] for k in (1, 2, 3))
    assert sorted(a.reserve(9, 20)) == [0, 1, 2, 3, 4]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(1, 5), st.integers(0, 80)),
        st.tuples(st.just("release"), st.integers(1, 5), st.just(0)),
        st.tuples(st.just("release_all"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.integers(1, 16), ops=OPS)
def test_allocator_never_hands_one_block_to_two_owners(num_blocks, block_size, ops):
    """Random reserve/release sequences: owners' blocks are disjoint, free + owned ==
    total, a refused reserve changes nothing, a granted one covers the tokens."""
    a = PoolAllocator(num_blocks, block_size)
    keys = range(1, 6)
    refused = 0
    for op, key, tokens in ops:
        before = {k: list(a.blocks_of(k)) for k in keys}
        if op == "reserve":
            got = a.reserve(key, tokens)
            if got is None:
                refused += 1
                assert {k: a.blocks_of(k) for k in keys} == before
            else:
                need = -(-tokens // block_size)
                assert len(got) == max(need, len(before[key]))
                assert got[:len(before[key])] == before[key]
        elif op == "release":
            assert a.release(key) == before[key]
        else:
            a.release_all()
        owned = [b for k in keys for b in a.blocks_of(k)]
        assert len(owned) == len(set(owned)), "a block has two owners"
        assert all(0 <= b < num_blocks for b in owned)
        assert a.num_free + len(owned) == num_blocks
        assert a.num_refused == refused
        assert a.num_used <= a.peak_used <= num_blocks
    # The free list holds each remaining block exactly once: taking all of it hands out
    # exactly the blocks nobody owns.
    owned = {b for k in keys for b in a.blocks_of(k)}
    rest = a.reserve(99, a.num_free * block_size)
    assert rest is not None and len(rest) == len(set(rest))
    assert set(rest) == set(range(num_blocks)) - owned
