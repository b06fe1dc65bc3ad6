"""The instance registry: every engine the control plane knows, and its liveness.

An engine is ``starting`` from spawn (or from the first word of a joining engine)
until its hello is accepted, ``ready`` while it heartbeats, ``lost`` once it has been
silent for ``heartbeat_timeout_s`` or its process exited, ``stopped`` after a clean
shutdown. An engine that says hello with older weights than the service's (it joined
after an ``update_weights``) is ``updating`` between its hello and loading the last
update's checkpoint: connected and pinged, but given no work, so it never serves a
stale policy. Pure bookkeeping with an injected clock; the server acts on the changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seer.protocol import EngineCapabilities, EngineHello, EngineLoad, EngineStatus


@dataclass
class EngineRecord:
    engine_id: int
    pid: int = 0
    state: str = "starting"
    capabilities: EngineCapabilities | None = None
    load: EngineLoad = field(default_factory=EngineLoad)
    last_heard_s: float = 0.0
    weights_version: int = 0
    identity: bytes = b""  # the engine's ZeroMQ identity: where messages to it go
    joined: bool = False  # joined from outside (`seerctl engine --join`), not spawned here
    hello: EngineHello | None = None  # kept while ``updating``: it is admitted with it once current

    def status(self) -> EngineStatus:
        return EngineStatus(engine_id=self.engine_id, pid=self.pid, state=self.state, load=self.load,
                            capabilities=self.capabilities, weights_version=self.weights_version)


class Registry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engines: dict[int, EngineRecord] = {}
        self._ids: dict[bytes, int] = {}  # identity -> engine id
        # Checkpoint of the last successful weights update: what a newcomer must load.
        self.weights_path: str | None = None
        # (host, pid) -> (checkpoint, error) of a replay that failed: that engine process is
        # refused at its next hello instead of registered under a fresh id again and again
        # (a joined engine says hello with a fresh identity each time, so not by identity).
        self._replay_failures: dict[tuple[str, int], tuple[str, str]] = {}

    def expect(self, engine_id: int, pid: int, now_s: float) -> None:
        self.engines[engine_id] = EngineRecord(engine_id=engine_id, pid=pid, last_heard_s=now_s,
                                               identity=f"engine-{engine_id}".encode())
        self._ids[self.engines[engine_id].identity] = engine_id

    def next_engine_id(self, num_spawned: int) -> int:
        """A fresh id for a joining engine: above every id ever seen (never reused, so a
        stale message can never be taken for a newer engine's) and the spawned range."""
        return max([num_spawned - 1, *self.engines]) + 1

    def by_identity(self, identity: bytes) -> EngineRecord | None:
        engine_id = self._ids.get(identity)
        return None if engine_id is None else self.engines[engine_id]

    def ready(self, engine_id: int, pid: int, capabilities: EngineCapabilities, weights_version: int, now_s: float,
              identity: bytes | None = None, joined: bool = False) -> None:
        record = self.engines.setdefault(engine_id, EngineRecord(engine_id=engine_id))
        record.identity = identity or f"engine-{engine_id}".encode()
        self._ids[record.identity] = engine_id
        record.joined = joined
        record.pid = pid
        record.state = "ready"
        record.capabilities = capabilities
        record.weights_version = weights_version
        record.last_heard_s = now_s
        record.hello = None

    def weights_to_replay(self, hello: EngineHello, service_version: int) -> str | None:
        """The checkpoint an engine at ``engine_version`` must load before it may take
        work, or None when it is current or cannot be brought up to date (no update
        was recorded, it claims a version the service never had, or loading this very
        checkpoint already failed on it)."""
        if hello.weights_version >= service_version or self.weights_path is None:
            return None
        failed = self._replay_failures.get((hello.host_id, hello.pid))
        return None if failed is not None and failed[0] == self.weights_path else self.weights_path

    def replay_failed(self, engine_id: int, error: str) -> None:
        record = self.engines[engine_id]
        record.state = "lost"
        assert record.hello is not None
        self._replay_failures[(record.hello.host_id, record.hello.pid)] = (self.weights_path or "", error)

    def replay_error(self, hello: EngineHello) -> str | None:
        failed = self._replay_failures.get((hello.host_id, hello.pid))
        return None if failed is None else f"loading the last update's checkpoint {failed[0]} failed: {failed[1]}"

    def updating(self, hello: EngineHello, now_s: float, identity: bytes | None = None, joined: bool = False) -> None:
        """Register an engine that is loading the current weights: not ``ready`` yet."""
        self.ready(hello.engine_id, hello.pid, hello.capabilities, hello.weights_version, now_s, identity=identity,
                   joined=joined)
        record = self.engines[hello.engine_id]
        record.state = "updating"
        record.hello = hello

    def is_updating(self, engine_id: int) -> bool:
        record = self.engines.get(engine_id)
        return record is not None and record.state == "updating"

    def heard(self, engine_id: int, now_s: float, load: EngineLoad | None = None) -> None:
        record = self.engines.get(engine_id)
        if record is not None:
            record.last_heard_s = now_s
            if load is not None:
                record.load = load

    def mark(self, engine_id: int, state: str) -> None:
        if engine_id in self.engines:
            self.engines[engine_id].state = state

    def silent(self, now_s: float) -> list[int]:
        """Connected engines that have been silent longer than the heartbeat timeout."""
        return [e.engine_id for e in self.engines.values()
                if e.state in ("ready", "updating") and now_s - e.last_heard_s > self.heartbeat_timeout_s]

    def ready_ids(self) -> list[int]:
        return sorted(e.engine_id for e in self.engines.values() if e.state == "ready")

    def updating_ids(self) -> list[int]:
        return sorted(e.engine_id for e in self.engines.values() if e.state == "updating")

    def connected_ids(self) -> list[int]:
        """Engines that hold a session with this control plane: ready or catching up."""
        return sorted(e.engine_id for e in self.engines.values() if e.state in ("ready", "updating"))

    def num_starting(self) -> int:
        return sum(1 for e in self.engines.values() if e.state == "starting")
