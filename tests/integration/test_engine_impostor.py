"""An engine's id belongs to the process that registered it (item 4b of "The daemon runs
for a week of training": any local process could take over a live engine's connection).

The engine socket no longer hands a routing id over to a second connection
(ZMQ_ROUTER_HANDOVER is off); engines connect under a fresh routing id per connection and
prove who they are with a secret in their hello (the supervisor's per-spawn secret, or the
one a joined engine chose). Checked here on sim daemons over ipc:

* a process that connects as ``engine-1`` while engine 1 serves, and sends a heartbeat,
  a hello without a secret and one with a wrong secret, is refused and logged each time,
  gets none of engine 1's pings or chunks, and engine 1 keeps its work: every chunk sent to
  it finishes on it, it is never declared lost, every sample comes back exactly once;
* a second connection under a live connection's exact routing id is dropped by ZeroMQ: it
  gets no answer, and the registered connection keeps its pings;
* a joined engine takes its id back only with its secret: a hello naming its id and
  control plane with a wrong secret is refused; the same secret from a new connection
  replaces the session (same id, no new engine), the old connection is no longer heard;
* a real joined engine (``seerctl engine --join``) that stood still past
  ``heartbeat_timeout_s`` and was declared lost comes back under the same id, as the same
  process. (A spawned engine coming back: tests/integration/test_daemon_stall.py.)

No timed assertions: counts, states and generous deadlines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import zmq

from seer.client import SamplingParams, SeerClient
from seer.protocol import (
    JOIN_ENGINE_ID,
    PROTOCOL_VERSION,
    ChunkTask,
    ControlMessage,
    EngineCapabilities,
    EngineHeartbeat,
    EngineHello,
    EngineLoad,
    HelloAccepted,
    HelloRejected,
    Ping,
)
from seer.wire import Codec, make_socket
from tests.daemon_helpers import SEERCTL, Daemon, stop_process, wait_for, write_sim_config

SIM_VOCAB = 259
WRONG_SECRET = "impostor-guess-3f9a61c2"  # must never appear in a log


def caps() -> EngineCapabilities:
    return EngineCapabilities(backend="sim", model="sim", dtype="float32", max_model_len=512, vocab_size=SIM_VOCAB,
                              kv_capacity_tokens=1_000_000, block_size=16)


def hello(engine_id: int, **fields: object) -> EngineHello:
    return EngineHello(**{"engine_id": engine_id, "protocol_version": PROTOCOL_VERSION, "pid": os.getpid(),
                          "capabilities": caps(), "weights_version": 0, **fields})


class Peer:
    """A raw DEALER on the engine socket under a routing id of the test's choosing; what it
    is sent is collected by a thread."""

    def __init__(self, address: str, identity: bytes) -> None:
        self.identity = identity
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, address, bind=False, identity=identity)
        self._codec: Codec = Codec(ControlMessage)
        self._lock = threading.Lock()
        self._outgoing: list[object] = []
        self.received: list[object] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send(self, msg: object) -> None:
        with self._lock:
            self._outgoing.append(msg)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                outgoing, self._outgoing = self._outgoing, []
            for msg in outgoing:
                self._sock.send_multipart(self._codec.encode(msg))
            if self._sock.poll(50):
                try:
                    msg = self._codec.decode(self._sock.recv_multipart())
                except Exception as exc:  # noqa: BLE001 - recorded as what arrived
                    msg = exc
                with self._lock:
                    self.received.append(msg)

    def of_type(self, kind: type) -> list:
        with self._lock:
            return [m for m in self.received if isinstance(m, kind)]

    def wait_for(self, kind: type, count: int = 1, timeout_s: float = 30.0) -> list:
        wait_for(lambda: len(self.of_type(kind)) >= count, timeout_s, f"{count} {kind.__name__} at {self.identity!r}")
        return self.of_type(kind)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close(0)
        self._ctx.term()


def _events(path: Path, name: str | None = None) -> list[dict]:
    if not path.exists():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [e for e in events if name is None or e.get("event") == name]


def _daemon(tmp_path: Path, **engines: object) -> Daemon:
    config = write_sim_config(tmp_path / "sim.toml", **{"heartbeat_timeout_s": 30.0, "stall_heartbeats": 30,
                                                        **engines}, server={"client_timeout_s": 120.0})
    daemon = Daemon(tmp_path / "run", config)
    daemon.info = daemon.start()
    return daemon


def test_an_impostor_under_a_live_engines_name_is_refused_and_the_engine_keeps_its_work(tmp_path):
    """While engine 1 serves a rollout, a raw DEALER named ``engine-1`` sends a heartbeat as
    engine 1 (asked to say hello: it is no registered connection), a hello for id 1 without
    a secret and one with a wrong secret (both refused, ``engine_claim_refused``). It gets no
    ping and no chunk; every chunk dispatched to engine 1 finishes on engine 1, engine 1 is
    never lost or re-registered, and every sample comes back exactly once."""
    daemon = _daemon(tmp_path, sim_step_s=0.02)
    impostor: Peer | None = None
    try:
        with SeerClient(daemon.address, timeout_s=120) as client:
            engines = {e.engine_id: e.pid for e in client.status().engines}
            assert sorted(engines) == [0, 1]
            result: dict = {}

            def roll() -> None:
                with SeerClient(daemon.address, timeout_s=120) as roller:
                    result["rollout"] = roller.rollout([f"prompt {i}" for i in range(16)], 4,
                                                       SamplingParams(max_tokens=64, ignore_eos=True))

            thread = threading.Thread(target=roll)
            thread.start()
            wait_for(lambda: any(e.engine_id == 1 and e.load.num_running > 0 for e in client.status().engines), 60,
                     "engine 1 to run chunks")
            impostor = Peer(daemon.info["engine_address"], b"engine-1")
            impostor.send(EngineHeartbeat(engine_id=1, load=EngineLoad()))
            [asked] = impostor.wait_for(HelloRejected)
            assert asked.say_hello_again and "no engine registered as b'engine-1'" in asked.reason
            impostor.send(hello(1))
            impostor.wait_for(HelloRejected, 2)
            impostor.send(hello(1, secret=WRONG_SECRET))
            rejections = impostor.wait_for(HelloRejected, 3)
            for refusal, words in zip(rejections[1:], ("carries no secret", "carries the wrong secret"), strict=True):
                assert not refusal.say_hello_again
                assert "engine id 1 belongs to the ready engine 1" in refusal.reason and words in refusal.reason
            assert {e.engine_id: (e.pid, e.state) for e in client.status().engines} == \
                   {i: (pid, "ready") for i, pid in engines.items()}
            thread.join(180)
            assert not thread.is_alive(), "the rollout did not finish"
            samples = sorted((g.group_index, s.sample_index, len(s.token_ids))
                             for g in result["rollout"].groups for s in g.samples)
            assert samples == [(i, j, 64) for i in range(16) for j in range(4)]
            assert any(1 in s.engine_ids for g in result["rollout"].groups for s in g.samples)
            # Engine 1 keeps serving: a second rollout runs on both engines.
            again = client.rollout([f"again {i}" for i in range(8)], 4, SamplingParams(max_tokens=8))
            assert sum(len(g.samples) for g in again.groups) == 32
            assert {e.engine_id: (e.pid, e.state) for e in client.status().engines} == \
                   {i: (pid, "ready") for i, pid in engines.items()}
            # Nothing of engine 1's reached the impostor: only the three refusals.
            assert len(impostor.received) == 3 and not impostor.of_type(Ping) and not impostor.of_type(ChunkTask)
    finally:
        if impostor is not None:
            impostor.close()
        daemon.stop()
    control = daemon.run_dir / "controlplane.log"
    refused = _events(control, "engine_claim_refused")
    assert [(e["engine_id"], e["identity"], e["secret_given"], e["holder_pid"]) for e in refused] == \
           [(1, "engine-1", False, engines[1]), (1, "engine-1", True, engines[1])]
    assert [e["identity"] for e in _events(control, "unregistered_engine_message")] == ["engine-1"]
    assert not _events(control, "engine_lost") and not _events(control, "engine_stalled")
    assert not _events(control, "chunk_timed_out")
    assert [e["engine_id"] for e in _events(control, "engine_ready")].count(1) == 1
    dispatched = {e["task_id"] for e in _events(control, "chunk_dispatched") if e["engine_id"] == 1}
    finished = {e["task_id"] for e in _events(control, "chunk_finished") if e["engine_id"] == 1}
    assert dispatched and dispatched == finished
    assert not _events(daemon.run_dir / "engine-1.log", "engine_rejoining")
    assert WRONG_SECRET not in control.read_text()


def test_a_second_connection_under_a_live_routing_id_is_dropped(tmp_path):
    """ROUTER_HANDOVER is off: a DEALER that connects under the routing id of a registered
    connection is never answered as that engine (no acceptance, no ping), and the registered
    connection keeps being pinged and stays ready."""
    daemon = _daemon(tmp_path, count=1)
    name = f"join-{uuid.uuid4().hex[:12]}".encode()
    engine = Peer(daemon.info["engine_address"], name)
    duplicate: Peer | None = None
    try:
        engine.send(hello(JOIN_ENGINE_ID))
        [accepted] = engine.wait_for(HelloAccepted)
        engine.wait_for(Ping)
        duplicate = Peer(daemon.info["engine_address"], name)
        for _ in range(3):
            duplicate.send(hello(JOIN_ENGINE_ID, pid=os.getpid() + 1))
            duplicate.send(EngineHeartbeat(engine_id=accepted.engine_id, load=EngineLoad()))
        pings = len(engine.of_type(Ping))
        engine.wait_for(Ping, pings + 4)  # the registered connection is still the engine
        engine.send(EngineHeartbeat(engine_id=accepted.engine_id, load=EngineLoad()))
        with SeerClient(daemon.address, timeout_s=60) as client:
            assert {e.engine_id: e.state for e in client.status().engines} == {0: "ready", accepted.engine_id: "ready"}
        assert not duplicate.of_type(HelloAccepted) and not duplicate.of_type(Ping)
        assert len(engine.of_type(HelloAccepted)) == 1
    finally:
        for peer in (engine, duplicate):
            if peer is not None:
                peer.close()
        daemon.stop()
    control = daemon.run_dir / "controlplane.log"
    assert [e["engine_id"] for e in _events(control, "engine_ready")] == [0, accepted.engine_id]
    assert not _events(control, "engine_lost")


def test_a_joined_engine_takes_its_id_back_only_with_its_secret(tmp_path):
    """A joiner registers with a secret and is told its id and the control plane. A new
    connection naming that id and control plane with a wrong secret is refused, and the
    joiner keeps its session; with the right secret (the same process reconnecting) it
    replaces the session: the same id, no new engine, and the old connection is asked to
    say hello again when it speaks."""
    daemon = _daemon(tmp_path, count=1)
    address = daemon.info["engine_address"]
    secret = "joiner-secret-" + uuid.uuid4().hex
    first = Peer(address, f"join-{uuid.uuid4().hex[:12]}".encode())
    peers = [first]
    try:
        first.send(hello(JOIN_ENGINE_ID, secret=secret))
        [accepted] = first.wait_for(HelloAccepted)
        engine_id, control_plane = accepted.engine_id, accepted.control_plane
        assert engine_id == 1 and control_plane
        claim = dict(previous_engine_id=engine_id, previous_control_plane=control_plane)
        impostor = Peer(address, f"join-{uuid.uuid4().hex[:12]}".encode())
        peers.append(impostor)
        impostor.send(hello(JOIN_ENGINE_ID, secret=WRONG_SECRET, **claim))
        [refusal] = impostor.wait_for(HelloRejected)
        assert not refusal.say_hello_again and "carries the wrong secret" in refusal.reason
        pings = len(first.of_type(Ping))
        first.wait_for(Ping, pings + 2)  # still the engine
        again = Peer(address, f"join-{uuid.uuid4().hex[:12]}".encode())
        peers.append(again)
        again.send(hello(JOIN_ENGINE_ID, secret=secret, **claim))
        [back] = again.wait_for(HelloAccepted)
        assert (back.engine_id, back.control_plane) == (engine_id, control_plane)
        first.send(EngineHeartbeat(engine_id=engine_id, load=EngineLoad()))
        [gone] = first.wait_for(HelloRejected)
        assert gone.say_hello_again
        again.wait_for(Ping)
        again.send(EngineHeartbeat(engine_id=engine_id, load=EngineLoad()))
        with SeerClient(daemon.address, timeout_s=60) as client:
            assert {e.engine_id: e.state for e in client.status().engines} == {0: "ready", 1: "ready"}
        assert not impostor.of_type(Ping) and not impostor.of_type(HelloAccepted)
    finally:
        for peer in peers:
            peer.close()
        daemon.stop()
    control = daemon.run_dir / "controlplane.log"
    assert [(e["engine_id"], e["secret_given"]) for e in _events(control, "engine_claim_refused")] == [(1, True)]
    assert [e["engine_id"] for e in _events(control, "engine_session_replaced")] == [1]
    assert [e["engine_id"] for e in _events(control, "engine_ready")] == [0, 1, 1]
    assert not _events(control, "engine_lost")
    text = control.read_text()
    assert secret not in text and WRONG_SECRET not in text


def test_a_joined_engine_declared_lost_comes_back_under_its_id(tmp_path):
    """A `seerctl engine --join` engine stands still (SIGSTOP) past heartbeat_timeout_s
    mid-rollout: it is declared lost, its work goes to engine 0, and when it wakes it
    registers again with its secret and is engine 1 again, as the same process; the rollout
    completes with every sample once and a second one is served."""
    heartbeat_s = 3.0
    config = write_sim_config(tmp_path / "sim.toml", count=1, heartbeat_timeout_s=heartbeat_s, sim_step_s=0.02,
                              server={"client_timeout_s": 120.0})
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    joined_log = tmp_path / "joined.log"
    joined = subprocess.Popen([*SEERCTL, "engine", "--join", info["engine_address"], "--config", str(config),
                               "--log-file", str(joined_log)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with SeerClient(daemon.address, timeout_s=120) as client:
            wait_for(lambda: {e.engine_id: e.state for e in client.status().engines} == {0: "ready", 1: "ready"}, 120,
                     "the joined engine")
            pids = {e.engine_id: e.pid for e in client.status().engines}
            assert pids[1] == joined.pid
            result: dict = {}

            def roll() -> None:
                with SeerClient(daemon.address, timeout_s=120) as roller:
                    result["rollout"] = roller.rollout([f"prompt {i}" for i in range(16)], 4,
                                                       SamplingParams(max_tokens=64, ignore_eos=True))

            thread = threading.Thread(target=roll)
            thread.start()
            wait_for(lambda: bool(client.status().rollouts), 30, "the rollout to start")
            os.kill(joined.pid, signal.SIGSTOP)
            try:
                time.sleep(3 * heartbeat_s)
            finally:
                os.kill(joined.pid, signal.SIGCONT)
            thread.join(180)
            assert not thread.is_alive(), "the rollout did not finish after the stall"
            samples = sorted((g.group_index, s.sample_index, len(s.token_ids))
                             for g in result["rollout"].groups for s in g.samples)
            assert samples == [(i, j, 64) for i in range(16) for j in range(4)]
            wait_for(lambda: {e.engine_id: (e.pid, e.state) for e in client.status().engines}
                     == {0: (pids[0], "ready"), 1: (joined.pid, "ready")}, 60,
                     "engine 1 ready again as the same process")
            again = client.rollout([f"again {i}" for i in range(8)], 4, SamplingParams(max_tokens=8))
            assert sum(len(g.samples) for g in again.groups) == 32
    finally:
        stop_process(joined)
        daemon.stop()
    control = daemon.run_dir / "controlplane.log"
    assert 1 in [e["engine_id"] for e in _events(control, "engine_lost")]
    ready = [(e["engine_id"], e["joined"], e["pid"]) for e in _events(control, "engine_ready") if e["engine_id"] == 1]
    assert len(ready) >= 2 and set(ready) == {(1, True, joined.pid)}
    assert not _events(control, "engine_claim_refused")
    assert _events(joined_log, "engine_rejoining")
