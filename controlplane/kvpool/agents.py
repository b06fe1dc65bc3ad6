"""Host agents as the control plane sees them, and the KV transfers it sends them.

One agent per host (``python -m seer.dataplane.transfer.agent``) serves its host's KV pool to
other hosts and pulls blocks into it. It connects to the engine address like an engine
(same socket, same CURVE keys) and registers with ``AgentHello``; that hello is what
gives a remote host a pool in the scheduler (``add_host_pool``) -- the control plane's
own pool is created by ``segment.py`` and the hello only adds how to reach it.

Owns: which agent (ZeroMQ identity) serves which host, the ``PullBlocks`` sent and when
(a pull unanswered after ``kv_pool.transfer_timeout_s`` is given up: its chunk goes with
re-prefill), the ``Ping`` every registered agent gets each tick, and the events
``kv_agent_registered``, ``kv_agent_lost``, ``kv_transferred``, ``kv_transfer_failed``,
``kv_transfer_timed_out``, ``kv_transfer_given_up``. Which blocks move and which chunk
waits is the scheduler's decision (``table.py``); this module only carries it. It sends
nothing itself: it returns an ``Outbox`` (``outbox.py``) the server delivers, and hears back
through ``delivered`` whether each ``ToAgent`` went out (a ping that cannot be sent loses
the agent; a pull that cannot be sent fails its transfer).

Agents outlive control planes: one that hears no ping for ``engines.heartbeat_timeout_s``
says hello again (that is how a restarted control plane learns about it), so a hello
from the agent already registered is a no-op. A hello from another agent process for
the same host replaces the old one; pulls sent to the old one are given up at once.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from seer.config import KVPoolConfig
from seer.controlplane.kvpool.table import LOCAL_HOST, PoolBinding, Transfer
from seer.controlplane.outbox import Outbox, ToPeer
from seer.controlplane.scheduler import Scheduler
from seer.dataplane.kvpool import PoolAllocator
from seer.dataplane.host import host_id
from seer.protocol import (
    PROTOCOL_VERSION,
    AgentHello,
    HelloRejected,
    PoolGeometry,
    Ping,
    PullBlocks,
    PullDone,
    pack_token_ids,
)

log = structlog.get_logger()


def reachable_ip(address: str) -> str:
    """The local IP other hosts reach this one at, judged by the route to a ZeroMQ
    ``tcp://HOST:PORT`` address (no packet is sent); loopback for ipc:// and local peers."""
    if not address.startswith("tcp://"):
        return "127.0.0.1"
    host, _, port = address[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    if host in ("*", "0.0.0.0", ""):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port or 9)))
        return probe.getsockname()[0]



# The most blocks one host's pool may have: its allocator keeps a list of free block ids
# (about 36 bytes each here), so an agent's hello must not make it allocate without bound.
# 4 Mi blocks is 1.5 TiB of SmolLM2-135M KV at 16 tokens per block; larger models have larger blocks.
MAX_POOL_BLOCKS = 1 << 22

_DTYPES = ("float32", "bfloat16", "float16")


def refuse_geometry(geometry: PoolGeometry) -> str:
    """Why a pool block geometry (an agent's, or an engine's hello) is not one ('' if it is)."""
    sizes = {"num_layers": geometry.num_layers, "num_kv_heads": geometry.num_kv_heads,
             "head_size": geometry.head_size, "block_size": geometry.block_size}
    bad = {name: size for name, size in sizes.items() if not 1 <= size <= 1 << 20}
    if bad:
        return f"{bad} must be from 1 to {1 << 20}"
    if geometry.dtype not in _DTYPES:
        return f"dtype {geometry.dtype!r} is not one of {', '.join(_DTYPES)}"
    return ""

@dataclass(eq=False)
class AgentRecord:
    host_id: str  # as the scheduler knows it (LOCAL_HOST for the control plane's own)
    identity: bytes
    pid: int
    pool_name: str
    transport: str
    address: str


@dataclass
class SentPull:
    transfer: Transfer
    sent_s: float
    agent: AgentRecord  # the registration it was sent to (an agent lost and back is a new one)
    timed_out: bool = False  # given up (no answer in time, its agent replaced); a late answer still frees it


@dataclass(frozen=True)
class ToAgent:
    """To a registered host agent; the server reports whether it went out (``Agents.delivered``)."""

    agent: AgentRecord
    msg: Ping | PullBlocks
    transfer: Transfer | None = None  # the pull this command starts


class Agents:
    def __init__(self, config: KVPoolConfig, scheduler: Scheduler, clock: Callable[[], float],
                 local_host_id: str | None = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self._clock = clock
        self.local_host_id = local_host_id if local_host_id is not None else host_id()
        self.by_host: dict[str, AgentRecord] = {}
        self.sent: dict[int, SentPull] = {}

    def core_host(self, reported: str) -> str:
        """The scheduler's name for a host an engine or agent reported."""
        return LOCAL_HOST if reported in ("", self.local_host_id) else reported

    def is_agent(self, identity: bytes) -> bool:
        return any(a.identity == identity for a in self.by_host.values())

    # ------------------------------------------------------------------ agents
    def on_hello(self, identity: bytes, hello: AgentHello) -> Outbox:
        host = self.core_host(hello.host_id)
        reason = ""
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = f"agent speaks protocol {hello.protocol_version}, control plane {PROTOCOL_VERSION}"
        elif geometry_error := refuse_geometry(hello.geometry):
            reason = f"agent's pool geometry: {geometry_error}"
        elif not 1 <= hello.num_blocks <= MAX_POOL_BLOCKS:
            reason = (f"agent's pool has {hello.num_blocks} blocks, this control plane tracks 1 to {MAX_POOL_BLOCKS} "
                      "per host; lower kv_pool.pool_gib on that host")
        elif hello.transport != self.config.transport:
            reason = (f"agent uses transport {hello.transport!r}, kv_pool.transport is {self.config.transport!r}; "
                      "start every host's agent with the daemon's config")
        local = self.scheduler.pool
        if not reason and host == LOCAL_HOST and (local is None or local.name != hello.pool_name):
            reason = (f"agent of the control plane's host registers pool {hello.pool_name!r}, the control plane "
                      f"owns {local.name if local else 'none'}")
        if reason:
            log.error("kv_agent_rejected", host_id=hello.host_id, pid=hello.pid, reason=reason)
            return [ToPeer(identity, HelloRejected(reason=reason))]
        old = self.by_host.get(host)
        same = old is not None and (old.identity, old.pool_name, old.address) == (identity, hello.pool_name,
                                                                                  hello.address)
        if same:
            # The registered agent again: it heard no ping for a while (or its hellos were
            # queued while no control plane listened). Its pool, its pulls: all unchanged.
            log.debug("kv_agent_hello_repeated", host_id=hello.host_id, pid=hello.pid)
            return []
        self.by_host[host] = AgentRecord(host, identity, hello.pid, hello.pool_name, hello.transport,
                                         hello.address)
        out: Outbox = self._give_up_pulls(old, "another agent process registered for its host") if old else []
        if host == LOCAL_HOST:
            assert local is not None
            binding = PoolBinding(name=local.name, allocator=local.allocator, fingerprint=local.fingerprint,
                                  min_load_tokens=local.min_load_tokens, host_id=LOCAL_HOST,
                                  transport=hello.transport, address=hello.address)
        else:
            binding = PoolBinding(name=hello.pool_name,
                                  allocator=PoolAllocator(hello.num_blocks, hello.geometry.block_size),
                                  fingerprint=hello.geometry.fingerprint,
                                  min_load_tokens=self.config.min_load_tokens, host_id=host,
                                  transport=hello.transport, address=hello.address)
        log.info("kv_agent_registered", host_id=hello.host_id, pid=hello.pid, pool=hello.pool_name,
                 num_blocks=hello.num_blocks, transport=hello.transport, address=hello.address,
                 geometry=hello.geometry.fingerprint,
                 replaced=old is not None and old.pool_name != hello.pool_name,
                 replaced_pid=old.pid if old is not None and old.identity != identity else None)
        return out + self.scheduler.add_host_pool(binding)

    def ping(self) -> Outbox:
        """Ping every registered agent (each tick): an agent that hears none for
        ``engines.heartbeat_timeout_s`` says hello again. One the socket cannot reach any
        more (its connection closed: the process is gone) is lost when that ping is
        ``delivered``, not at its next pull."""
        return [ToAgent(agent, Ping()) for agent in self.by_host.values()]

    def delivered(self, send: ToAgent, ok: bool) -> Outbox:
        """Whether a ``ToAgent`` went out: a pull sent is waited for (its clock starts now),
        one that could not be sent fails its transfer; an agent a ping cannot reach is lost."""
        if send.transfer is not None:
            if ok:
                self.sent[send.transfer.transfer_id] = SentPull(send.transfer, self._clock(), send.agent)
                return []
            return self._failed(send.transfer, "no agent reachable on the destination host", None)
        if not ok and self.by_host.get(send.agent.host_id) is send.agent:
            return self.lost(send.agent.host_id, "unreachable: its connection to the control plane is closed")
        return []

    def lost(self, host: str, reason: str) -> Outbox:
        """A host's agent is gone (its process exited): its pool takes no part any more.
        If it comes back (it says hello again), it is registered like a new one."""
        agent = self.by_host.pop(host, None)
        if agent is None:
            return []
        log.error("kv_agent_lost", host_id=host or self.local_host_id, reason=reason,
                  effect="KV at home on that host is re-prefilled where it runs next")
        if host == LOCAL_HOST:  # the segment is still there for local engines; no transfers
            out = self._give_up_pulls(agent, f"its agent is lost ({reason})")
            pool = self.scheduler.pool
            if pool is not None:
                out += self.scheduler.add_host_pool(PoolBinding(
                    name=pool.name, allocator=pool.allocator, fingerprint=pool.fingerprint,
                    min_load_tokens=pool.min_load_tokens))
            return out
        return self.scheduler.remove_host_pool(host)  # ends the pulls into it (as failed)

    # ------------------------------------------------------------------ transfers
    def transfers(self) -> Outbox:
        """A ``PullBlocks`` to its destination host's agent for every transfer the scheduler
        decided; a transfer with no agent to send it to ends as failed (its chunk re-prefills)."""
        out: Outbox = []
        for transfer in self.scheduler.take_transfers():
            agent = self.by_host.get(transfer.dst.host_id)
            command = PullBlocks(transfer_id=transfer.transfer_id, transport=transfer.src.transport,
                                 address=transfer.src.address, src_blocks=pack_token_ids(transfer.src_blocks),
                                 dst_blocks=pack_token_ids(transfer.dst_blocks), key=transfer.key,
                                 weights_version=transfer.kv_epoch, verify=self.config.verify_checksums)
            if agent is not None:
                out.append(ToAgent(agent, command, transfer))
            else:
                out += self._failed(transfer, "no agent reachable on the destination host", None)
        return out

    def on_pull_done(self, identity: bytes, done: PullDone) -> Outbox:
        sent = self.sent.get(done.transfer_id)
        # Only the agent a pull was sent to answers it: transfer ids start at 1 again with
        # every control plane, and an agent's socket delivers a PullDone meant for the
        # previous one to its successor.
        from_its_agent = sent.agent.identity == identity if sent is not None else self.is_agent(identity)
        if not from_its_agent:
            log.warning("pull_done_from_unknown_peer", identity=identity.decode(errors="replace"),
                        transfer_id=done.transfer_id)
            return []
        self.sent.pop(done.transfer_id, None)
        transfer, dispatches = self.scheduler.transfer_finished(done.transfer_id, done.ok)
        if transfer is None:
            log.debug("stale_pull_done_ignored", transfer_id=done.transfer_id)
            return []
        rtt_ms = round((self._clock() - sent.sent_s) * 1000.0, 3) if sent is not None else None
        fields = self._fields(transfer)
        if transfer.abandoned:
            log.info("kv_transfer_answered_late", **fields, ok=done.ok, rtt_ms=rtt_ms)
        elif done.ok:
            since = transfer.chunk_waits_since_s
            log.info("kv_transferred", **fields, num_bytes=done.num_bytes, ms=round(done.seconds * 1000.0, 3),
                     rtt_ms=rtt_ms, chunk_waited_ms=round((self._clock() - since) * 1000.0, 3) if since is not None
                     else 0.0)
        else:
            log.warning("kv_transfer_failed", **fields, error=done.error, rtt_ms=rtt_ms,
                        effect="the chunk re-prefills on the destination host")
        return dispatches

    def expire(self, now: float) -> Outbox:
        """Give up on pulls unanswered for longer than ``transfer_timeout_s``. The agent that
        did not answer is taken as lost (no more transfers to or from its host), so a dead
        agent costs one timeout, not one per moved chunk."""
        out: Outbox = []
        for transfer_id, sent in list(self.sent.items()):
            if sent.timed_out or now - sent.sent_s <= self.config.transfer_timeout_s:
                continue
            # Kept in ``sent``: a late answer still frees the destination blocks it holds.
            sent.timed_out = True
            log.warning("kv_transfer_timed_out", **self._fields(sent.transfer),
                        timeout_s=self.config.transfer_timeout_s,
                        effect="the chunk re-prefills; the destination blocks stay held until the agent answers")
            out += self.scheduler.transfer_abandoned(transfer_id)
            host = sent.transfer.dst.host_id
            if self.by_host.get(host) is sent.agent:  # not an agent that replaced it, or came back since
                why = f"pull {transfer_id} unanswered for {self.config.transfer_timeout_s:g} s"
                out += self.lost(host, why)
        return out

    def _give_up_pulls(self, agent: AgentRecord, reason: str) -> Outbox:
        """Stop waiting for the pulls sent to an agent that is gone or replaced while its
        host's pool stays: their chunks go with re-prefill now, not after
        ``transfer_timeout_s``. They stay in ``sent`` and their destination blocks stay held
        (the table's invariant), so a late answer still frees them."""
        out: Outbox = []
        for transfer_id, sent in self.sent.items():
            live = self.scheduler.kv.transfers.get(transfer_id) is sent.transfer  # not ended with its pool
            if sent.agent is not agent or sent.timed_out or not live:
                continue
            sent.timed_out = True
            log.warning("kv_transfer_given_up", **self._fields(sent.transfer), reason=reason,
                        effect="the chunk re-prefills on the destination host")
            out += self.scheduler.transfer_abandoned(transfer_id)
        return out

    def _failed(self, transfer: Transfer, error: str, rtt_ms: float | None) -> Outbox:
        log.warning("kv_transfer_failed", **self._fields(transfer), error=error, rtt_ms=rtt_ms,
                    effect="the chunk re-prefills on the destination host")
        return self.scheduler.transfer_finished(transfer.transfer_id, ok=False)[1]

    def _fields(self, transfer: Transfer) -> dict[str, object]:
        request = transfer.request
        return {"transfer_id": transfer.transfer_id, "request_id": request.request_id,
                "rollout_id": request.group.rollout.rollout_id,
                "from_host": transfer.src.host_id or self.local_host_id,
                "to_host": transfer.dst.host_id or self.local_host_id,
                "num_blocks": len(transfer.dst_blocks), "num_tokens": transfer.num_tokens,
                "transport": transfer.src.transport, "ahead": transfer.ahead}
