"""The control plane's parts send nothing: they return an outbox of (peer, message) the
server delivers in order (controlplane/outbox.py)."""

from __future__ import annotations

import msgspec

from seer.config import SeerConfig
from seer.controlplane.membership import Membership
from seer.controlplane.outbox import ToClient, ToEngine, ToPeer
from seer.controlplane.registry import Registry
from seer.controlplane.scheduler import Dispatch, Scheduler
from seer.controlplane.sessions import ClientSessions
from seer.controlplane.tokenizer import ByteTokenizer
from seer.controlplane.weights import Weights
from seer.controlplane.kvpool.agents import Agents
from seer.controlplane.kvpool.segment import PoolSegmentOwner
from seer.protocol import (
    PROTOCOL_VERSION,
    AbortTasks,
    EngineCapabilities,
    EngineHello,
    ErrorReply,
    HelloAccepted,
    HelloRejected,
    LoadWeights,
    Prompt,
    RolloutAccepted,
    RolloutRequest,
    SamplingParams,
    WeightsUpdated,
)


def caps() -> EngineCapabilities:
    return EngineCapabilities(backend="sim", model="m", dtype="float32", max_model_len=512, vocab_size=300,
                              kv_capacity_tokens=100_000, block_size=16)


def hello(engine_id: int, pid: int, weights_version: int = 0, protocol_version: int = PROTOCOL_VERSION) -> EngineHello:
    return EngineHello(engine_id=engine_id, protocol_version=protocol_version, pid=pid,
                       weights_version=weights_version, capabilities=caps(), host_id="")


class Plane:
    """The server's parts wired as the server wires them, without sockets."""

    def __init__(self, tmp_path, config: SeerConfig | None = None) -> None:
        config = config or SeerConfig()
        clock = lambda: 0.0  # noqa: E731
        self.registry = Registry(config.engines.heartbeat_timeout_s)
        self.scheduler = Scheduler(config.scheduler, clock, registry=self.registry)
        self.weights = Weights()
        self.agents = Agents(config.kv_pool, self.scheduler, clock, local_host_id="here")
        self.clients = ClientSessions(config, self.scheduler, self.registry, ByteTokenizer(), self.weights,
                                      clock=clock)
        self.membership = Membership(config, self.registry, self.scheduler, self.agents,
                                     PoolSegmentOwner(config.kv_pool, config), engine_address="ipc://x",
                                     run_dir=tmp_path, clock=clock)


def request(rollout_id: str = "r") -> RolloutRequest:
    return RolloutRequest(call_id="call", rollout_id=rollout_id, prompts=[Prompt(prompt_token_ids=[5, 6, 7])],
                          group_size=2, sampling=SamplingParams(max_tokens=8))


def test_a_hello_is_answered_by_an_outbox_and_admits_the_engine(tmp_path):
    """A current engine's hello: admitted, and the answer is its ``HelloAccepted``; a
    repeated hello is answered again without a second admission."""
    plane = Plane(tmp_path)
    answer = plane.membership.on_hello(b"engine-0", hello(0, 10), plane.weights)
    assert answer.admitted and answer.sends == [ToEngine(0, HelloAccepted(engine_id=0))]
    again = plane.membership.on_hello(b"engine-0", hello(0, 10), plane.weights)
    assert not again.admitted and again.sends == [ToEngine(0, HelloAccepted(engine_id=0))]


def test_a_refused_hello_goes_to_the_peer_by_identity(tmp_path):
    """An engine speaking another protocol is not registered: the refusal is addressed to
    its identity, not to an engine id."""
    plane = Plane(tmp_path)
    answer = plane.membership.on_hello(b"engine-0", hello(0, 10, protocol_version=PROTOCOL_VERSION + 1),
                                       plane.weights)
    assert not answer.admitted
    ((send,),) = [answer.sends]
    assert isinstance(send, ToPeer) and send.identity == b"engine-0" and isinstance(send.msg, HelloRejected)


def test_an_engine_behind_on_weights_is_accepted_then_sent_the_checkpoint_in_that_order(tmp_path):
    """An engine with older weights gets ``HelloAccepted`` and then ``LoadWeights`` of the
    last update, in one outbox, and takes no work until it caught up."""
    plane = Plane(tmp_path)
    plane.weights.service_version, plane.registry.weights_path = 2, "/ckpt/2"
    answer = plane.membership.on_hello(b"engine-0", hello(0, 10, weights_version=1), plane.weights)
    assert not answer.admitted
    assert answer.sends == [ToEngine(0, HelloAccepted(engine_id=0)),
                            ToEngine(0, LoadWeights(path="/ckpt/2", weights_version=2))]
    assert plane.registry.ready_ids() == [] and plane.registry.updating_ids() == [0]


def test_a_failed_rollout_aborts_its_chunks_then_tells_its_client(tmp_path):
    """``fail`` returns the ``AbortTasks`` of the rollout's chunks in flight, then the
    client's ``ErrorReply``; nothing is left to send later."""
    plane = Plane(tmp_path)
    plane.membership.on_hello(b"engine-0", hello(0, 10), plane.weights)
    (accepted,) = plane.clients.on_request(b"client", request())
    assert isinstance(accepted, ToClient) and isinstance(accepted.msg, RolloutAccepted)
    dispatches = plane.scheduler.schedule()
    assert all(isinstance(d, Dispatch) for d in dispatches) and len(dispatches) == 2
    out = plane.clients.fail("r", "request_failed", "boom")
    assert out[0] == ToEngine(0, AbortTasks(task_ids=sorted(d.task.task_id for d in dispatches)))
    assert out[1] == ToClient(b"client", ErrorReply(call_id="call", code="request_failed", message="boom"))
    assert len(out) == 2 and "r" not in plane.clients.sessions


def test_a_rollout_without_drafts_on_ngram_engines_is_an_error_reply(tmp_path):
    """speculative=False on a daemon with speculative.method "ngram": ``speculative_unsupported``
    to the client, nothing submitted; the same request on grouped engines is accepted."""
    for method, expected in [("ngram", ErrorReply), ("grouped", RolloutAccepted)]:
        config = msgspec.convert({"speculative": {"method": method}}, SeerConfig)
        plane = Plane(tmp_path, config)
        plane.membership.on_hello(b"engine-0", hello(0, 10), plane.weights)
        (send,) = plane.clients.on_request(b"client", msgspec.structs.replace(request(), speculative=False))
        assert isinstance(send.msg, expected)
        if expected is ErrorReply:
            assert send.msg.code == "speculative_unsupported" and not plane.scheduler.rollouts


def test_a_refused_rollout_is_an_error_reply_to_its_client(tmp_path):
    """No engine ready: the request is answered with ``no_engines`` and nothing is submitted."""
    plane = Plane(tmp_path)
    ((send,),) = [plane.clients.on_request(b"client", request())]
    assert send.identity == b"client" and isinstance(send.msg, ErrorReply) and send.msg.code == "no_engines"
    assert not plane.scheduler.rollouts


def test_a_weights_update_sends_load_weights_to_each_engine_and_replies_once_answered():
    """``start`` returns one ``LoadWeights`` per engine at the next version; ``finish``
    returns the reply to the client that asked, and the service moves to that version."""
    weights = Weights()
    loads = weights.start(b"trainer", "call", "/ckpt/1", [0, 2], deadline_s=10.0)
    assert loads == [ToEngine(0, LoadWeights(path="/ckpt/1", weights_version=1)),
                     ToEngine(2, LoadWeights(path="/ckpt/1", weights_version=1))]
    assert weights.loaded(0, "") and weights.loaded(2, "") and weights.answered()
    update, reply = weights.finish()
    assert update.target_version == 1 == weights.service_version
    assert reply == [ToClient(b"trainer", WeightsUpdated(call_id="call", weights_version=1))]
