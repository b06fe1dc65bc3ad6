"""Fuzzing a real daemon's client socket: random and mutated frames never crash it, it still
answers status afterwards, and no state is left behind (issue 14, "beyond the fixes").

A raw DEALER sends each hypothesis example and drains whatever the daemon answers. A
mutation can produce a valid request (a rollout nobody heartbeats: aborted after the
client timeout, 3 s here); a valid shutdown request is never sent."""

from __future__ import annotations

import json

import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from seer import protocol as p
from seer.client import SeerClient
from seer.wire import Codec, FrameError
from tests.daemon_helpers import Daemon, pid_alive, wait_for, write_sim_config
from tests.wire_strategies import frames, plausible_frames

_check = Codec(p.ClientMessage)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fuzz")
    daemon = Daemon(root / "run", write_sim_config(root / "sim.toml"))
    info = daemon.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.address)
    yield daemon, info, sock
    sock.close(0)
    ctx.term()
    daemon.stop()


def _is_shutdown(raw: list[bytes]) -> bool:
    try:
        return isinstance(_check.decode(raw), p.ShutdownRequest)
    except FrameError:
        return False


def _drain(sock: zmq.Socket) -> None:
    while sock.poll(0):
        sock.recv_multipart()


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(raw=frames)
def test_random_frames_on_the_client_socket(fuzzed, raw):
    """Each fuzzed frame is sent to the daemon's client socket; replies are drained."""
    _daemon, _info, sock = fuzzed
    if _is_shutdown(raw):
        return
    sock.send_multipart(raw)
    _drain(sock)


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(raw=plausible_frames)
def test_well_formed_requests_with_odd_values_on_the_client_socket(fuzzed, raw):
    """Well-formed requests with values in and out of range reach intake; replies are drained."""
    _daemon, _info, sock = fuzzed
    sock.send_multipart(raw)
    _drain(sock)


def test_the_daemon_survived_and_kept_no_state(fuzzed):
    """After the fuzzing (runs last): the daemon process lives, status answers with both
    engines ready, every accidental rollout is gone, and a real rollout still works."""
    daemon, info, sock = fuzzed
    _drain(sock)
    assert pid_alive(info["pid"])
    with SeerClient(daemon.address, timeout_s=10) as client:
        status = client.status()
        assert [e.state for e in status.engines] == ["ready", "ready"]
        wait_for(lambda: client.status().rollouts == [], 30, "accidental rollouts to be aborted")
        result = client.rollout(["after the fuzz"], 2)
    assert [len(g.samples) for g in result.groups] == [2]
    log = (daemon.run_dir / "controlplane.log").read_text().splitlines()
    crashes = [line for line in log if json.loads(line).get("level") in ("critical",)
               or "Traceback" in line]
    assert crashes == []
