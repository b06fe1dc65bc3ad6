"""The instance registry: every engine the control plane knows, and its liveness.

An engine is ``starting`` from spawn (or from the first word of a joining engine)
until its hello is accepted, ``ready`` while it heartbeats, ``lost`` once it has been
silent for ``heartbeat_timeout_s`` or its process exited, ``stopped`` after a clean
shutdown. Pure bookkeeping with an injected clock; the server acts on the changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seer.protocol import EngineCapabilities, EngineLoad, EngineStatus


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

    def status(self) -> EngineStatus:
        return EngineStatus(engine_id=self.engine_id, pid=self.pid, state=self.state, load=self.load,
                            capabilities=self.capabilities, weights_version=self.weights_version)


class Registry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engines: dict[int, EngineRecord] = {}
        self._ids: dict[bytes, int] = {}  # identity -> engine id

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
        """Ready engines that have been silent longer than the heartbeat timeout."""
        return [e.engine_id for e in self.engines.values()
                if e.state == "ready" and now_s - e.last_heard_s > self.heartbeat_timeout_s]

    def ready_ids(self) -> list[int]:
        return sorted(e.engine_id for e in self.engines.values() if e.state == "ready")

    def num_starting(self) -> int:
        return sum(1 for e in self.engines.values() if e.state == "starting")
