"""The instance registry: the one table of engines, and the one place their state changes.

Owns one ``EngineView`` per engine the control plane knows (``state.py``: the record and
its ``EngineState`` transitions), which ZeroMQ identity is which engine (one identity per
engine: the connection of its current session; a record moved to a new connection drops
the old one), each engine's secret (``expect``, ``bind_secret``, ``proves``: what a second
connection claiming the engine's id must show; never logged), liveness (``silent``), and
the weights bookkeeping of engines that join after an update: the last update's
checkpoint a newcomer must load (``weights_path``) and the replays that failed.
Of lost engines it keeps the newest ``LOST_ENGINES_KEPT``; older ones are forgotten
(``forget_lost``: record, secret, loss reason, identity), their ids never handed out again.
Every state change goes through ``_move``, which refuses a transition the lifecycle does
not have. The scheduler holds this registry and reads it (``live`` engines, their
capabilities and loads); the server and ``membership.py`` drive it. Pure bookkeeping
with the time passed in. Silence is counted only while the control plane listens: a stall
of its own loop (``loop_stalled``) is not held against any engine.
"""

from __future__ import annotations

import hmac
import math

from seer.controlplane.state import ENGINE_TRANSITIONS, EngineState, EngineView
from seer.protocol import EngineCapabilities, EngineHello, EngineLoad

# Lost engines remembered, the newest: enough to name recent losses in status and to refuse a
# lost engine's stale messages with the loss reason (every engine that joins has a new id).
LOST_ENGINES_KEPT = 32


class EngineStateError(RuntimeError):
    """A state change the engine lifecycle does not have (a bug in the caller)."""


class Registry:
    def __init__(self, heartbeat_timeout_s: float = math.inf) -> None:
        # math.inf: no liveness (simulations and tests drive engines directly).
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engines: dict[int, EngineView] = {}
        self._ids: dict[bytes, int] = {}  # identity -> engine id (the connection of its current session)
        # engine id -> the secret its process proves itself with (the supervisor's per-spawn
        # secret, or the one the engine sent at its first hello). Kept across losses: it is
        # how the same process takes its id back. Never logged.
        self._secrets: dict[int, bytes] = {}
        # Checkpoint of the last successful weights update: what a newcomer must load.
        self.weights_path: str | None = None
        # (host, pid) -> (checkpoint, error) of a replay that failed: that engine process is
        # refused at its next hello instead of registered under a fresh id again and again
        # (a joined engine says hello with a fresh identity each time, so not by identity).
        self._replay_failures: dict[tuple[str, int], tuple[str, str]] = {}
        # Why each lost engine was lost (``note_loss``), for ``not_ready``.
        self.loss_reasons: dict[int, str] = {}
        # The engines now lost, in the order they were lost (``forget_lost`` drops the oldest).
        self._lost: dict[int, None] = {}
        # The highest id any record had, and the highest forgotten (``next_engine_id``, ``forgot``).
        self._max_id = -1
        self._forgotten_max = -1
        # ``schedulable()``, kept until a record changes (every change goes through this
        # class: ``_move``, ``expect``, ``admit``, ``mark_unhealthy``, ``finished_chunk``).
        self._schedulable: list[EngineView] | None = None

    # ------------------------------------------------------------------ transitions
    def _move(self, view: EngineView | None, to: EngineState) -> None:
        """The one place an engine's state changes (``view`` None: a new record, moved by the caller)."""
        self._schedulable = None
        current = view.state if view is not None else None
        if to not in ENGINE_TRANSITIONS[current]:
            name = current.value if current is not None else "new"
            engine = f"engine {view.engine_id}" if view is not None else "a new engine"
            raise EngineStateError(f"{engine} cannot go from {name} to {to.value} (see EngineState for the lifecycle)")
        if view is not None:
            if to is EngineState.LOST:
                self._lost[view.engine_id] = None
            elif current is EngineState.LOST:
                del self._lost[view.engine_id]
                self.loss_reasons.pop(view.engine_id, None)
            view.state = to

    def _record(self, engine_id: int, to: EngineState, identity: bytes | None) -> EngineView:
        """The engine's record moved to ``to`` (created if new), registered under ``identity``."""
        view = self.engines.get(engine_id)
        self._move(view, to)
        if view is None:
            view = self.engines[engine_id] = EngineView(engine_id=engine_id, state=to)
            self._max_id = max(self._max_id, engine_id)
        self._bind_identity(view, identity or f"engine-{engine_id}".encode())
        return view

    def _bind_identity(self, view: EngineView, identity: bytes) -> None:
        """``identity`` is now where the engine is reached; its previous connection is no
        longer the engine's (its messages are refused as unregistered)."""
        old = view.identity
        if old and old != identity and self._ids.get(old) == view.engine_id:
            del self._ids[old]
        view.identity = identity
        if identity:
            self._ids[identity] = view.engine_id

    def expect(self, engine_id: int, pid: int, now_s: float, secret: str = "") -> None:
        """An engine was spawned here with ``secret`` (its hello must carry it): ``starting``
        until its hello (a fresh record, reachable under no identity until then)."""
        old = self.engines.pop(engine_id, None)
        if old is not None and self._ids.get(old.identity) == engine_id:
            del self._ids[old.identity]
        self._secrets.pop(engine_id, None)
        self._lost.pop(engine_id, None)
        self.loss_reasons.pop(engine_id, None)
        self._schedulable = None
        self._move(None, EngineState.STARTING)
        view = self.engines[engine_id] = EngineView(engine_id=engine_id, state=EngineState.STARTING)
        self._max_id = max(self._max_id, engine_id)
        view.pid, view.last_heard_s = pid, now_s
        if secret:
            self._secrets[engine_id] = secret.encode()

    def bind_secret(self, engine_id: int, secret: str) -> None:
        """The secret ``engine_id``'s process proves itself with from now on, if it has none
        yet (the first registration decides; a later hello never replaces it)."""
        if secret and engine_id not in self._secrets:
            self._secrets[engine_id] = secret.encode()

    def proves(self, engine_id: int, secret: str) -> bool | None:
        """Whether ``secret`` is ``engine_id``'s (compared in constant time); None when the
        engine registered without one (there is nothing to prove)."""
        expected = self._secrets.get(engine_id)
        if expected is None:
            return None
        return hmac.compare_digest(secret.encode(errors="surrogatepass"), expected)

    def admit(self, engine_id: int, capabilities: EngineCapabilities, *, pid: int = 0, loaded_weights_version: int = 0,
              now_s: float = 0.0, identity: bytes | None = None, joined: bool = False) -> EngineView:
        """``ready`` for work, with the weights it has loaded; its load starts afresh."""
        view = self._record(engine_id, EngineState.READY, identity)
        view.joined, view.pid, view.capabilities = joined, pid, capabilities
        view.loaded_weights_version, view.last_heard_s = loaded_weights_version, now_s
        view.load, view.hello, view.unhealthy = EngineLoad(), None, False
        return view

    def updating(self, hello: EngineHello, now_s: float, identity: bytes | None = None, joined: bool = False) -> None:
        """Register an engine that is loading the current weights: not ``ready`` yet."""
        view = self._record(hello.engine_id, EngineState.UPDATING, identity)
        view.joined, view.pid, view.capabilities = joined, hello.pid, hello.capabilities
        view.loaded_weights_version, view.last_heard_s, view.hello = hello.weights_version, now_s, hello

    def lose(self, engine_id: int) -> EngineState | None:
        """``lost``; the state it was in, or None if it was not live (unknown, lost, stopped)."""
        view = self.engines.get(engine_id)
        if view is None or view.state in (EngineState.LOST, EngineState.STOPPED):
            return None
        previous = view.state
        self._move(view, EngineState.LOST)
        return previous

    def note_loss(self, engine_id: int, reason: str) -> None:
        """Why ``engine_id`` was lost (the server's words: process exit, silence, ...)."""
        if engine_id in self._lost:
            self.loss_reasons[engine_id] = reason

    def forget_lost(self) -> list[int]:
        """Forget the lost engines beyond the newest ``LOST_ENGINES_KEPT``, the oldest loss
        first: their records, secrets, loss reasons and identities. Their ids stay taken
        (``next_engine_id``, ``forgot``); a message from one is an unregistered sender's. The
        ids forgotten, for the tables kept elsewhere by engine id (``Scheduler.forget_engine``)."""
        forgotten = []
        while len(self._lost) > LOST_ENGINES_KEPT:
            engine_id = next(iter(self._lost))
            del self._lost[engine_id]
            view = self.engines.pop(engine_id)
            if self._ids.get(view.identity) == engine_id:
                del self._ids[view.identity]
            self._secrets.pop(engine_id, None)
            self.loss_reasons.pop(engine_id, None)
            self._forgotten_max = max(self._forgotten_max, engine_id)
            forgotten.append(engine_id)
        return forgotten

    def forgot(self, engine_id: int) -> bool:
        """Whether ``engine_id`` may be a forgotten engine's (no record, at or below the highest
        id forgotten): it is not given to another engine."""
        return engine_id not in self.engines and 0 <= engine_id <= self._forgotten_max

    def not_ready(self, engine_ids: list[int]) -> dict[int, str]:
        """Why each of ``engine_ids`` is not ready for work (none: every one is); what
        ``seerctl start`` names instead of calling the daemon ready."""
        reasons: dict[int, str] = {}
        for engine_id in engine_ids:
            view = self.engines.get(engine_id)
            if view is None and self.forgot(engine_id):
                reasons[engine_id] = f"lost ({LOST_ENGINES_KEPT} or more engines were lost after it; see its log)"
            elif view is None:
                reasons[engine_id] = "never said hello"
            elif view.state is EngineState.LOST:
                reasons[engine_id] = f"lost ({self.loss_reasons.get(engine_id, 'see its log')})"
            elif view.state is EngineState.STARTING:
                reasons[engine_id] = "still starting (no hello yet)"
            elif view.state is not EngineState.READY:
                reasons[engine_id] = view.state.value
        return reasons

    def stop(self, engine_id: int) -> None:
        """``stopped`` after a clean shutdown."""
        self._move(self.engines[engine_id], EngineState.STOPPED)

    def replay_failed(self, engine_id: int, error: str) -> None:
        view = self.engines[engine_id]
        self._move(view, EngineState.LOST)
        assert view.hello is not None
        key = (view.hello.host_id, view.hello.pid)
        self._replay_failures.pop(key, None)  # the newest failure last
        self._replay_failures[key] = (self.weights_path or "", error)
        while len(self._replay_failures) > LOST_ENGINES_KEPT:  # the processes that failed most recently
            del self._replay_failures[next(iter(self._replay_failures))]

    # ------------------------------------------------------------------ queries
    def next_engine_id(self, num_spawned: int) -> int:
        """A fresh id for a joining engine: above every id ever seen (never reused, so a
        stale message can never be taken for a newer engine's), forgotten ones included, and
        the spawned range."""
        return max(num_spawned - 1, self._max_id) + 1

    def by_identity(self, identity: bytes) -> EngineView | None:
        engine_id = self._ids.get(identity)
        return None if engine_id is None else self.engines[engine_id]

    def weights_to_replay(self, hello: EngineHello, service_version: int) -> str | None:
        """The checkpoint an engine at ``engine_version`` must load before it may take
        work, or None when it is current or cannot be brought up to date (no update
        was recorded, it claims a version the service never had, or loading this very
        checkpoint already failed on it)."""
        if hello.weights_version >= service_version or self.weights_path is None:
            return None
        failed = self._replay_failures.get((hello.host_id, hello.pid))
        return None if failed is not None and failed[0] == self.weights_path else self.weights_path

    def replay_error(self, hello: EngineHello) -> str | None:
        failed = self._replay_failures.get((hello.host_id, hello.pid))
        return None if failed is None else f"loading the last update's checkpoint {failed[0]} failed: {failed[1]}"

    def is_updating(self, engine_id: int) -> bool:
        view = self.engines.get(engine_id)
        return view is not None and view.state is EngineState.UPDATING

    def heard(self, engine_id: int, now_s: float, load: EngineLoad | None = None) -> None:
        view = self.engines.get(engine_id)
        if view is not None:
            view.last_heard_s = now_s
            if load is not None:
                view.load = load

    def mark_unhealthy(self, engine_id: int) -> bool:
        """A chunk went past its deadline on this engine: no new work for it until it
        finishes one (it stays ``ready``: it heartbeats). True if it was healthy."""
        view = self.engines.get(engine_id)
        if view is None or view.unhealthy:
            return False
        view.unhealthy = True
        self._schedulable = None
        return True

    def finished_chunk(self, engine_id: int) -> bool:
        """The engine finished a chunk (even one given up on): healthy again. True if it was not."""
        view = self.engines.get(engine_id)
        if view is None or not view.unhealthy:
            return False
        view.unhealthy = False
        self._schedulable = None
        return True

    def drop_inflight_history(self) -> None:
        """Forget every engine's in-flight change log (``state.Inflight``): it keeps the last
        few hundred requests that left the engine, and through each (request -> group ->
        rollout) a whole ended rollout (``memory.py``). Its readers rescan the in-flight map
        once instead of replaying the log (``Inflight.update`` starts a new log)."""
        for view in self.engines.values():
            view.inflight.update()

    def loop_stalled(self, stall_s: float, now_s: float) -> None:
        """The control plane's own loop was busy for ``stall_s`` and read nothing: an
        engine's silence is not counted for that time (what it sent meanwhile still waits
        in the socket). Engine liveness never depends on the control plane's latency."""
        for view in self.engines.values():
            view.last_heard_s = min(now_s, view.last_heard_s + stall_s)

    def silent(self, now_s: float) -> list[int]:
        """Connected engines that have been silent longer than the heartbeat timeout."""
        return [e.engine_id for e in self.engines.values()
                if e.state in (EngineState.READY, EngineState.UPDATING) and now_s - e.last_heard_s > self.heartbeat_timeout_s]

    def live(self) -> list[EngineView]:
        """The engines that take work, by id."""
        return [e for _, e in sorted(self.engines.items()) if e.state is EngineState.READY]

    def schedulable(self) -> list[EngineView]:
        """The live engines that may be given new work (not marked unhealthy), by id: one
        list kept until an engine's record changes (callers must not change it)."""
        if self._schedulable is None:
            self._schedulable = [e for e in self.live() if not e.unhealthy]
        return self._schedulable

    def ready_ids(self) -> list[int]:
        return [e.engine_id for e in self.live()]

    def updating_ids(self) -> list[int]:
        return sorted(e.engine_id for e in self.engines.values() if e.state is EngineState.UPDATING)

    def connected_ids(self) -> list[int]:
        """Engines that hold a session with this control plane: ready or catching up."""
        return sorted(e.engine_id for e in self.engines.values()
                      if e.state in (EngineState.READY, EngineState.UPDATING))

    def num_starting(self) -> int:
        return sum(1 for e in self.engines.values() if e.state is EngineState.STARTING)
