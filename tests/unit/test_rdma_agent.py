"""The host agent process (dataplane/transfer/agent.py) on one host: it registers its pool
with ``AgentHello``, answers ``PullBlocks`` with ``PullDone`` and exits cleanly; when the
control plane goes silent (it restarted) it says hello again until one answers.

The test plays the control plane: a ROUTER socket on an ipc:// address in the test's
temp dir. Every receive is bounded by a generous timeout.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import KVPoolSegment
from seer.dataplane.transfer import BlockServer, host_id
from seer.dataplane.transfer.agent import EXIT_OK, EXIT_STARTUP_FAILED, AgentProcess
from seer.protocol import AgentHello, AgentMessage, Ping, PullBlocks, PullDone, Shutdown, pack_token_ids
from seer.peer import HELLO_REPEAT_S
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
    out = subprocess.run([sys.executable, "-m", "seer.dataplane.transfer.agent", "--connect", f"ipc://{tmp_path}/x",
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


# ---------------------------------------------------------------------- outliving control planes

SILENCE_S = 3.0  # engines.heartbeat_timeout_s for these agents


def quiet_agent(tmp_path: Path, address: str, **kv_pool: float) -> tuple[AgentProcess, str]:
    """An agent (tcp, own segment) whose config takes ``SILENCE_S`` of silence as the
    control plane lost."""
    config = tmp_path / "agent.toml"
    lines = ["[engines]", f"heartbeat_timeout_s = {SILENCE_S}", "", "[kv_pool]"]
    lines += [f"{k} = {v}" for k, v in kv_pool.items()]
    config.write_text("\n".join(lines) + "\n")
    name = f"seertest-agent-{os.getpid()}-{secrets.token_hex(4)}"
    agent = AgentProcess(connect=address, pool=name, bind_host="127.0.0.1", transport="tcp", config_file=config,
                         create=(GEOM, 8), log_file=tmp_path / "agent.log")
    return agent, name


def events(log_file: Path, name: str) -> list[dict]:
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def pinging(sock: zmq.Socket, codec: Codec, identity: bytes, duration_s: float,
            until: type | None = None) -> list[object]:
    """Play a live control plane for ``duration_s`` (or until a message of type ``until``
    arrives): a Ping every 0.1 s; returns what the agent sent meanwhile."""
    got: list[object] = []
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        sock.send_multipart([identity, *codec.encode(Ping())])
        if sock.poll(100):
            got.append(recv(sock, codec)[1])
            if until is not None and isinstance(got[-1], until):
                break
    return got


def test_a_silent_control_plane_gets_the_hello_again_until_it_answers(control_plane, tmp_path: Path):
    """Pinged, the agent says nothing; unpinged for ``heartbeat_timeout_s`` it logs
    control_plane_lost and sends the same AgentHello again, every HELLO_REPEAT_S, until a
    message arrives (agent_reregistered); then it is quiet again while pinged."""
    address, sock = control_plane
    codec: Codec = Codec(AgentMessage)
    agent, name = quiet_agent(tmp_path, address)
    log_file = tmp_path / "agent.log"
    try:
        identity, first = recv(sock, codec)
        assert isinstance(first, AgentHello)
        assert pinging(sock, codec, identity, 2 * SILENCE_S) == [], "a pinged agent repeats nothing"

        _, again = recv(sock, codec)  # no pings from here on
        assert again == first, "the same hello: same pid, pool and server address"
        (lost,) = events(log_file, "control_plane_lost")
        assert lost["silent_s"] >= SILENCE_S
        t0 = time.monotonic()
        _, third = recv(sock, codec)
        assert third == first and time.monotonic() - t0 >= 1.0  # repeated, not re-sent at every poll

        assert pinging(sock, codec, identity, 2 * SILENCE_S) == [], "heard again: no more hellos"
        (back,) = events(log_file, "agent_reregistered")
        assert back["num_hellos"] >= 3 and back["lost_s"] >= HELLO_REPEAT_S
        assert len(events(log_file, "control_plane_lost")) == 1

        sock.send_multipart([identity, *codec.encode(Shutdown())])
        assert agent.proc.wait(120) == EXIT_OK, "a lost control plane never made it exit"
    finally:
        agent.stop()
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)


def test_a_pull_longer_than_the_silence_timeout_does_not_make_the_agent_say_hello(control_plane, tmp_path: Path):
    """A pull blocks the agent for ``transfer_timeout_s`` (a server that never answers)
    while the control plane keeps pinging: the pings queued meanwhile count, so the pull is
    answered (ok=False, the timeout) and no hello is repeated."""
    address, sock = control_plane
    codec: Codec = Codec(AgentMessage)
    agent, name = quiet_agent(tmp_path, address, transfer_timeout_s=2.5 * SILENCE_S)
    mute = socket.create_server(("127.0.0.1", 0))  # accepts connections (backlog), never answers
    try:
        identity, first = recv(sock, codec)
        assert isinstance(first, AgentHello)
        pull = PullBlocks(transfer_id=5, transport="tcp", address=f"tcp://127.0.0.1:{mute.getsockname()[1]}",
                          src_blocks=pack_token_ids([0]), dst_blocks=pack_token_ids([1]), key=3, weights_version=1)
        sock.send_multipart([identity, *codec.encode(pull)])
        got = pinging(sock, codec, identity, 120.0, until=PullDone)
        assert [type(m) for m in got] == [PullDone], got
        assert (got[0].transfer_id, got[0].ok) == (5, False) and got[0].seconds >= 2 * SILENCE_S
        assert pinging(sock, codec, identity, 2 * SILENCE_S) == []
        assert not events(tmp_path / "agent.log", "control_plane_lost")
    finally:
        agent.stop()
        mute.close()
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)
