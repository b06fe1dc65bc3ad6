"""Every failure the client raises is a SeerError with a message (issue 14, defect 6).

Values that cannot go on the wire are refused before anything is sent (no daemon is
needed); a fake daemon (a bare ROUTER speaking the wire codec) plays the daemon that
answers heartbeats before, or instead of, the rollout request."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from seer.client import (
    AsyncSeerClient,
    SamplingParams,
    SeerClient,
    SeerError,
    SeerInputError,
    SeerProtocolError,
    SeerTimeoutError,
)
from seer.protocol import Ack, ClientHeartbeat, ClientMessage, RolloutRequest, ServiceStatus, StatusReply, StatusRequest
from seer.wire import Codec

NOWHERE = "ipc:///tmp/h-robust-no-daemon-here.sock"


@pytest.mark.parametrize(
    ("prompts", "sampling", "needle"),
    [
        ([[1, 2, 2**64]], SamplingParams(), "prompt 0: an integer does not fit in 64 bits"),
        (["hi"], SamplingParams(seed=2**64), "sampling: an integer does not fit in 64 bits"),
        (["\ud800 lone surrogate"], SamplingParams(), "not valid Unicode"),
        ([{"id": "x\udfff", "prompt": "hi"}], SamplingParams(), "not valid Unicode"),
        ([{"prompt_token_ids": [2**70]}], SamplingParams(), "prompt 0"),
        ([3.5], SamplingParams(), "prompt 0"),
    ],
)
def test_values_that_cannot_be_sent_raise_seer_input_error(prompts, sampling, needle):
    """Integers beyond 64 bits, lone surrogates and wrong prompt types raise SeerInputError
    (a SeerError) naming the problem, before any daemon is contacted."""
    with SeerClient(NOWHERE, timeout_s=1.0) as client:
        with pytest.raises(SeerInputError, match=needle) as info:
            client.rollout(prompts, 1, sampling)
    assert isinstance(info.value, SeerError)


class FakeDaemon:
    """A ROUTER that answers heartbeats with Ack and status with a canned reply, and
    answers a rollout request with ``rollout_reply`` (None: never)."""

    def __init__(self, rollout_reply: str | None) -> None:
        self.rollout_reply = rollout_reply
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.codec: Codec = Codec(ClientMessage)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        status = ServiceStatus(pid=1, policy="group", weights_version=0, engines=[], rollouts=[], run_dir="",
                               client_address=self.address)
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = self.codec.decode(frames)
            reply = None
            if isinstance(msg, ClientHeartbeat):
                reply = Ack(call_id=msg.call_id)
            elif isinstance(msg, RolloutRequest) and self.rollout_reply == "status":
                reply = StatusReply(call_id=msg.call_id, status=status)
            elif isinstance(msg, StatusRequest):
                reply = Ack(call_id=msg.call_id)  # the wrong answer on purpose
            if reply is not None:
                self.sock.send_multipart([identity, *self.codec.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake_daemon(request):
    daemon = FakeDaemon(getattr(request, "param", None))
    yield daemon
    daemon.close()


def test_heartbeat_acks_before_acceptance_end_in_a_timeout_not_an_assertion(fake_daemon):
    """A daemon that answers heartbeats but never the request (a frame beyond its hard cap is
    dropped unread) gives SeerTimeoutError saying so, after timeout_s in all."""

    async def go():
        async with AsyncSeerClient(fake_daemon.address, timeout_s=1.5, heartbeat_interval_s=0.1) as client:
            async for _ in client.stream_rollout(["hi"], 1):
                pass

    with pytest.raises(SeerTimeoutError, match="answers heartbeats but did not accept"):
        asyncio.run(asyncio.wait_for(go(), 30.0))


@pytest.mark.parametrize("fake_daemon", ["status"], indirect=True)
def test_an_unexpected_reply_to_a_rollout_is_a_protocol_error(fake_daemon):
    """A reply of the wrong type where RolloutAccepted belongs raises SeerProtocolError naming both types."""
    with SeerClient(fake_daemon.address, timeout_s=5.0) as client:
        with pytest.raises(SeerProtocolError, match="StatusReply.*RolloutAccepted"):
            client.rollout(["hi"], 1)


def test_an_unexpected_reply_to_status_is_a_protocol_error(fake_daemon):
    """status() answered with an Ack raises SeerProtocolError, not AssertionError."""
    with SeerClient(fake_daemon.address, timeout_s=5.0) as client:
        with pytest.raises(SeerProtocolError, match="Ack.*StatusReply"):
            client.status()


@pytest.mark.parametrize("address", ["foo", "tcp://", "ipc://" + "x" * 200])
def test_an_unusable_address_is_a_seer_input_error(address):
    """An address ZeroMQ cannot connect to raises SeerInputError naming it and the two forms."""
    with pytest.raises(SeerInputError, match="ipc://PATH"):
        SeerClient(address)


def test_missing_curve_key_files_are_a_seer_input_error(tmp_path):
    """ClientKeys pointing at missing files raise SeerInputError (not AuthError) on a tcp:// address."""
    from seer.client import ClientKeys

    keys = ClientKeys(tmp_path / "server.key", tmp_path / "client.key_secret")
    with pytest.raises(SeerInputError, match="server.key"):
        SeerClient("tcp://127.0.0.1:1", keys=keys)
