"""The disk tier file (dataplane/kvdisk.py): spill and stage bytes, tags end to end, failures."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest

from seer.dataplane.kvdisk import DiskTier, DiskTierError
from seer.dataplane.kvpool import KVPoolSegment
from seer.protocol import PoolGeometry

# 2 layers x 2 x 2 heads x 16 tokens x 32 x 4 bytes = 16 KiB per block: whole pages
GEOM = PoolGeometry(num_layers=2, num_kv_heads=2, head_size=32, block_size=16, dtype="float32")


@pytest.fixture
def pool():
    seg = KVPoolSegment.create(f"seertest-kvdisk-{os.getpid()}-{secrets.token_hex(4)}", GEOM, 8)
    yield seg
    seg.close()
    seg.unlink()


@pytest.fixture
def disk(pool, tmp_path):
    tier = DiskTier.create(tmp_path, pool, 6 * GEOM.bytes_per_block)
    yield tier
    tier.close()
    assert not tier.path.exists()


def fill(pool: KVPoolSegment, blocks: list[int], key: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (len(blocks), GEOM.num_layers, GEOM.layer_bytes),
                                                dtype=np.uint8)
    for i, b in enumerate(blocks):
        pool.blocks[b] = data[i]
    pool.seal(blocks, key, 0, 1)
    return data


def test_spilled_blocks_stage_back_byte_for_byte_into_other_blocks_and_are_sealed(pool, disk):
    """Blocks 1, 2, 5 spilled to slots 4, 5, 0 come back into blocks 6, 7, 3 equal and
    sealed for the same key, indices and weights version (checksums verified)."""
    data = fill(pool, [1, 2, 5], key=9, seed=1)
    disk.spill(pool, [1, 2, 5], [4, 5, 0], key=9, first_index=0, weights_version=1)
    assert disk.stage(pool, [4, 5, 0], [6, 7, 3], key=9, first_index=0, weights_version=1) == 3
    for i, b in enumerate([6, 7, 3]):
        assert np.array_equal(pool.blocks[b], data[i])
    assert pool.first_bad([6, 7, 3], 9, 0, 1, verify_checksums=True) is None
    assert disk.bytes_written == disk.bytes_read == 3 * GEOM.bytes_per_block


def test_a_corrupted_slot_stops_the_stage_there_and_its_block_is_not_sealed(pool, disk):
    """A flipped byte on disk in the second slot: one block staged, the second left invalid."""
    fill(pool, [0, 1], key=3, seed=2)
    disk.spill(pool, [0, 1], [0, 1], key=3, first_index=0, weights_version=1)
    off = disk._data_offset + 1 * GEOM.bytes_per_block + 77
    with open(disk.path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)[0]
        f.seek(off)
        f.write(bytes([byte ^ 0x20]))
    assert disk.stage(pool, [0, 1], [4, 5], key=3, first_index=0, weights_version=1) == 1
    assert pool.first_bad([4, 5], 3, 0, 1) == 1


@pytest.mark.parametrize("key,version", [(4, 1), (3, 2)])
def test_slots_of_another_request_or_weights_version_stage_nothing(pool, disk, key, version):
    """Tags on disk name the request and weights: a mismatch is a miss, not a load."""
    fill(pool, [0], key=3, seed=3)
    disk.spill(pool, [0], [2], key=3, first_index=0, weights_version=1)
    assert disk.stage(pool, [2], [5], key=key, first_index=0, weights_version=version) == 0


def test_an_unsealed_pool_block_is_not_spilled(pool, disk):
    """Only blocks whose tag and checksum hold the request's KV go to disk."""
    fill(pool, [0, 1], key=3, seed=4)
    pool.blocks[1, 0, 0] ^= 1
    with pytest.raises(DiskTierError, match="does not hold request 3"):
        disk.spill(pool, [0, 1], [0, 1], key=3, first_index=0, weights_version=1)


def test_a_full_disk_fails_the_spill_with_a_reason_and_leaves_no_valid_slot(pool, disk):
    """Writes that hit ENOSPC (/dev/full) raise DiskTierError naming the failure."""
    fill(pool, [0], key=3, seed=5)
    full = os.open("/dev/full", os.O_RDWR)
    real, disk._fd = disk._fd, full
    try:
        with pytest.raises(DiskTierError, match="No space left"):
            disk.spill(pool, [0], [1], key=3, first_index=0, weights_version=1)
    finally:
        disk._fd = real
        os.close(full)
    assert disk.stage(pool, [1], [5], key=3, first_index=0, weights_version=1) == 0


def test_configuration_errors_name_the_field_and_the_fix(pool, tmp_path):
    """A missing folder or a size below one block is refused with the kv_pool key to change."""
    with pytest.raises(DiskTierError, match=r"kv_pool.disk_path = .* is not a folder"):
        DiskTier.create(tmp_path / "nope", pool, 1 << 20)
    with pytest.raises(DiskTierError, match="kv_pool.disk_gib"):
        DiskTier.create(tmp_path, pool, GEOM.bytes_per_block - 1)
    assert not list(Path(tmp_path).glob("seer-kvdisk-*"))
