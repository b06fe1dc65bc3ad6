"""Fuzzing a real daemon's engine socket: a fake engine sends random and malformed frames
before and after a valid hello, while rollouts run on the real sim engines (issue 14,
"beyond the fixes": both sockets).

A raw DEALER (``FakeEngine``) plays the engine. Its frames are garbage bytes, truncated or
mutated valid messages, wrong tags and frame counts, and well-formed messages with odd
values: negative counts, unknown and duplicated task ids, task ids of chunks it never got,
other engines' ids, huge token lists, NaN timings, agent hellos with absurd pools.

Nothing here depends on which frames happen to be valid. Whatever the daemon makes of a
frame, the fake keeps being a correct engine for the chunks it is really given: if some
frame registers it (a valid hello), each ``ChunkTask`` it receives is answered at once with
a correct result, and a fuzzed frame about a chunk it holds is not sent (that would be a
real engine failing a real chunk, which may fail a rollout by design). The invariants are
checked on the outcome: the daemon lives and answers ``status`` within a bound, every
rollout run meanwhile delivers every sample exactly once, every frame the codec refuses is
logged as ``engine_frame_rejected``, and no handler raised (``engine_message_failed``).

Cost: about 35 s alone on the shared 2-core machine (one sim daemon, 2 x 400 examples).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seer import protocol as p
from seer.client import SamplingParams, SeerClient
from seer.wire import VERSION_FRAME, Codec, FrameError, make_socket
from tests.daemon_helpers import Daemon, pid_alive, write_sim_config
from tests.wire_strategies import mutated, values, wire_ints

SIM_VOCAB = 259
ENGINE_TAGS = ["hello", "engine_heartbeat", "chunk_finished", "chunk_failed", "weights_loaded", "agent_hello",
               "pull_done"]
ENGINE_FIELDS = ["engine_id", "task_id", "token_ids", "logprobs", "finish_reason", "num_prompt_tokens",
                 "num_cached_tokens", "elapsed_ms", "kv_saved_tokens", "load", "error", "weights_version",
                 "capabilities", "pid", "protocol_version", "host_id", "transfer_id", "ok", "num_blocks", "geometry",
                 "pool_name", "transport", "address"]
_engine_side = Codec(p.EngineMessage | p.AgentMessage)  # what the daemon's engine socket decodes
_control = Codec(p.ControlMessage)
HOLD_S = 0.3  # the fake engine answers a chunk this long after receiving it

odd_floats = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300, 5.0]))
odd_counts = st.one_of(st.integers(-3, 600), wire_ints)


def caps(**overrides) -> p.EngineCapabilities:
    fields = dict(backend="sim", model="sim", dtype="float32", max_model_len=512, vocab_size=SIM_VOCAB,
                  kv_capacity_tokens=1_000_000, block_size=16)
    return p.EngineCapabilities(**{**fields, **overrides})


class FakeEngine:
    """The fuzzer's engine: one DEALER on the engine socket, a correct engine for any chunk
    it is given, whatever the daemon made of its fuzzed frames."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, address, bind=False,
                                identity=f"fuzz-{uuid.uuid4().hex[:12]}".encode())
        self.engine_ids: list[int] = []  # every id a HelloAccepted gave it, oldest first
        self.held: dict[int, tuple[p.ChunkTask, float]] = {}  # chunks received, not answered yet: when
        self.spoiled: set[str] = set()  # requests one of whose chunks got a fuzzed result
        self.answered: list[int] = []  # task ids it finished (fuzzed frames repeat them)
        self.num_rejected_frames = 0  # frames the daemon's codec refuses (each must be logged)
        self.num_tasks = 0

    def send(self, frames: list[bytes]) -> bool:
        """Send one fuzzed frame; False if it is not sent: a second fuzzed result for the
        same request (see ``spoiled``)."""
        try:
            msg = _engine_side.decode(frames)
        except FrameError:
            self.num_rejected_frames += 1
            msg = None
        if (isinstance(msg, (p.ChunkFinished, p.ChunkFailed)) and msg.task_id in self.held
                and self.engine_ids and msg.engine_id == self.engine_ids[-1]):
            # The fuzzed frame is this chunk's result: whatever the daemon makes of it (a
            # sample, a failure, nothing), the correct result is not sent. A request may
            # fail MAX_CHUNK_FAILURES times by design; one spoiled chunk per request keeps
            # every rollout able to finish.
            task, _ = self.held[msg.task_id]
            if task.request_id in self.spoiled:
                return False
            self.spoiled.add(task.request_id)
            del self.held[msg.task_id]
        self.sock.send_multipart(frames)
        return True

    def serve(self, wait_s: float) -> None:
        """Read what the daemon sent for ``wait_s`` (and until quiet); answer chunks correctly."""
        deadline = time.monotonic() + wait_s
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))) or time.monotonic() < deadline:
            if not self.sock.poll(0):
                continue
            msg = _control.decode(self.sock.recv_multipart())
            match msg:
                case p.HelloAccepted(engine_id=engine_id):
                    if engine_id not in self.engine_ids:
                        self.engine_ids.append(engine_id)
                case p.ChunkTask():
                    self.num_tasks += 1
                    self.held[msg.task_id] = (msg, time.monotonic())
                case p.AbortTasks(task_ids=task_ids):
                    for task_id in task_ids:
                        self.held.pop(task_id, None)
                case _:
                    pass
        # Held a little first, so fuzzed frames can be about chunks in flight here.
        for task, received_s in list(self.held.values()):
            if time.monotonic() - received_s >= HOLD_S:
                self._finish(task)
        for engine_id in self.engine_ids:
            self.sock.send_multipart(_control.encode(p.EngineHeartbeat(engine_id=engine_id, load=p.EngineLoad())))

    def _finish(self, task: p.ChunkTask) -> None:
        """A correct result: the whole budget of one ordinary token. Sent under every id it
        was admitted with (the chunk's engine is the one this identity is registered as; the
        others are refused as unregistered, which is harmless)."""
        n = task.sampling.max_tokens
        for engine_id in self.engine_ids:
            self.sock.send_multipart(_control.encode(p.ChunkFinished(
                engine_id=engine_id, task_id=task.task_id, token_ids=p.pack_token_ids([100] * n),
                logprobs=p.pack_logprobs([-0.5] * n), finish_reason="length",
                num_prompt_tokens=len(task.prompt_token_ids) // 4, num_cached_tokens=0, elapsed_ms=1.0)))
        del self.held[task.task_id]
        self.answered.append(task.task_id)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class Rollouts(threading.Thread):
    """Rollouts back to back on the real engines until stopped; each is checked for every
    (group, sample) exactly once."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.stop = threading.Event()
        self.num_done = 0
        self.errors: list[str] = []

    def run(self) -> None:
        with SeerClient(self.address, timeout_s=60) as client:
            while not self.stop.is_set():
                seen: list[tuple[int, int]] = []
                try:
                    client.rollout([f"q{i}" for i in range(12)], 3, SamplingParams(max_tokens=40, ignore_eos=True),
                                   policy="divided", on_group=lambda g: seen.extend(
                                       (g.group_index, s.sample_index) for s in g.samples))
                except Exception as exc:  # noqa: BLE001 - reported by the last test
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    return
                if sorted(seen) != [(i, j) for i in range(12) for j in range(3)]:
                    self.errors.append(f"rollout {self.num_done}: samples {sorted(seen)}")
                    return
                self.num_done += 1


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("engine-fuzz")
    # Deadlines long enough that a chunk held by the (busy) test process never expires; short
    # enough that one the daemon dropped on the floor would be re-dispatched within the test.
    config = write_sim_config(root / "sim.toml", chunk_deadline_min_s=10.0, chunk_deadline_unmeasured_s=10.0,
                              server={"client_timeout_s": 30.0})
    # No host KV pool: a fuzzed hello with a KV geometry would otherwise create one in /dev/shm.
    config.write_text(config.read_text() + "\n[kv_pool]\nenabled = false\n")
    daemon = Daemon(root / "run", config)
    info = daemon.start()
    fake = FakeEngine(info["engine_address"])
    rollouts = Rollouts(daemon.address)
    rollouts.start()
    yield daemon, info, fake, rollouts
    rollouts.stop.set()
    rollouts.join(60)
    fake.close()
    daemon.stop()


# ---------------------------------------------------------------------------- frames


@st.composite
def token_bytes(draw) -> bytes:
    """Packed token ids: ordinary, out of vocabulary, negative, many, or not a multiple of 4."""
    kind = draw(st.sampled_from(["ok", "odd", "many", "ragged"]))
    if kind == "ok":
        return p.pack_token_ids(draw(st.lists(st.integers(3, SIM_VOCAB - 1), max_size=20)))
    if kind == "odd":
        return p.pack_token_ids(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20)))
    if kind == "many":
        return p.pack_token_ids([100] * draw(st.sampled_from([600, 70_000])))
    return draw(st.binary(max_size=23))


class Mine(int):
    """Placeholder for the fake engine's own id (the k-th it was given), resolved when sent."""


class Answered(int):
    """Placeholder for a task id the fake engine already finished (a duplicated finish)."""


class Held(int):
    """Placeholder for a task id the fake engine holds (its result, fuzzed, instead of the correct one)."""


def resolve(fake: FakeEngine, value: int) -> int:
    if isinstance(value, Mine):
        return fake.engine_ids[int(value) % len(fake.engine_ids)] if fake.engine_ids else p.JOIN_ENGINE_ID
    if isinstance(value, Answered):
        return fake.answered[-1 - int(value) % len(fake.answered)] if fake.answered else 1
    if isinstance(value, Held):
        held = sorted(fake.held)
        return held[int(value) % len(held)] if held else 10**6
    return value


@st.composite
def engine_messages(draw) -> object:
    """A well-formed engine or agent message with values in and out of range (ids that
    depend on what the fake engine was given are placeholders: ``resolve``)."""
    engine_id = draw(st.one_of(st.integers(0, 3).map(Mine), st.sampled_from([0, 1, p.JOIN_ENGINE_ID]),
                               st.integers(-5, 9), wire_ints.filter(lambda v: -(2**63) <= v < 2**63)))
    task_ids = st.one_of(st.integers(0, 19).map(Answered), st.integers(0, 9).map(Held), st.integers(-3, 5000),
                         wire_ints.filter(lambda v: -(2**63) <= v < 2**63))
    i64 = st.integers(-(2**63), 2**63 - 1)
    kind = draw(st.sampled_from(["hello", "heartbeat", "finished", "finished", "finished", "failed", "weights",
                                 "agent_hello", "pull_done", "held"]))
    if kind == "held":  # a result, fuzzed, for a chunk in flight on the fake engine
        engine_id, task_ids = Mine(0), st.integers(0, 9).map(Held)
        kind = draw(st.sampled_from(["finished", "finished", "failed"]))
    if kind == "hello":
        capabilities = draw(st.one_of(st.just(caps()), st.builds(
            caps, vocab_size=st.sampled_from([0, 1, SIM_VOCAB, 2**31]), max_model_len=st.sampled_from([2, 512, 10**9]),
            kv_capacity_tokens=st.sampled_from([-1, 0, 16, 10**12]), block_size=st.sampled_from([0, 1, 16, -4]),
            kv_geometry=st.one_of(st.none(), st.builds(p.PoolGeometry, num_layers=st.integers(-1, 4),
                                                       num_kv_heads=st.integers(-1, 4), head_size=st.integers(0, 64),
                                                       block_size=st.integers(-1, 32),
                                                       dtype=st.sampled_from(["float32", "nope"]))))))
        return p.EngineHello(engine_id=engine_id, protocol_version=draw(st.sampled_from([p.PROTOCOL_VERSION, 0, 99])),
                             pid=draw(st.one_of(st.just(os.getpid()), i64)), capabilities=capabilities,
                             weights_version=draw(st.sampled_from([0, 0, 1, -1, 2**40])),
                             host_id=draw(st.sampled_from(["", "other-host", "\x00"])))
    if kind == "heartbeat":
        load = p.EngineLoad(num_running=draw(odd_counts.filter(lambda v: -(2**63) <= v < 2**63)),
                            num_waiting=draw(i64), kv_usage=draw(odd_floats), num_preemptions=draw(i64))
        return p.EngineHeartbeat(engine_id=engine_id, load=load)
    if kind == "finished":
        return p.ChunkFinished(
            engine_id=engine_id, task_id=draw(task_ids), token_ids=draw(token_bytes()),
            logprobs=draw(st.one_of(st.binary(max_size=40), st.lists(odd_floats, max_size=20).map(p.pack_logprobs))),
            finish_reason=draw(st.sampled_from(["stop", "length", "abort"])), num_prompt_tokens=draw(i64),
            num_cached_tokens=draw(i64), elapsed_ms=draw(odd_floats), kv_loaded_tokens=draw(i64),
            kv_load_failed_tokens=draw(i64), kv_load_ms=draw(odd_floats), kv_saved_tokens=draw(i64))
    if kind == "failed":
        return p.ChunkFailed(engine_id=engine_id, task_id=draw(task_ids), error=draw(st.text(max_size=30)))
    if kind == "weights":
        return p.WeightsLoaded(engine_id=engine_id, weights_version=draw(i64),
                               error=draw(st.one_of(st.none(), st.text(max_size=10))))
    if kind == "agent_hello":
        geometry = p.PoolGeometry(num_layers=draw(st.integers(-1, 4)), num_kv_heads=draw(st.integers(-1, 4)),
                                  head_size=draw(st.integers(-1, 64)), block_size=draw(st.integers(-1, 32)),
                                  dtype=draw(st.sampled_from(["float32", "bfloat16", "nope"])))
        return p.AgentHello(host_id=draw(st.sampled_from(["", "other-host", "x"])),
                            protocol_version=draw(st.sampled_from([p.PROTOCOL_VERSION, 7])), pid=draw(i64),
                            pool_name=draw(st.text(max_size=12)), geometry=geometry,
                            num_blocks=draw(st.sampled_from([-5, 0, 1, 64, 2**40, 2**62])),
                            transport=draw(st.sampled_from(["tcp", "ucx", "carrier-pigeon"])),
                            address=draw(st.text(max_size=12)))
    return p.PullDone(transfer_id=draw(i64), ok=draw(st.booleans()), num_bytes=draw(i64), seconds=draw(odd_floats),
                      error=draw(st.text(max_size=10)))


@st.composite
def tagged_engine_dicts(draw) -> dict:
    fields = draw(st.dictionaries(st.sampled_from(ENGINE_FIELDS), values, max_size=6))
    fields["type"] = draw(st.sampled_from(ENGINE_TAGS + ["rollout", "chunk_task", "nope", ""]))
    return fields


VALID_ENGINE_MESSAGES = [
    msgspec.msgpack.encode(m) for m in (
        p.EngineHello(engine_id=p.JOIN_ENGINE_ID, protocol_version=p.PROTOCOL_VERSION, pid=1, capabilities=caps(),
                      weights_version=0),
        p.EngineHeartbeat(engine_id=0, load=p.EngineLoad(num_running=1)),
        p.ChunkFinished(engine_id=0, task_id=1, token_ids=p.pack_token_ids([5, 6]), logprobs=p.pack_logprobs([0, 0]),
                        finish_reason="length", num_prompt_tokens=3, num_cached_tokens=0, elapsed_ms=2.0),
        p.ChunkFailed(engine_id=0, task_id=1, error="boom"),
        p.WeightsLoaded(engine_id=0, weights_version=1),
        p.PullDone(transfer_id=1, ok=True),
    )
]


def _encode_resolved(msg: object) -> Callable[[FakeEngine], bytes]:
    def build(fake: FakeEngine) -> bytes:
        fields = {f: resolve(fake, getattr(msg, f)) if f in ("engine_id", "task_id") else getattr(msg, f)
                  for f in msg.__struct_fields__}
        return msgspec.msgpack.encode(type(msg)(**fields))
    return build


def _const(payload: bytes) -> Callable[[FakeEngine], bytes]:
    return lambda fake: payload


# A frame is built when sent: placeholders in it take the fake engine's state of that moment.
Frame = Callable[[FakeEngine], list[bytes]]


def engine_frames() -> st.SearchStrategy[Frame]:
    plausible = engine_messages().map(_encode_resolved)
    payloads = st.one_of(
        plausible,
        st.binary(max_size=64).map(_const),
        values.map(msgspec.msgpack.encode).map(_const),
        tagged_engine_dicts().map(msgspec.msgpack.encode).map(_const),
        st.sampled_from(VALID_ENGINE_MESSAGES).flatmap(mutated).map(_const),
    )
    # Half the frames are well-formed messages with odd values (they get past the codec).
    return st.booleans().flatmap(lambda well_formed: plausible.map(
        lambda build: lambda fake: [VERSION_FRAME, build(fake)]) if well_formed else st.one_of(
        payloads.map(lambda build: lambda fake: [VERSION_FRAME, build(fake)]),
        st.lists(st.binary(max_size=32), min_size=1, max_size=4).map(lambda raw: lambda fake: raw),
        st.tuples(st.binary(max_size=16), payloads).map(lambda t: lambda fake: [t[0], t[1](fake)]),
        st.tuples(payloads, st.binary(max_size=8)).map(lambda t: lambda fake: [VERSION_FRAME, t[0](fake), t[1]]),
    ))


FUZZ = settings(max_examples=400, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


# ---------------------------------------------------------------------------- tests


@FUZZ
@given(frame=engine_frames())
def test_fuzzed_frames_before_a_hello(target, frame):
    """Random and malformed frames from a peer that has not said a valid hello (it may say
    one by chance: then it is an engine like any other)."""
    _daemon, _info, fake, _rollouts = target
    fake.send(frame(fake))
    fake.serve(0.005)


def test_a_valid_hello_registers_the_fake_engine(target):
    """Between the two fuzz runs: the fake says a correct hello as a joiner and is admitted."""
    _daemon, _info, fake, _rollouts = target
    fake.send(_control.encode(p.EngineHello(engine_id=p.JOIN_ENGINE_ID, protocol_version=p.PROTOCOL_VERSION,
                                            pid=os.getpid(), capabilities=caps(), weights_version=0)))
    deadline = time.monotonic() + 30
    while not fake.engine_ids and time.monotonic() < deadline:
        fake.serve(0.1)
    assert fake.engine_ids, "the fake engine's valid hello was never accepted"


@FUZZ
@given(frame=engine_frames())
def test_fuzzed_frames_after_a_hello(target, frame):
    """The same frames from a registered engine: its own id, its answered task ids (duplicated
    finishes), tasks never dispatched, other engines' ids."""
    _daemon, _info, fake, _rollouts = target
    fake.send(frame(fake))
    fake.serve(0.005)


def _events(daemon: Daemon) -> list[dict]:
    return [json.loads(line) for line in (daemon.run_dir / "controlplane.log").read_text().splitlines()]


def test_the_daemon_survived_and_every_rollout_was_exact(target):
    """After the fuzzing (runs last): the daemon lives and answers status within 5 s, the
    rollouts that ran meanwhile delivered every sample exactly once, one more completes, each
    refused frame was logged, and no handler raised."""
    daemon, info, fake, rollouts = target
    fake.serve(0.5)
    assert pid_alive(info["pid"])
    with SeerClient(daemon.address, timeout_s=5) as client:
        status = client.status()
    assert [e.state for e in status.engines][:2] == ["ready", "ready"]
    rollouts.stop.set()
    deadline = time.monotonic() + 120
    while rollouts.is_alive() and time.monotonic() < deadline:
        fake.serve(0.1)  # the fake engine still answers the chunks it is given
    assert not rollouts.is_alive(), "a rollout did not finish within 120 s"
    assert rollouts.errors == []
    assert rollouts.num_done >= 1
    with SeerClient(daemon.address, timeout_s=60) as client:
        result = client.rollout(["after the fuzz"] * 4, 2, SamplingParams(max_tokens=16))
    assert sorted((g.group_index, s.sample_index) for g in result.groups for s in g.samples) == [
        (i, j) for i in range(4) for j in range(2)]
    events = _events(daemon)
    assert sum(e["event"] == "engine_frame_rejected" for e in events) == fake.num_rejected_frames
    assert [e for e in events if e["event"] in ("engine_message_failed", "agent_message_failed", "tick_failed")
            or e.get("level") == "critical"] == []
