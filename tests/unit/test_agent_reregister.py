"""Host agents outliving control planes, the control plane's side (controlplane/kvpool/agents.py:
``Agents.on_hello`` / ``ping`` / ``lost`` / ``expire``) and the agent's clock
(dataplane/transfer/agent.py with ``seer.peer.PeerSession``).

An agent that hears no ping for ``engines.heartbeat_timeout_s`` says hello again, so the
control plane must take a repeated hello from the registered agent as a no-op (no second
pool, no transfer dropped), a hello from a new agent process for the host as a
replacement, and must not lose an agent that came back because of a pull it sent before.

No sockets: the scheduler core is real, the "wire" records what would be sent. Engine 0
runs on host A (the control plane's own), engine 1 on host B; ``placement = "migrate"``
moves every chunk to the other engine, so the second chunk waits for a pull into B.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import zmq

from structlog.testing import capture_logs

from seer.config import KVPoolConfig, SchedulerConfig
from seer.controlplane.kvpool.agents import Agents, ToAgent
from seer.controlplane.kvpool.table import LOCAL_HOST, PoolBinding
from seer.controlplane.outbox import Outbox
from seer.controlplane.scheduler import Dispatch, Scheduler
from seer.controlplane.state import Group, Request, Rollout
from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import PoolAllocator
from seer.dataplane.transfer.agent import Agent
from seer.peer import HELLO_REPEAT_S, PeerSession
from seer.protocol import (
    PROTOCOL_VERSION,
    AgentHello,
    EngineCapabilities,
    Ping,
    PullBlocks,
    PullDone,
    SamplingParams,
    unpack_token_ids,
)
from tests.unit.chunks import finished

BS = 16
GEOM = PoolGeometry(num_layers=2, num_kv_heads=1, head_size=8, block_size=BS, dtype="float32")
HOST_A, HOST_B = "host-a", "host-b"  # HOST_A is the control plane's own host
TIMEOUT_S = 10.0  # kv_pool.transfer_timeout_s


class Wire:
    """Stands in for the server and its engine socket: delivers an outbox, records what is
    sent; identities in ``gone`` are unreachable (ROUTER_MANDATORY's EHOSTUNREACH)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []
        self.gone: set[bytes] = set()
        self.agents: Agents | None = None

    def deliver(self, outbox: Outbox) -> list[Dispatch]:
        """Send what is not a chunk dispatch (telling ``Agents`` whether a ``ToAgent`` went
        out, as the server does); the dispatches, in order."""
        dispatches: list[Dispatch] = []
        for send in outbox:
            if isinstance(send, Dispatch):
                dispatches.append(send)
                continue
            identity = send.agent.identity if isinstance(send, ToAgent) else send.identity
            ok = identity not in self.gone
            if ok:
                self.sent.append((identity, send.msg))
            if isinstance(send, ToAgent):
                assert self.agents is not None
                dispatches += self.deliver(self.agents.delivered(send, ok))
        return dispatches

    def take(self, kind: type) -> list[tuple[bytes, object]]:
        out = [(i, m) for i, m in self.sent if isinstance(m, kind)]
        self.sent = [(i, m) for i, m in self.sent if not isinstance(m, kind)]
        return out


def hello(host: str, pool: str, pid: int, address: str) -> AgentHello:
    return AgentHello(host_id=host, protocol_version=PROTOCOL_VERSION, pid=pid, pool_name=pool, geometry=GEOM,
                      num_blocks=64, transport="tcp", address=address)


def caps() -> EngineCapabilities:
    return EngineCapabilities(backend="vllm", model="m", dtype="float32", max_model_len=4096, vocab_size=259,
                              kv_capacity_tokens=100_000, block_size=BS, kv_geometry=GEOM)


class Setup:
    def __init__(self) -> None:
        self.now = 0.0
        config = SchedulerConfig(policy="divided", chunk_size_tokens=16, kv_admission_fraction=1.0,
                                 placement="migrate")
        self.sched = Scheduler(config, lambda: self.now)
        self.sched.engine_joined(0, caps(), host_id=LOCAL_HOST)
        self.sched.engine_joined(1, caps(), host_id=HOST_B)
        self.sched.add_host_pool(PoolBinding(name="seer-kv-a", allocator=PoolAllocator(64, BS),
                                           fingerprint=GEOM.fingerprint, min_load_tokens=32))
        self.wire = Wire()
        self.agents = Agents(KVPoolConfig(transfer_timeout_s=TIMEOUT_S), self.sched, lambda: self.now,
                             local_host_id=HOST_A)
        self.wire.agents = self.agents
        assert self.wire.deliver(self.agents.on_hello(b"agent-a", hello(HOST_A, "seer-kv-a", 100, "tcp://a:1"))) == []
        assert self.wire.deliver(self.agents.on_hello(b"agent-b-200", hello(HOST_B, "seer-kv-b", 200, "tcp://b:1"))) == []

    def pull_in_flight(self) -> tuple[Request, PullBlocks]:
        """One request's first chunk runs on host A and saves its KV there; its second is
        placed on host B and waits for the pull the agents send to B's agent."""
        rollout = Rollout(rollout_id="r", policy="divided", accepted_s=0.0)
        group = Group(group_id="r/0", rollout=rollout, group_index=0, prompt_id="0")
        request = Request(request_id="r/0/0", group=group, sample_index=0, prompt_token_ids=[5] * 17,
                          sampling=SamplingParams(max_tokens=64, seed=1))
        group.requests.append(request)
        rollout.groups.append(group)
        self.sched.submit(rollout)
        (first,) = self.sched.schedule()
        assert first.engine_id == 0 and first.task.kv is not None and first.task.kv.save
        context = len(unpack_token_ids(first.task.prompt_token_ids))
        n = first.task.sampling.max_tokens
        self.sched.chunk_finished(finished(0, first.task.task_id, [7] * n, [-0.5] * n, "length",
                                  kv_saved_tokens=context + n - 1))
        assert self.sched.schedule() == [], "the moved chunk waits for its KV"
        assert self.wire.deliver(self.agents.transfers()) == []
        ((identity, pull),) = self.wire.take(PullBlocks)
        assert identity == b"agent-b-200"
        return request, pull


def only_dispatch(dispatches: list[Dispatch]) -> Dispatch:
    (d,) = dispatches
    return d


# ---------------------------------------------------------------------- the agent's clock

def test_the_watch_says_hello_again_only_after_the_timeout_then_every_repeat_until_heard():
    """Silence up to ``timeout_s`` is fine; past it the hello is due at once, then every
    ``repeat_s``; the next message ends it and reports how long the control plane was lost."""
    watch = PeerSession(timeout_s=30.0, last_heard_s=100.0, repeat_s=3.0)
    assert not watch.hello_due(129.9) and not watch.hello_due(130.0)
    assert watch.heard(129.0) is None  # a ping: the clock starts again
    assert not watch.hello_due(158.0)
    assert watch.hello_due(159.5) and watch.lost_since_s == 159.5
    assert not watch.hello_due(160.0) and not watch.hello_due(162.4)
    assert watch.hello_due(162.5)
    assert watch.hello_due(166.0) and not watch.hello_due(168.0)
    assert watch.heard(170.0) == 10.5 and watch.lost_since_s is None
    assert not watch.hello_due(199.0)
    assert watch.hello_due(200.5)  # lost again later: at once, not at the old repeat time


class _NoPeerSocket:
    """A DEALER with no connection to take a message: a NOBLOCK send raises ``zmq.Again``
    (a blocking one would never return -- the test fails instead of hanging)."""

    def __init__(self, refuse: int) -> None:
        self.refuse = refuse  # sends to refuse before the connection comes up
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        assert flags & zmq.NOBLOCK, "a blocking send with no peer would hang the agent"
        if self.refuse > 0:
            self.refuse -= 1
            raise zmq.Again()
        self.sent.append(frames)


def test_a_hello_that_cannot_be_sent_is_repeated_every_few_seconds_not_after_the_timeout():
    """No connection yet: the agent neither blocks nor waits out ``timeout_s`` (30 s) before
    trying again; it repeats the hello every ``HELLO_REPEAT_S`` until one is sent."""
    now = [100.0]
    segment = SimpleNamespace(path=Path("/dev/shm/seer-test-pool"), geometry=GEOM, num_blocks=4)
    sock = _NoPeerSocket(refuse=2)
    agent = Agent(segment, SimpleNamespace(address="tcp://10.0.0.2:1"), sock, "tcp", pull_timeout_s=5.0,
                  control_plane_timeout_s=30.0, clock=lambda: now[0])
    with capture_logs() as logs:
        agent._send_hello()  # refused
        assert not sock.sent and any(e["event"] == "agent_send_dropped" for e in logs)
        now[0] += HELLO_REPEAT_S - 0.1
        agent._check_control_plane()
        assert agent.num_hellos == 1  # not yet
        now[0] += 0.1
        agent._check_control_plane()  # refused again
        now[0] += HELLO_REPEAT_S
        agent._check_control_plane()  # sent
    assert agent.num_hellos == 3 and len(sock.sent) == 1
    assert now[0] - 100.0 < 30.0


# ---------------------------------------------------------------------- repeated and new hellos

def test_a_repeated_hello_from_the_registered_agent_changes_nothing():
    """The same agent (identity, pool, address) says hello again with a pull in flight to
    it: no dispatch, the same registration and the same pool object (no second allocator),
    the pull still awaited -- its PullDone moves the KV and the chunk loads it. Logged once."""
    s = Setup()
    request, pull = s.pull_in_flight()
    record, pool_b = s.agents.by_host[HOST_B], s.sched.kv.pools[HOST_B]
    held = pool_b.allocator.num_used
    with capture_logs() as logs:
        assert s.wire.deliver(s.agents.on_hello(b"agent-b-200", hello(HOST_B, "seer-kv-b", 200, "tcp://b:1"))) == []
        assert s.wire.deliver(s.agents.on_hello(b"agent-a", hello(HOST_A, "seer-kv-a", 100, "tcp://a:1"))) == []
    assert not [e for e in logs if e["event"] in ("kv_agent_registered", "kv_transfer_given_up")]
    assert s.agents.by_host[HOST_B] is record and s.sched.kv.pools[HOST_B] is pool_b
    assert len(s.sched.kv.pools) == 2 and pool_b.allocator.num_used == held > 0
    assert pull.transfer_id in s.agents.sent and pull.transfer_id in s.sched.kv.transfers
    with capture_logs() as logs:
        d = only_dispatch(s.agents.on_pull_done(b"agent-b-200", PullDone(transfer_id=pull.transfer_id, ok=True)))
    assert [e["event"] for e in logs if e["event"].startswith("kv_")] == ["kv_transferred"]
    assert d.engine_id == 1 and d.task.kv is not None and d.task.kv.valid_tokens == request.kv_valid_tokens > 0
    assert d.task.kv.pool_name == "seer-kv-b"


def test_a_new_agent_process_for_the_host_replaces_the_old_one_and_its_pulls_are_given_up():
    """Another process registers for host B (same segment, new identity and address): it
    replaces the old one at once, the pull sent to the old one is given up (the chunk goes
    with re-prefill now, not after the timeout) and its blocks stay held until it answers;
    when that pull's timeout passes, the new agent is not taken as lost."""
    s = Setup()
    request, pull = s.pull_in_flight()
    pool_b = s.sched.kv.pools[HOST_B]
    with capture_logs() as logs:
        d = only_dispatch(s.wire.deliver(s.agents.on_hello(b"agent-b-300", hello(HOST_B, "seer-kv-b", 300, "tcp://b:2"))))
    assert d.engine_id == 1 and d.task.kv is not None and d.task.kv.valid_tokens == 0  # re-prefill
    (given_up,) = [e for e in logs if e["event"] == "kv_transfer_given_up"]
    assert given_up["transfer_id"] == pull.transfer_id and "another agent process" in given_up["reason"]
    (registered,) = [e for e in logs if e["event"] == "kv_agent_registered"]
    assert registered["replaced_pid"] == 200
    assert s.agents.by_host[HOST_B].identity == b"agent-b-300"
    assert s.sched.kv.pools[HOST_B] is pool_b and pool_b.address == "tcp://b:2"
    held = s.sched.kv.transfers[pull.transfer_id].dst_blocks
    assert all(b in pool_b.allocator.blocks_of(pull.key) for b in held)

    s.now = TIMEOUT_S + 1.0
    with capture_logs() as logs:
        assert s.agents.expire(s.now) == []
    assert not [e for e in logs if e["event"] in ("kv_agent_lost", "kv_transfer_timed_out")]
    assert s.agents.by_host[HOST_B].identity == b"agent-b-300" and HOST_B in s.sched.kv.pools
    with capture_logs() as logs:  # the old process answers after all: its blocks are free again
        assert s.agents.on_pull_done(b"agent-b-200", PullDone(transfer_id=pull.transfer_id, ok=False)) == []
    assert [e["event"] for e in logs if e["event"].startswith("kv_")] == ["kv_transfer_answered_late"]
    assert not pool_b.allocator.blocks_of(pull.key)
    assert request.kv_key != pull.key


def test_a_pull_done_from_another_agent_than_the_pull_was_sent_to_is_ignored():
    """Transfer ids start at 1 with every control plane, and an agent's socket delivers the
    answer to a pull of the previous control plane to the next one: a PullDone for a pull in
    flight, from an agent it was not sent to, is ignored; the pull is still awaited."""
    s = Setup()
    _, pull = s.pull_in_flight()
    with capture_logs() as logs:
        assert s.agents.on_pull_done(b"agent-a", PullDone(transfer_id=pull.transfer_id, ok=True)) == []
        assert s.agents.on_pull_done(b"agent-x", PullDone(transfer_id=pull.transfer_id, ok=True)) == []
    assert [e["event"] for e in logs] == ["pull_done_from_unknown_peer"] * 2
    assert pull.transfer_id in s.agents.sent and pull.transfer_id in s.sched.kv.transfers
    d = only_dispatch(s.agents.on_pull_done(b"agent-b-200", PullDone(transfer_id=pull.transfer_id, ok=True)))
    assert d.engine_id == 1 and d.task.kv is not None and d.task.kv.valid_tokens > 0


# ---------------------------------------------------------------------- pings, lost and back

def test_every_registered_agent_is_pinged_and_one_that_cannot_be_reached_is_lost():
    """``ping`` sends a Ping to each registered agent. An agent whose connection is closed
    is lost (its host's pool goes); when it says hello again it is registered anew."""
    s = Setup()
    assert s.wire.deliver(s.agents.ping()) == []
    assert sorted(i for i, _ in s.wire.take(Ping)) == [b"agent-a", b"agent-b-200"]
    s.wire.gone.add(b"agent-b-200")
    with capture_logs() as logs:
        assert s.wire.deliver(s.agents.ping()) == []
    (lost,) = [e for e in logs if e["event"] == "kv_agent_lost"]
    assert lost["host_id"] == HOST_B and "unreachable" in lost["reason"]
    assert HOST_B not in s.agents.by_host and HOST_B not in s.sched.kv.pools
    assert [i for i, _ in s.wire.take(Ping)] == [b"agent-a"]
    assert s.wire.deliver(s.agents.ping()) == [] and [i for i, _ in s.wire.take(Ping)] == [b"agent-a"]  # no more pings to it

    s.wire.gone.clear()
    with capture_logs() as logs:
        s.wire.deliver(s.agents.on_hello(b"agent-b-200", hello(HOST_B, "seer-kv-b", 200, "tcp://b:1")))
    assert [e["event"] for e in logs] == ["kv_agent_registered"]
    assert s.sched.kv.pools[HOST_B].has_agent
    s.wire.deliver(s.agents.ping())
    assert sorted(i for i, _ in s.wire.take(Ping)) == [b"agent-a", b"agent-b-200"]


def test_an_agent_lost_and_back_is_not_lost_again_because_of_a_pull_sent_before():
    """B's agent is lost with a pull in flight (the pull ends with its pool; the chunk
    re-prefills) and says hello again: when the old pull's timeout passes it is logged, but
    the agent that came back stays registered."""
    s = Setup()
    _, pull = s.pull_in_flight()
    d = only_dispatch(s.agents.lost(HOST_B, "test"))
    assert d.engine_id == 1 and d.task.kv is None  # B has no pool now: plain re-prefill
    s.wire.deliver(s.agents.on_hello(b"agent-b-200", hello(HOST_B, "seer-kv-b", 200, "tcp://b:1")))
    s.now = TIMEOUT_S + 1.0
    with capture_logs() as logs:
        s.agents.expire(s.now)
    assert [e["transfer_id"] for e in logs if e["event"] == "kv_transfer_timed_out"] == [pull.transfer_id]
    assert not [e for e in logs if e["event"] == "kv_agent_lost"]
    assert HOST_B in s.agents.by_host and s.sched.kv.pools[HOST_B].has_agent


def test_losing_the_local_agent_gives_up_pulls_into_the_local_pool_at_once():
    """The control plane's own agent is lost while a pull into its pool is in flight: the
    pool stays (local engines use it) but the chunk waiting for the pull goes now, with
    re-prefill, instead of after ``transfer_timeout_s``."""
    s = Setup()
    request, pull = s.pull_in_flight()
    # Finish the move to B, then the third chunk moves back to A and waits for a pull into A.
    d2 = only_dispatch(s.agents.on_pull_done(b"agent-b-200", PullDone(transfer_id=pull.transfer_id, ok=True)))
    context = len(unpack_token_ids(d2.task.prompt_token_ids))
    n = d2.task.sampling.max_tokens
    s.sched.chunk_finished(finished(1, d2.task.task_id, [7] * n, [-0.5] * n, "length", kv_saved_tokens=context + n - 1))
    assert s.sched.schedule() == []
    s.wire.deliver(s.agents.transfers())
    ((identity, back),) = s.wire.take(PullBlocks)
    assert identity == b"agent-a"
    with capture_logs() as logs:
        d3 = only_dispatch(s.agents.lost(LOCAL_HOST, "agent process 100 exited with code 1"))
    assert d3.engine_id == 0 and d3.task.kv is not None and d3.task.kv.valid_tokens == 0
    assert [e["transfer_id"] for e in logs if e["event"] == "kv_transfer_given_up"] == [back.transfer_id]
    assert s.sched.pool is not None and not s.sched.pool.has_agent
    assert request.kv_key != back.key
