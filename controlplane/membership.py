"""Which engines may join the service, and what becomes of rollouts when none is left.

Owns the engine side of a session up to "ready for work": the answer to each
``EngineHello`` (``HelloAccepted``; or, for an engine with older weights that joined
after an update, ``HelloAccepted`` + ``LoadWeights`` of the last update's checkpoint,
then ready once it has caught up; or ``HelloRejected``), and the events
``engine_ready``, ``engine_rejected``, ``engine_weights_replayed``. An admitted local
engine is offered to this host's KV pool (``kvpool/segment.py``: ``PoolSegmentOwner.bind``,
which creates it for the first engine that can use it). ``Membership`` sends nothing: each answer is an ``Outbox``
(``outbox.py``) the server delivers, in order; the server schedules after an admission.

Which engine a hello may register as is ``claim_hello``'s pure decision: an engine's id
belongs to the process that registered it, bound to its connection (its ZeroMQ identity,
which the engine socket gives to one connection at a time) and to its secret
(``EngineHello.secret``: the supervisor's per-spawn secret, or the one a joining engine
chose; ``Registry.proves``). A hello from another connection for an id whose engine
registered with a secret is refused without that secret (``engine_claim_refused``: the
claimed id, the newcomer's identity, whether the secret was missing or wrong -- never the
secret), and the engine holding the id keeps its connection and its work; with it, the
engine's process takes its id back (an engine declared lost that wakes, a joined engine that
registers again with the control plane that gave it the id), its previous session's work
requeued first if the control plane still counted it live (``engine_session_replaced``;
``core.py`` drops those chunks' deadlines).

Three decisions are pure functions of their arguments: which id a hello claims and whether
it may (``claim_hello``); why an ``EngineHello`` is refused (protocol
version, weights the service cannot bring up to date; capabilities that cannot serve the
configured model, ``refuse_capabilities``: a smaller vocabulary than the tokenizer's, a
shorter ``max_model_len`` than ``model.max_model_len``, no KV cache) -- the refusal text is the
``HelloRejected`` reason and the ``engine_rejected`` event's; and the wait of rollouts
stranded by losing every engine: with ``engines.replacement_wait_s > 0`` they wait that
long for an engine to join (``seerctl engine --join``, a restarted one) before they
fail with ``no_engines``; without it they fail at once (``StrandedWait``; the clock is
passed in; ``health.py`` applies it when it loses an engine).

It also checks every other engine message's sender (``refuse_sender``): a peer not
registered under that identity and id (one that outlived a previous control plane on this
address, or a lost engine the registry no longer remembers: ``Registry.forget_lost``), or
an engine declared lost while its process lived on, is refused with a ``HelloRejected`` that
asks it to say hello again (events ``unregistered_engine_message``, ``lost_engine_heard``);
its message is not handled.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from seer.config import SeerConfig
from seer.controlplane.kvpool.agents import Agents, refuse_geometry
from seer.controlplane.kvpool.table import LOCAL_HOST
from seer.controlplane.kvpool.segment import PoolSegmentOwner
from seer.controlplane.outbox import Outbox, ToEngine, ToPeer
from seer.controlplane.registry import Registry
from seer.controlplane.state import EngineState
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.weights import Weights
from seer.protocol import (
    JOIN_ENGINE_ID,
    PROTOCOL_VERSION,
    EngineCapabilities,
    EngineHello,
    HelloAccepted,
    HelloRejected,
    LoadWeights,
    WeightsLoaded,
)

log = structlog.get_logger()


# The engine states that hold a session (a connection the control plane sends to).
CONNECTED = (EngineState.READY, EngineState.UPDATING)


@dataclass(frozen=True)
class Claim:
    """Which engine id a hello registers as, and whether it may."""

    engine_id: int  # JOIN_ENGINE_ID: a joining engine that gets a fresh id
    joined: bool
    refusal: str = ""  # why the hello may not take this id ('' if it may)
    # The id's engine is live on another connection: the newcomer (its own process, proven by
    # its secret) replaces that session, whose work is requeued first.
    replaces_session: bool = False


def spawned_identity(engine_id: int, identity: bytes) -> bool:
    """A connection named as engine ``engine_id``'s: ``engine-N`` (engines that predate
    per-connection names) or ``engine-N.<suffix>`` (one name per connection)."""
    return re.fullmatch(rb"engine-%d(\.[^.]+)?" % engine_id, identity) is not None


def wrong_name(engine_id: int, identity: bytes) -> str:
    return f"engine {engine_id} connected with identity {identity!r}, expected engine-{engine_id}[.<connection>]"


def claim_hello(registry: Registry, identity: bytes, hello: EngineHello, control_plane: str) -> Claim:
    """Which id this hello claims and whether it may have it. A fixed id is claimed as is;
    a joining engine (JOIN_ENGINE_ID) claims the id it had only with the control plane that
    gave it (``control_plane``: this one's instance) while that record exists, else a fresh
    id; never an id a forgotten engine had (``Registry.forgot``). An id whose engine holds a
    session on another connection, or registered with a secret, needs that engine's secret;
    the connection an engine registered on is its own."""
    joined = hello.engine_id == JOIN_ENGINE_ID
    engine_id = hello.engine_id
    if joined:
        previous = registry.engines.get(hello.previous_engine_id)
        if (previous is None or not previous.joined or previous.state is EngineState.STOPPED
                or not hello.previous_control_plane or hello.previous_control_plane != control_plane):
            return Claim(JOIN_ENGINE_ID, joined=True)  # a fresh id: nothing to claim
        engine_id = previous.engine_id
    record = registry.engines.get(engine_id)
    if record is None:  # an id nobody holds (a spawned engine's is expected: ``Registry.expect``)
        if registry.forgot(engine_id):
            return Claim(engine_id, joined, refusal=(
                f"engine id {engine_id} belonged to an engine lost long ago (no longer remembered) and is never "
                "given to another; join with `seerctl engine --join` to get a free id"))
        if spawned_identity(engine_id, identity):
            return Claim(engine_id, joined)
        return Claim(engine_id, joined, refusal=wrong_name(engine_id, identity))
    if record.state in CONNECTED and record.identity == identity:
        # Its own connection (one routing id is one connection: a second connection under
        # the same identity is dropped by ZeroMQ and never reaches here).
        if record.state is EngineState.READY and record.pid != hello.pid:
            return Claim(engine_id, joined, refusal=(
                f"engine id {engine_id} is taken by the ready engine of pid {record.pid}; "
                "join with `seerctl engine --join` to get a free id"))
        return Claim(engine_id, joined)
    proof = registry.proves(engine_id, hello.secret)
    live = record.state in CONNECTED
    if proof:
        return Claim(engine_id, joined, replaces_session=live)
    if proof is None and not live:
        # Registered without a secret (an engine that predates them) and not live: nobody to
        # protect, nothing to prove; the name of the connection must still be its own.
        if joined or spawned_identity(engine_id, identity):
            return Claim(engine_id, joined)
        return Claim(engine_id, joined, refusal=wrong_name(engine_id, identity))
    holder = f"the {record.state.value} engine {engine_id} (pid {record.pid})"
    if proof is None:
        why = "it registered without a secret, so no other connection can take its id"
    else:
        why = f"this hello carries {'the wrong' if hello.secret else 'no'} secret for it"
    return Claim(engine_id, joined, refusal=(
        f"engine id {engine_id} belongs to {holder}, registered on another connection; {why}: refused. Only the "
        "process that registered an id takes it back; join with `seerctl engine --join` to get a free id"))


def refuse_hello(registry: Registry, hello: EngineHello, *, service_version: int, replay: str | None) -> str:
    """Why this hello is refused ('' if it is not), its claim apart (``claim_hello``).
    ``replay``: the checkpoint that would bring the engine to the service's weights
    (``Registry.weights_to_replay``)."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return (f"engine speaks protocol {hello.protocol_version}, control plane speaks {PROTOCOL_VERSION}; "
                "run the same Seer version everywhere")
    if hello.weights_version != service_version and replay is None:
        return (f"engine has weights version {hello.weights_version}, the service is at {service_version}; "
                + (registry.replay_error(hello) or "restart the daemon or update weights before adding engines"))
    return ""


@dataclass(frozen=True)
class ModelExpectations:
    """What an engine must offer to serve this daemon's model: at least the tokenizer's
    vocabulary (every id the control plane produces must be embeddable) and at least the
    configured ``model.max_model_len`` (rollouts are checked against it)."""

    vocab_size: int
    max_model_len: int


def refuse_capabilities(caps: EngineCapabilities, expected: ModelExpectations) -> str:
    """Why an engine's capabilities cannot serve this daemon ('' if they can)."""
    if caps.vocab_size < expected.vocab_size:
        return (f"engine reports vocab_size {caps.vocab_size}, but this daemon's tokenizer has {expected.vocab_size} "
                "token ids; the engine runs another model: start it with the daemon's [model] path")
    if caps.max_model_len < expected.max_model_len:
        return (f"engine reports max_model_len {caps.max_model_len}, this daemon serves model.max_model_len "
                f"{expected.max_model_len}; start the engine with the daemon's config (the same [model] section)")
    if caps.kv_geometry is not None and (bad := refuse_geometry(caps.kv_geometry)):
        return f"engine reports a KV block geometry that is not one: {bad}; run the same Seer version everywhere"
    if caps.kv_capacity_tokens < 1 or caps.block_size < 1:
        return (f"engine reports kv_capacity_tokens {caps.kv_capacity_tokens} and block_size {caps.block_size}; "
                "it has no KV cache to run anything: give it KV memory (engines.kv_cache_gib)")
    return ""


def lost_message(engine_id: int, reason: str) -> str:
    """The error of rollouts failed at once because losing ``engine_id`` left no engine."""
    return (f"every engine is lost (last: engine {engine_id}, {reason}); the rollout cannot "
            "finish. Check the engine logs in the run dir and restart the daemon")


@dataclass
class Answer:
    """What an engine's hello (or its catching up) is answered with."""

    sends: Outbox = field(default_factory=list)
    admitted: bool = False  # ready for work: the caller schedules
    # The engine whose previous session (live, on another connection) this hello replaced:
    # its chunks were requeued; the caller drops their clocks (``core.py``).
    replaced: int | None = None


class StrandedWait:
    """The wait for a joining engine after every engine was lost (at most one at a time:
    a later loss restarts it)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # engines.replacement_wait_s
        self.deadline_s: float | None = None
        self.cause = ""

    def begin(self, now_s: float, engine_id: int, reason: str) -> bool:
        """Losing ``engine_id`` stranded rollouts: wait for a joiner (True), or fail them
        now with ``lost_message`` (False: no wait configured)."""
        if self.wait_s <= 0:
            return False
        self.deadline_s = now_s + self.wait_s
        self.cause = f"last: engine {engine_id}, {reason}"
        return True

    def expired(self, now_s: float, any_live: bool) -> bool:
        """True once (then the wait is over) when no engine joined in time: fail every
        rollout not done with ``expired_message``. A live engine ends the wait."""
        if self.deadline_s is None:
            return False
        if any_live:
            self.deadline_s = None
            return False
        if now_s < self.deadline_s:
            return False
        self.deadline_s = None
        return True

    def expired_message(self) -> str:
        return (f"every engine is lost ({self.cause}) and none joined within "
                f"engines.replacement_wait_s = {self.wait_s:g} s; "
                "check the engine logs in the run dir, join engines or restart the daemon")


class Membership:
    """Answers engine hellos and admits engines; sends through the server's callables."""

    def __init__(self, config: SeerConfig, registry: Registry, scheduler: Scheduler, agents: Agents,
                 host_pool: PoolSegmentOwner, *, engine_address: str, run_dir: Path,
                 clock: Callable[[], float], expected: ModelExpectations | None = None) -> None:
        self.config = config
        self.expected = expected  # None: capabilities are not checked (tests that drive parts alone)
        self.registry = registry
        self.scheduler = scheduler
        self.agents = agents
        self.host_pool = host_pool
        self.engine_address = engine_address
        self.run_dir = run_dir
        self.clock = clock
        # This control plane's instance: a joined engine names it with its id when it
        # registers again (``HelloAccepted.control_plane``); not a secret.
        self.control_plane = secrets.token_hex(8)

    def superseded(self, identity: bytes, hello: EngineHello) -> int | None:
        """The engine this identity is registered as, if this hello comes from another process
        joining under it (a new id would be registered under the same identity): that engine
        is gone (one identity is one connection) and must be lost before the hello is
        answered, or its chunks could never be answered (its messages would carry an id the
        identity no longer maps to) and would wait for their deadlines."""
        known = self.registry.by_identity(identity)
        if known is None or known.state not in (EngineState.READY, EngineState.UPDATING):
            return None
        if hello.engine_id != JOIN_ENGINE_ID or (known.state is EngineState.READY and known.pid == hello.pid):
            return None  # the same id again (refused or re-admitted by on_hello), or a repeated hello
        return known.engine_id

    def refuse_sender(self, identity: bytes, msg: object) -> HelloRejected | None:
        """The refusal the sender of an engine message (other than a hello) gets instead of
        an answer, or None when it is the registered, not lost engine it claims to be."""
        record = self.registry.by_identity(identity)
        if record is None or record.engine_id != getattr(msg, "engine_id", None):
            # Not an engine registered here under that id -- typically one that outlived a
            # previous control plane on this address: ask it to register.
            log.warning("unregistered_engine_message", identity=identity.decode(errors="replace"),
                        message=type(msg).__name__)
            return HelloRejected(reason=(f"this control plane has no engine registered as {identity!r}; "
                                         "it may have restarted: say hello again"), say_hello_again=True)
        if record.state is EngineState.LOST:
            # Declared lost (silent past heartbeat_timeout_s, stalled) while its process
            # lived on: its work went elsewhere, and what it sends now is stale. Asking it to
            # say hello again brings it back as a fresh, empty engine.
            log.warning("lost_engine_heard", engine_id=record.engine_id, pid=record.pid,
                        message=type(msg).__name__, action="asked to say hello again")
            return HelloRejected(reason=(
                f"engine {record.engine_id} was declared lost "
                f"({self.registry.loss_reasons.get(record.engine_id, 'see controlplane.log')}) and its work "
                "given to other engines: say hello again"), say_hello_again=True)
        return None

    def _repeated(self, identity: bytes, hello: EngineHello) -> int | None:
        """The engine this connection registered as, if this is its hello again (engines
        repeat it until answered): same connection, same process."""
        known = self.registry.by_identity(identity)
        if known is not None and known.state is EngineState.READY and known.pid == hello.pid:
            return known.engine_id
        return None

    def _decide(self, identity: bytes, hello: EngineHello,
                weights: Weights) -> tuple[Claim, EngineHello, str | None, str]:
        """(its claim, the hello with the id it registers as and no secret, the checkpoint to
        replay, why it is refused ('' if not)). Pure: nothing changes."""
        claim = Claim(hello.engine_id, joined=hello.engine_id == JOIN_ENGINE_ID)
        if hello.protocol_version == PROTOCOL_VERSION:
            claim = claim_hello(self.registry, identity, hello, self.control_plane)
        engine_id = claim.engine_id
        if engine_id == JOIN_ENGINE_ID:
            engine_id = self.registry.next_engine_id(self.config.engines.count)
        # The secret stays with the registry (``bind_secret``): the hello kept in a record
        # (``updating``) or passed on must not carry it.
        hello = msgspec.structs.replace(hello, engine_id=engine_id, secret="")
        version = weights.service_version
        replay = self.registry.weights_to_replay(hello, version)
        reason = claim.refusal or refuse_hello(self.registry, hello, service_version=version, replay=replay)
        if not reason and self.expected is not None:
            reason = refuse_capabilities(hello.capabilities, self.expected)
        return claim, hello, replay, reason

    def on_hello(self, identity: bytes, hello: EngineHello, weights: Weights) -> Answer:
        """Answer a hello; ``admitted`` when the engine is ready for work (schedule)."""
        if (engine_id := self._repeated(identity, hello)) is not None:
            return Answer([ToEngine(engine_id, self._accepted(engine_id, hello.secret))])
        if weights.update is not None:
            return Answer()  # no answer mid-update: the engine repeats its hello and joins at the new version
        secret = hello.secret
        claim, hello, replay, reason = self._decide(identity, hello, weights)
        joined = claim.joined
        if claim.refusal:
            record = self.registry.engines.get(claim.engine_id)
            log.error("engine_claim_refused", engine_id=claim.engine_id, identity=identity.decode(errors="replace"),
                      pid=hello.pid, joined=joined, secret_given=bool(secret),
                      holder_pid=record.pid if record is not None else None,
                      holder_state=record.state.value if record is not None else None, reason=reason)
            return Answer([ToPeer(identity, HelloRejected(reason=reason))])
        if reason:
            log.error("engine_rejected", engine_id=hello.engine_id, reason=reason)
            return Answer([ToPeer(identity, HelloRejected(reason=reason))])
        replaced = None
        if claim.replaces_session:
            # Its own process (it has the secret) on a new connection while this control plane
            # still counted it live (a joined engine that heard nothing for heartbeat_timeout_s,
            # or was told to stop, registers again): it dropped that session's work.
            replaced = hello.engine_id
            report = self.scheduler.engine_lost(replaced)
            log.warning("engine_session_replaced", engine_id=replaced, pid=hello.pid, joined=joined,
                        identity=identity.decode(errors="replace"), num_requeued=len(report.requeued))
        self.registry.bind_secret(hello.engine_id, secret)
        version = weights.service_version
        if hello.weights_version != version:
            # Joined after an update: bring it to the current weights before any work.
            self.registry.updating(hello, self.clock(), identity=identity, joined=joined)
            assert replay is not None
            log.info("engine_weights_replayed", engine_id=hello.engine_id, pid=hello.pid, joined=joined,
                     from_weights_version=hello.weights_version, weights_version=version, path=replay)
            return Answer([ToEngine(hello.engine_id, self._accepted(hello.engine_id, secret)),
                           ToEngine(hello.engine_id, LoadWeights(path=replay, weights_version=version))],
                          replaced=replaced)
        return Answer(self._admit(identity, hello, joined, secret), admitted=True, replaced=replaced)

    def _accepted(self, engine_id: int, secret: str) -> HelloAccepted:
        """The acceptance; to a joined engine that can prove itself (it sent a secret) it names
        this control plane, with which it may take its id back later."""
        record = self.registry.engines.get(engine_id)
        if secret and record is not None and record.joined:
            return HelloAccepted(engine_id=engine_id, control_plane=self.control_plane)
        return HelloAccepted(engine_id=engine_id)

    def on_caught_up(self, msg: WeightsLoaded, service_version: int) -> Answer:
        """A newcomer finished loading the replayed weights: ready for work (admitted), or out."""
        record = self.registry.engines[msg.engine_id]
        if msg.error or msg.weights_version != service_version:
            reason = msg.error or f"loaded weights version {msg.weights_version}, the service is at {service_version}"
            log.error("engine_rejected", engine_id=msg.engine_id, reason=f"weights replay failed: {reason}",
                      fix="check the last update_weights checkpoint still exists on this host")
            self.registry.replay_failed(msg.engine_id, reason)
            # It says hello again (a joined engine) and is refused then, naming the failure.
            return Answer([ToEngine(msg.engine_id, HelloRejected(reason=f"weights replay failed: {reason}"))])
        assert record.hello is not None
        current = msgspec.structs.replace(record.hello, weights_version=msg.weights_version)
        return Answer(self._admit(record.identity, current, record.joined, ""), admitted=True)

    def _admit(self, identity: bytes, hello: EngineHello, joined: bool, secret: str) -> Outbox:
        """Register an engine with current weights as ready (the caller gives it work)."""
        host = self.agents.core_host(hello.host_id)
        if host == LOCAL_HOST:  # another host's pool comes from its agent's hello
            self.host_pool.bind(self.scheduler, hello.engine_id, hello.capabilities.kv_geometry,
                                engine_address=self.engine_address, run_dir=self.run_dir)
        # Ready in the one engine table (the registry the scheduler holds).
        self.scheduler.engine_joined(hello.engine_id, hello.capabilities, host_id=host, pid=hello.pid,
                                     loaded_weights_version=hello.weights_version, now_s=self.clock(), identity=identity,
                                     joined=joined)
        log.info("engine_ready", engine_id=hello.engine_id, pid=hello.pid, joined=joined, backend=hello.capabilities.backend,
                 host_id=hello.host_id or self.agents.local_host_id,
                 kv_capacity_tokens=hello.capabilities.kv_capacity_tokens,
                 max_model_len=hello.capabilities.max_model_len, weights_version=hello.weights_version)
        # (Caught up after a replay, ``secret`` "": its first HelloAccepted named the control plane.)
        return [ToEngine(hello.engine_id, self._accepted(hello.engine_id, secret))]
