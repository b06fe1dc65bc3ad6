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

    def status(self) -> EngineStatus:
        return EngineStatus(engine_id=self.engine_id, pid=self.pid, state=self.state, load=self.load,
                            capabilities=self.capabilities, weights_version=self.weights_version)


class Registry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engines: dict[int, EngineRecord] = {}

    def expect(self, engine_id: int, pid: int, now_s: float) -> None:
        self.engines[engine_id] = EngineRecord(engine_id=engine_id, pid=pid, last_heard_s=now_s)

    def ready(self, engine_id: int, pid: int, capabilities: EngineCapabilities, weights_version: int, now_s: float) -> None:
        record = self.engines.setdefault(engine_id, EngineRecord(engine_id=engine_id))
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
