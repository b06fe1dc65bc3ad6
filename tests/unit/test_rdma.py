"""Block pulls between pools (dataplane/transfer): ``BlockServer`` + ``pull_blocks`` over both
transports on loopback, in one process (the server runs on its own thread).

Segments are real /dev/shm files with unique names, unlinked by the fixtures.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import STATE_EMPTY, KVPoolSegment
from seer.dataplane.transfer import TRANSPORTS, BlockServer, host_id, pull_blocks
from seer.dataplane.transfer.blockwire import coalesce_runs

# 3 layers x 2 heads x 8 tokens x (K + V) x 16 elements x 4 B = 2 KiB per layer, 6 KiB a block.
GEOM = PoolGeometry(num_layers=3, num_kv_heads=2, head_size=16, block_size=8, dtype="float32")
KEY = 41
VERSION = 3


@pytest.fixture
def new_segment():
    made: list[KVPoolSegment] = []

    def make(num_blocks: int = 16, geometry: PoolGeometry = GEOM) -> KVPoolSegment:
        seg = KVPoolSegment.create(f"seertest-rdma-{os.getpid()}-{secrets.token_hex(4)}", geometry, num_blocks)
        made.append(seg)
        return seg

    yield make
    for seg in made:
        seg.close()
        seg.unlink()


def fill_and_seal(seg: KVPoolSegment, blocks: list[int], key: int = KEY, version: int = VERSION,
                  first_index: int = 0, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for b in blocks:
        seg.blocks[b] = rng.integers(0, 256, seg.blocks[b].shape, dtype=np.uint8)
    seg.seal(blocks, key, first_index, version)


@pytest.fixture(params=TRANSPORTS)
def served(request, new_segment):
    """(transport, source segment, its server, destination segment)."""
    src, dst = new_segment(), new_segment()
    server = BlockServer(src, transport=request.param, bind_host="127.0.0.1")
    yield request.param, src, server, dst
    server.close()


def test_coalesce_runs_joins_blocks_consecutive_on_both_sides():
    """A run continues only while source and destination both advance by one block."""
    assert coalesce_runs([3, 4, 5, 9, 10], [0, 1, 2, 3, 4]) == [(3, 0, 3), (9, 3, 2)]
    assert coalesce_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert coalesce_runs([], []) == []


def test_pull_copies_bytes_and_seals_destination(served):
    """Pulled blocks are byte-identical to the source and sealed like a local save
    (key, block index from first_index, weights version, checksum)."""
    transport, src, server, dst = served
    src_blocks, dst_blocks = [3, 4, 5, 9, 12], [0, 1, 2, 7, 8]
    fill_and_seal(src, src_blocks, first_index=2)
    result = pull_blocks(transport, server.address, src_blocks, dst, dst_blocks, key=KEY, weights_version=VERSION,
                         first_index=2)
    assert result.ok, result.error
    assert result.num_bytes == 5 * GEOM.bytes_per_block
    for s, d in zip(src_blocks, dst_blocks):
        assert np.array_equal(dst.blocks[d], src.blocks[s])
    assert dst.first_bad(dst_blocks, KEY, 2, VERSION, verify_checksums=True) is None
    # a second pull reuses the connection / endpoint
    again = pull_blocks(transport, server.address, src_blocks[:2], dst, [10, 11], key=KEY, weights_version=VERSION,
                        first_index=2)
    assert again.ok, again.error
    assert np.array_equal(dst.blocks[10:12], src.blocks[3:5])


def test_corrupt_source_block_fails_the_pull(served):
    """A source block whose bytes no longer match its tag's checksum is refused, and no
    destination block is left valid."""
    transport, src, server, dst = served
    fill_and_seal(src, [0, 1, 2])
    dst.seal([5, 6, 7], KEY, 0, VERSION)  # stale valid tags that the pull must clear
    src.blocks[1, 2, 100] ^= 0xFF
    result = pull_blocks(transport, server.address, [0, 1, 2], dst, [5, 6, 7], key=KEY, weights_version=VERSION)
    assert not result.ok
    assert "source block 1 (position 1" in result.error and "checksum" in result.error
    assert all(int(dst.tags[b]["state"]) == STATE_EMPTY for b in (5, 6, 7))


def test_wrong_weights_version_fails_the_pull(served):
    """KV saved under other weights is never pulled; the error names block and versions."""
    transport, src, server, dst = served
    fill_and_seal(src, [0, 1], version=VERSION)
    result = pull_blocks(transport, server.address, [0, 1], dst, [0, 1], key=KEY, weights_version=VERSION + 1)
    assert not result.ok
    assert "weights version 3" in result.error and f"asks for {VERSION + 1}" in result.error
    assert dst.first_bad([0, 1], KEY, 0, VERSION) == 0


@pytest.mark.parametrize("case", ["other_key", "unsealed", "out_of_range", "wrong_index"])
def test_source_tag_mismatch_fails_the_pull(served, case):
    """Every tag field is checked: key, state, range and block index."""
    transport, src, server, dst = served
    fill_and_seal(src, [0, 1], key=KEY if case != "other_key" else KEY + 1)
    blocks = {"unsealed": [0, 2], "out_of_range": [0, 99]}.get(case, [0, 1])
    first_index = 1 if case == "wrong_index" else 0
    result = pull_blocks(transport, server.address, blocks, dst, [0, 1], key=KEY, weights_version=VERSION,
                         first_index=first_index)
    assert not result.ok
    expected = {"other_key": "belongs to key", "unsealed": "holds no saved KV", "out_of_range": "out of range",
                "wrong_index": "holds block index 0"}[case]
    assert expected in result.error


def test_verify_off_still_seals_with_the_source_checksum(served):
    """Without verification the destination tag carries the source's checksum, so a
    later verified load still catches a block that arrived damaged."""
    transport, src, server, dst = served
    fill_and_seal(src, [4])
    result = pull_blocks(transport, server.address, [4], dst, [9], key=KEY, weights_version=VERSION, verify=False)
    assert result.ok, result.error
    assert int(dst.tags[9]["checksum"]) == int(src.tags[4]["checksum"])
    assert dst.first_bad([9], KEY, 0, VERSION, verify_checksums=True) is None


def test_geometry_mismatch_is_refused(served, new_segment):
    """Pools of different geometry never exchange blocks."""
    transport, src, server, _ = served
    other = new_segment(geometry=PoolGeometry(num_layers=3, num_kv_heads=2, head_size=16, block_size=16,
                                              dtype="float32"))
    fill_and_seal(src, [0])
    result = pull_blocks(transport, server.address, [0], other, [0], key=KEY, weights_version=VERSION)
    assert not result.ok and "geometry mismatch" in result.error


def test_closed_server_gives_a_clear_error(served):
    """A server that is gone is an ok=False result, not an exception or a hang."""
    transport, src, server, dst = served
    fill_and_seal(src, [0])
    server.close()
    result = pull_blocks(transport, server.address, [0], dst, [0], key=KEY, weights_version=VERSION, timeout_s=3)
    assert not result.ok
    assert f"{transport} pull from" in result.error
    assert int(dst.tags[0]["state"]) == STATE_EMPTY


def test_bad_arguments_raise():
    """Caller bugs (unknown transport, unequal block lists) raise at once."""
    with pytest.raises(ValueError, match="unknown transport"):
        pull_blocks("rdma", "x", [0], None, [0], key=1, weights_version=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        pull_blocks("tcp", "tcp://127.0.0.1:1", [0, 1], None, [0], key=1, weights_version=0)  # type: ignore[arg-type]


def test_destination_out_of_range_is_an_error(served):
    transport, src, server, dst = served
    fill_and_seal(src, [0])
    result = pull_blocks(transport, server.address, [0], dst, [dst.num_blocks], key=KEY, weights_version=VERSION)
    assert not result.ok and "destination block 16 is out of range" in result.error


def test_host_id_names_host_and_network_namespace():
    """host_id is hostname + the network namespace's inode (differs between namespaces)."""
    assert host_id().endswith(f":{os.stat('/proc/self/ns/net').st_ino}")
    assert host_id() == host_id()


def test_importing_the_package_does_not_load_ucx():
    """ucxx is imported only when the ucx transport is used."""
    import subprocess
    import sys

    code = "import sys, seer.dataplane.transfer; print(any(m.split('.')[0] == 'ucxx' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_tcp_server_refuses_a_wildcard_bind_host(new_segment):
    """The bind host is also the advertised address, so a wildcard is refused."""
    with pytest.raises(ValueError, match="bind_host"):
        BlockServer(new_segment(), transport="tcp", bind_host="0.0.0.0")




def test_a_puller_that_gives_up_does_not_stall_the_server(served):
    """A pull abandoned by its puller (timeout, receives cancelled) leaves the server
    free to serve the next pull at once (not after its own send timeout of 60 s)."""
    transport, src, server, dst = served
    fill_and_seal(src, list(range(16)))
    abandoned = pull_blocks(transport, server.address, list(range(16)), dst, list(range(16)), key=KEY,
                            weights_version=VERSION, timeout_s=1e-6)
    if not abandoned.ok:  # it may also have been fast enough; either way nothing stays valid half-done
        assert all(int(dst.tags[b]["state"]) == STATE_EMPTY for b in range(16))
    result = pull_blocks(transport, server.address, [3], dst, [3], key=KEY, weights_version=VERSION,
                         first_index=3, timeout_s=30)
    assert result.ok, result.error
    assert np.array_equal(dst.blocks[3], src.blocks[3])


def test_pull_of_many_scattered_blocks(served, new_segment):
    """300 blocks in 150 runs, three times over one connection / endpoint: every run
    lands in its own destination blocks (the reply header, 32 B of tag per block, is
    larger than UCX's 8 KiB eager limit here)."""
    transport, _, _, _ = served
    src, dst = new_segment(num_blocks=600), new_segment(num_blocks=300)
    src_blocks = [b for b in range(600) if b % 4 < 2]  # pairs: 0,1, 4,5, ...
    fill_and_seal(src, src_blocks)
    with BlockServer(src, transport=transport, bind_host="127.0.0.1") as server:
        for _ in range(3):
            result = pull_blocks(transport, server.address, src_blocks, dst, list(range(300)), key=KEY,
                                 weights_version=VERSION)
            assert result.ok, result.error
    assert np.array_equal(dst.blocks[:300], src.blocks[src_blocks])
    assert dst.first_bad(list(range(300)), KEY, 0, VERSION) is None
