"""Engines earn trust (issue 14, defect 5): a joiner whose capabilities cannot serve the
model is refused naming the mismatch, and an engine that heartbeats but never finishes
its chunks stalls nothing: its chunks pass their deadline, go to another engine, and
every sample comes back exactly once."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import zmq

from seer.client import SamplingParams, SeerClient
from seer.protocol import (
    JOIN_ENGINE_ID,
    PROTOCOL_VERSION,
    ControlMessage,
    EngineCapabilities,
    EngineHeartbeat,
    EngineHello,
    EngineLoad,
    HelloAccepted,
    HelloRejected,
)
from seer.wire import Codec, make_socket
from tests.daemon_helpers import Daemon, wait_for, write_sim_config

SIM_VOCAB = 259


def caps(**overrides) -> EngineCapabilities:
    fields = dict(backend="sim", model="sim", dtype="float32", max_model_len=512, vocab_size=SIM_VOCAB,
                  kv_capacity_tokens=1_000_000, block_size=16)
    return EngineCapabilities(**{**fields, **overrides})


class StuckEngine(threading.Thread):
    """Joins, takes chunks and heartbeats forever, but never finishes a chunk."""

    def __init__(self, address: str, capabilities: EngineCapabilities) -> None:
        super().__init__(daemon=True)
        self.address, self.capabilities = address, capabilities
        self.answer: object = None
        self.num_tasks = 0
        self.stop = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        sock = make_socket(ctx, zmq.DEALER, self.address, bind=False, identity=f"join-{uuid.uuid4().hex[:12]}".encode())
        codec: Codec = Codec(ControlMessage)
        engine_id = JOIN_ENGINE_ID
        sock.send_multipart(codec.encode(EngineHello(engine_id=engine_id, protocol_version=PROTOCOL_VERSION,
                                                     pid=os.getpid(), capabilities=self.capabilities,
                                                     weights_version=0)))
        next_beat = 0.0
        while not self.stop.is_set():
            if sock.poll(100):
                msg = codec.decode(sock.recv_multipart())
                if isinstance(msg, HelloAccepted):
                    self.answer, engine_id = msg, msg.engine_id
                elif isinstance(msg, HelloRejected):
                    self.answer = msg
                    break
                elif type(msg).__name__ == "ChunkTask":
                    self.num_tasks += 1
            if isinstance(self.answer, HelloAccepted) and time.monotonic() >= next_beat:
                sock.send_multipart(codec.encode(EngineHeartbeat(engine_id=engine_id, load=EngineLoad())))
                next_beat = time.monotonic() + 0.5
        sock.close(0)
        ctx.term()


def _events(daemon: Daemon) -> list[dict]:
    return [json.loads(line) for line in (daemon.run_dir / "controlplane.log").read_text().splitlines()]


def test_a_joiner_that_cannot_serve_the_model_is_refused_naming_the_mismatch(tmp_path):
    """vocab_size=1 and max_model_len=2 are refused with HelloRejected naming the field and
    the daemon's value; rollouts still run on the good engine."""
    daemon = Daemon(tmp_path / "run", write_sim_config(tmp_path / "sim.toml", count=1))
    info = daemon.start()
    try:
        for bad, words in ((caps(vocab_size=1), ("vocab_size 1", str(SIM_VOCAB))),
                           (caps(max_model_len=2), ("max_model_len 2", "512"))):
            joiner = StuckEngine(info["engine_address"], bad)
            joiner.start()
            joiner.join(30)
            assert isinstance(joiner.answer, HelloRejected), joiner.answer
            assert all(w in joiner.answer.reason for w in words), joiner.answer.reason
        with SeerClient(daemon.address, timeout_s=60) as client:
            assert [e.engine_id for e in client.status().engines] == [0]
            result = client.rollout(["a", "b"], 2, SamplingParams(max_tokens=8))
            assert sum(len(g.samples) for g in result.groups) == 4
    finally:
        daemon.stop()
    rejected = [e for e in _events(daemon) if e["event"] == "engine_rejected"]
    assert len(rejected) == 2


def test_chunks_of_an_engine_that_never_finishes_are_redispatched_after_their_deadline(tmp_path):
    """A joined engine that heartbeats but never finishes: its chunks pass their deadline
    (2 s here), are redispatched to the sim engine, the stuck engine is marked unhealthy
    and gets no new work, and every sample comes back exactly once."""
    config = write_sim_config(tmp_path / "sim.toml", count=1, chunk_deadline_min_s=2.0,
                              chunk_deadline_unmeasured_s=2.0, heartbeat_timeout_s=30.0,
                              server={"client_timeout_s": 30.0})
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    stuck = StuckEngine(info["engine_address"], caps())
    stuck.start()
    try:
        with SeerClient(daemon.address, timeout_s=60) as client:
            wait_for(lambda: len(client.status().engines) == 2, 30, "the stuck engine to join")
            result = client.rollout([f"q{i}" for i in range(8)], 2, SamplingParams(max_tokens=16, ignore_eos=True))
            ids = sorted((g.group_index, s.sample_index) for g in result.groups for s in g.samples)
            assert ids == [(i, j) for i in range(8) for j in range(2)]
            assert stuck.num_tasks > 0
    finally:
        stuck.stop.set()
        daemon.stop()
    events = _events(daemon)
    timed_out = [e for e in events if e["event"] == "chunk_timed_out"]
    assert timed_out and {e["engine_id"] for e in timed_out} == {1}
    unhealthy = [e for e in events if e["event"] == "engine_unhealthy"]
    assert [e["engine_id"] for e in unhealthy] == [1]
    # No new work for it once unhealthy.
    at = events.index(unhealthy[0])
    assert not [e for e in events[at:] if e["event"] == "chunk_dispatched" and e.get("engine_id") == 1]
