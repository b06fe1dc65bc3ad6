"""The host agent process (dataplane/rdma/agent.py) on one host: it registers its pool
with ``AgentHello``, answers ``PullBlocks`` with ``PullDone`` and exits cleanly.

The test plays the control plane: a ROUTER socket on an ipc:// address in the test's
temp dir. Every receive is bounded by a generous timeout.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from seer.dataplane.geometry import PoolGeometry
from seer.dataplane.kvpool import KVPoolSegment
from seer.dataplane.rdma import BlockServer, host_id
from seer.dataplane.rdma.agent import EXIT_OK, EXIT_STARTUP_FAILED, AgentProcess
from seer.protocol import AgentHello, AgentMessage, PullBlocks, PullDone, Shutdown, pack_token_ids
from seer.wire import Codec, make_socket

GEOM = PoolGeometry(num_layers=2, num_kv_heads=2, head_size=16, block_size=8, dtype="float32")
RECV_TIMEOUT_MS = 120_000  # agent start imports numpy, zmq (and ucxx): slow on a loaded machine


def recv(sock: zmq.Socket, codec: Codec) -> tuple[bytes, object]:
    assert sock.poll(RECV_TIMEOUT_MS), "no message from the agent in time"
    identity, *frames = sock.recv_multipart()
    return identity, codec.decode(frames)


@pytest.fixture
def control_plane(tmp_path: Path):
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/ctl.sock"
    sock = make_socket(ctx, zmq.ROUTER, address, bind=True)
    yield address, sock
    sock.close(0)
    ctx.term()


def test_missing_segment_exits_with_a_clear_error(tmp_path: Path):
    """An agent told to attach a pool that does not exist says so and exits 2."""
    name = f"seertest-missing-{secrets.token_hex(4)}"
    out = subprocess.run([sys.executable, "-m", "seer.dataplane.rdma.agent", "--connect", f"ipc://{tmp_path}/x",
                          "--pool", name, "--bind-host", "127.0.0.1", "--transport", "tcp"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_STARTUP_FAILED
    assert f"/dev/shm/{name} does not exist" in out.stderr


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_agent_registers_pulls_and_shuts_down(control_plane, tmp_path: Path, transport: str):
    """Hello carries host, pool, geometry, transport and server address; a PullBlocks is
    executed into the agent's own pool and answered; Shutdown ends it and the segment it
    created is unlinked."""
    address, sock = control_plane
    codec: Codec = Codec(AgentMessage)
    name = f"seertest-agent-{os.getpid()}-{secrets.token_hex(4)}"
    src = KVPoolSegment.create(f"{name}-src", GEOM, 8)
    server = BlockServer(src, transport=transport, bind_host="127.0.0.1")
    agent = AgentProcess(connect=address, pool=name, bind_host="127.0.0.1", transport=transport,
                         create=(GEOM, 8), log_file=tmp_path / "agent.log")
    try:
        identity, hello = recv(sock, codec)
        assert isinstance(hello, AgentHello)
        assert (hello.host_id, hello.pool_name, hello.num_blocks, hello.transport) == (host_id(), name, 8, transport)
        assert hello.geometry == GEOM and hello.pid == agent.pid
        assert hello.address.startswith("tcp://127.0.0.1:" if transport == "tcp" else "ucx:")

        src.blocks[2:5] = np.random.default_rng(1).integers(0, 256, src.blocks[2:5].shape, dtype=np.uint8)
        src.seal([2, 3, 4], key=9, first_index=0, weights_version=1)
        ok_cmd = PullBlocks(transfer_id=17, transport=transport, address=server.address,
                            src_blocks=pack_token_ids([2, 3, 4]), dst_blocks=pack_token_ids([5, 6, 7]), key=9,
                            weights_version=1)
        sock.send_multipart([identity, *codec.encode(ok_cmd)])
        _, done = recv(sock, codec)
        assert isinstance(done, PullDone)
        assert (done.transfer_id, done.ok, done.error) == (17, True, "")
        assert done.num_bytes == 3 * GEOM.bytes_per_block and done.seconds > 0
        dst = KVPoolSegment.attach(name)
        assert np.array_equal(dst.blocks[5:8], src.blocks[2:5])
        assert dst.first_bad([5, 6, 7], 9, 0, 1) is None
        dst.close()

        stale = PullBlocks(transfer_id=18, transport=transport, address=server.address,
                           src_blocks=pack_token_ids([2]), dst_blocks=pack_token_ids([0]), key=9, weights_version=2)
        sock.send_multipart([identity, *codec.encode(stale)])
        _, done = recv(sock, codec)
        assert (done.transfer_id, done.ok) == (18, False) and "weights version 1" in done.error

        sock.send_multipart([identity, *codec.encode(Shutdown())])
        assert agent.proc.wait(120) == EXIT_OK
        assert not Path(f"/dev/shm/{name}").exists(), "the agent must unlink the segment it created"
    finally:
        agent.stop()
        server.close()
        src.close()
        src.unlink()
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)
