"""KV blocks move between two "hosts": network namespaces joined by veth, created by the
test (dataplane/netns.py) and deleted in a finalizer.

An agent in namespace A creates and serves pool A; an agent in namespace B creates pool
B and, told by the test (playing the control plane over an ipc:// socket both
namespaces can reach), pulls A's blocks across the veth link -- for both transports.
Skipped, with the reason, where namespaces cannot be created (needs root + iproute2).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest
import zmq

from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import KVPoolSegment
from seer.dataplane.transfer import host_id
from seer.dataplane.transfer.agent import EXIT_OK, AgentProcess
from seer.dataplane.netns import NetnsPair
from seer.protocol import AgentHello, AgentMessage, PullBlocks, PullDone, Shutdown, pack_token_ids
from seer.wire import Codec, make_socket
from tests.daemon_helpers import netns_pair_or_skip

# SmolLM2-like layers, small block: 4 layers x 3 heads x 16 tokens x (K+V) x 64 x 4 B = 96 KiB a block.
GEOM = PoolGeometry(num_layers=4, num_kv_heads=3, head_size=64, block_size=16, dtype="float32")
NUM_BLOCKS = 64
RECV_TIMEOUT_MS = 180_000


@pytest.fixture(scope="module")
def hosts():
    yield from netns_pair_or_skip()


def recv(sock: zmq.Socket, codec: Codec) -> tuple[bytes, object]:
    assert sock.poll(RECV_TIMEOUT_MS), "no message from an agent in time"
    identity, *frames = sock.recv_multipart()
    return identity, codec.decode(frames)


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_agent_in_namespace_b_pulls_from_namespace_a(hosts: NetnsPair, tmp_path: Path, transport: str):
    """Bytes arrive identical and sealed across the veth link; a pull of KV saved under
    other weights is refused; both agents exit cleanly and unlink their pools."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, f"ipc://{tmp_path}/ctl.sock", bind=True)
    codec: Codec = Codec(AgentMessage)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    names = (f"seertest-netns-{tag}-a", f"seertest-netns-{tag}-b")
    agents = [AgentProcess(connect=f"ipc://{tmp_path}/ctl.sock", pool=names[i], bind_host=hosts.addresses[i],
                           transport=transport, create=(GEOM, NUM_BLOCKS), log_file=tmp_path / f"agent{i}.log",
                           prefix=hosts.prefix(i)) for i in (0, 1)]
    try:
        hellos: dict[str, tuple[bytes, AgentHello]] = {}
        for _ in agents:
            identity, hello = recv(sock, codec)
            assert isinstance(hello, AgentHello)
            hellos[hello.pool_name] = (identity, hello)
        (_, hello_a), (identity_b, hello_b) = hellos[names[0]], hellos[names[1]]
        assert len({hello_a.host_id, hello_b.host_id, host_id()}) == 3, "each namespace is its own host"
        if transport == "tcp":
            assert hello_a.address == f"tcp://{hosts.addresses[0]}:{hello_a.address.rsplit(':', 1)[1]}"

        pool_a = KVPoolSegment.attach(names[0])  # the test reaches /dev/shm of both "hosts"
        src_blocks, dst_blocks = list(range(10, 40)) + [50, 51], list(range(0, 32))
        pool_a.blocks[src_blocks] = np.random.default_rng(7).integers(
            0, 256, (len(src_blocks), *pool_a.blocks.shape[1:]), dtype=np.uint8)
        pool_a.seal(src_blocks, key=1234, first_index=0, weights_version=5)

        cmd = PullBlocks(transfer_id=1, transport=transport, address=hello_a.address,
                         src_blocks=pack_token_ids(src_blocks), dst_blocks=pack_token_ids(dst_blocks), key=1234,
                         weights_version=5)
        sock.send_multipart([identity_b, *codec.encode(cmd)])
        _, done = recv(sock, codec)
        assert isinstance(done, PullDone) and done.transfer_id == 1
        assert done.ok, done.error
        assert done.num_bytes == len(src_blocks) * GEOM.bytes_per_block
        pool_b = KVPoolSegment.attach(names[1])
        assert np.array_equal(pool_b.blocks[dst_blocks], pool_a.blocks[src_blocks])
        assert pool_b.first_bad(dst_blocks, 1234, 0, 5, verify_checksums=True) is None

        stale = PullBlocks(transfer_id=2, transport=transport, address=hello_a.address,
                           src_blocks=pack_token_ids([10]), dst_blocks=pack_token_ids([40]), key=1234,
                           weights_version=6)
        sock.send_multipart([identity_b, *codec.encode(stale)])
        _, done = recv(sock, codec)
        assert (done.transfer_id, done.ok) == (2, False) and "weights version 5" in done.error
        pool_a.close()
        pool_b.close()

        for identity, _ in hellos.values():
            sock.send_multipart([identity, *codec.encode(Shutdown())])
        assert [a.proc.wait(120) for a in agents] == [EXIT_OK, EXIT_OK]
        assert not any(Path(f"/dev/shm/{n}").exists() for n in names), "agents unlink the pools they created"
    finally:
        for agent in agents:
            agent.stop()
        for name in names:
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)
        sock.close(0)
        ctx.term()
