"""Engines placed on a Ray cluster (``[cluster] launcher = "ray"``).

Owns: the daemon's connection to Ray (bounded: a TCP probe, then ``ray.init`` under a
deadline), the placement group (one bundle per engine, ``cpus_per_engine`` /
``gpus_per_engine``, ``placement_strategy``), one ``EngineActor`` per bundle, restarting a
slot whose actor or engine ended (``RestartBudget``), and removing actors and group at
stop. It implements ``seer.controlplane.launcher.EngineLauncher``.

Why here (cli/, the composition edge) and not in controlplane/: it starts processes on
other hosts through a third-party cluster manager, like ``seerctl engine --join`` does by
hand; the control plane only sees the protocol. Ray is imported lazily, only in this
module and ``ray_actor.py`` (tests/unit/test_imports.py checks it), so the default
local launcher does not need Ray installed.

Ownership of Ray objects: the daemon is the Ray driver; actors and the placement group
are not detached, so if the daemon dies (even SIGKILL) Ray removes them with its job and
each engine gets SIGTERM from its dead actor. Ray only places and supervises: engines
reach the control plane over CURVE TCP and move KV over the data plane as always.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from seer.config import SeerConfig
from seer.controlplane.launcher import EnginePlacement, LostEngine, RestartBudget

log = structlog.get_logger()

NAMESPACE = "seer"
# ``ray start --head`` records the cluster it started here; "auto" reads it (as Ray does).
RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")
WATCH_INTERVAL_S = 1.0  # how long one ray.wait for an ended engine blocks the watcher
ACTOR_WAIT_S = 2.0  # one EngineActor.wait call: a terminate queued behind it waits at most this


class LaunchError(RuntimeError):
    """Ray cannot place the engines as configured; the message names the setting to fix."""


def resolve_address(address: str, env: dict[str, str]) -> str:
    """HOST:PORT of the Ray cluster's GCS for ``cluster.address``."""
    if address.startswith("ray://"):
        raise LaunchError(f"cluster.address = {address!r}: Ray Client (ray://) is not supported; give the GCS "
                          "address HOST:PORT (`ray start --head` prints it) or \"auto\"")
    if address != "auto":
        return address
    if env.get("RAY_ADDRESS"):
        return resolve_address(env["RAY_ADDRESS"], {})
    try:
        found = RAY_CURRENT_CLUSTER.read_text().strip()
    except OSError:
        found = ""
    if not found:
        raise LaunchError("cluster.address = \"auto\": no Ray cluster on this host (no RAY_ADDRESS, no "
                          f"{RAY_CURRENT_CLUSTER}); start one with `ray start --head` or set cluster.address = "
                          "\"HOST:PORT\"")
    return found


def probe(address: str, timeout_s: float) -> None:
    """Raise LaunchError unless something accepts TCP connections at ``address`` within
    ``timeout_s`` (``ray.init`` itself retries an absent GCS for minutes)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"cluster.address = {address!r}: expected HOST:PORT of the Ray head (GCS) or \"auto\"")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LaunchError(f"cluster.address = {address!r}: no Ray cluster answers there within {timeout_s:.0f} s "
                                  f"({exc.strerror or exc}); start it (`ray start --head`) or fix cluster.address / "
                                  "cluster.connect_timeout_s") from None
            time.sleep(0.5)


@dataclass
class _Slot:
    """One bundle of the placement group and the actor running an engine in it."""

    index: int
    name: str
    actor: object
    where_ref: object
    wait_ref: object
    placement: EnginePlacement | None = None
    done: bool = False  # ended and not restarted


class RayLauncher:
    def __init__(self, config: SeerConfig, run_dir: Path, engine_address: str, cache_dir: Path) -> None:
        self.config = config
        self.cluster = config.cluster
        self.run_dir = run_dir
        self.engine_address = engine_address
        self.cache_dir = cache_dir
        self.group = None
        self._slots: dict[int, _Slot] = {}
        self._lost: list[LostEngine] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._budget = RestartBudget.for_slots(config.engines.count, self.cluster.max_restarts)
        self._watcher: threading.Thread | None = None
        self._tag = f"{os.getpid()}"

    # ------------------------------------------------------------------ connect and place
    def connect(self) -> None:
        """Reach the cluster and reserve one bundle per engine; LaunchError (and nothing left
        on the cluster) if either does not happen within its timeout."""
        address = resolve_address(self.cluster.address, dict(os.environ))
        probe(address, self.cluster.connect_timeout_s)
        try:
            import ray
        except ImportError:
            raise LaunchError("cluster.launcher = \"ray\" needs Ray: install the `ray` extra "
                              "(pip install -e \".[ray]\"; scripts/setup.sh does) or set cluster.launcher = \"local\""
                              ) from None

        failure: list[BaseException] = []

        def init() -> None:
            try:
                ray.init(address=address, namespace=NAMESPACE, logging_level="warning", log_to_driver=False,
                         configure_logging=False)
            except BaseException as exc:  # noqa: BLE001 - reported below, in one line
                failure.append(exc)

        started = time.monotonic()
        thread = threading.Thread(target=init, name="ray-init", daemon=True)
        thread.start()
        thread.join(self.cluster.connect_timeout_s)
        if thread.is_alive() or failure:
            why = f"{type(failure[0]).__name__}: {failure[0]}" if failure else \
                f"no answer as a Ray cluster within {self.cluster.connect_timeout_s:.0f} s"
            raise LaunchError(f"cluster.address = {self.cluster.address!r} ({address}): cannot join the Ray cluster "
                              f"({why.splitlines()[0]}); check that it is a Ray head's GCS address")
        log.info("ray_connected", address=address, connect_ms=round((time.monotonic() - started) * 1000),
                 resources=ray.cluster_resources())
        self._place()

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cluster.cpus_per_engine}
        if self.cluster.gpus_per_engine:
            bundle["GPU"] = self.cluster.gpus_per_engine
        return {k: v for k, v in bundle.items() if v}

    def _place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        count, bundle = self.config.engines.count, self._bundle() or {"CPU": 0.001}
        started = time.monotonic()
        self.group = placement_group([dict(bundle) for _ in range(count)], strategy=self.cluster.placement_strategy,
                                     name=f"seer-{self._tag}")
        try:
            ray.get(self.group.ready(), timeout=self.cluster.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            available = ray.cluster_resources()
            remove_placement_group(self.group)
            self.group = None
            ray.shutdown()
            have = ", ".join(f"{k} {v:g}" for k, v in sorted(available.items()) if k in ("CPU", "GPU"))
            raise LaunchError(f"the placement group ({count} x {bundle}, {self.cluster.placement_strategy}) stayed "
                              f"pending for {self.cluster.placement_timeout_s:.0f} s; the cluster has {have or 'nothing'}"
                              "; lower engines.count or cluster.cpus_per_engine / gpus_per_engine, or add nodes"
                              ) from None
        log.info("placement_group_ready", name=f"seer-{self._tag}", num_bundles=count, bundle=bundle,
                 strategy=self.cluster.placement_strategy, place_ms=round((time.monotonic() - started) * 1000))

    # ------------------------------------------------------------------ EngineLauncher
    @property
    def num_engines(self) -> int:
        """Engines that can still be up (slots not given up)."""
        with self._lock:
            return sum(1 for slot in range(self.config.engines.count)
                       if slot not in self._slots or not self._slots[slot].done)

    def start(self) -> None:
        for index in range(self.config.engines.count):
            self._start_slot(index, attempt=0)
        self._watcher = threading.Thread(target=self._watch, name="ray-engines", daemon=True)
        self._watcher.start()

    def take_lost(self) -> list[LostEngine]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def placements(self) -> list[EnginePlacement]:
        with self._lock:
            return [s.placement for s in self._slots.values() if s.placement is not None and not s.done]

    def gave_up(self) -> bool:
        return self.num_engines == 0

    def begin_stop(self) -> None:
        """From now on an engine that ends is not restarted (the drain shuts them down)."""
        self._stopping.set()

    def stop(self, grace_s: float) -> None:
        """Stop every engine through its actor (SIGTERM, SIGKILL after ``grace_s``), then
        remove every actor and the placement group and leave the cluster."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._lock:
            slots = list(self._slots.values())
        try:
            # Drained already (Shutdown sent): a joined engine would wait for the next control
            # plane, so each actor SIGTERMs its engine (graceful: it stops its node's agent too).
            stopping = [s.actor.terminate.remote(grace_s) for s in slots if not s.done]
            if stopping:
                ray.wait(stopping, num_returns=len(stopping), timeout=grace_s + ACTOR_WAIT_S + 10.0)
            for slot in slots:
                ray.kill(slot.actor)
            if self.group is not None:
                remove_placement_group(self.group)
            log.info("ray_engines_removed", num_actors=len(slots), placement_group=f"seer-{self._tag}")
        except Exception:  # noqa: BLE001 - the cluster may be gone; Ray removes a dead driver's objects
            log.exception("ray_engines_remove_failed", placement_group=f"seer-{self._tag}")
        finally:
            ray.shutdown()

    # ------------------------------------------------------------------ actors
    def _start_slot(self, index: int, attempt: int) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        import msgspec

        from seer.cli.ray_actor import EngineActor

        name = f"seer-{self._tag}-engine-{index}-{attempt}"
        bundle = self._bundle()
        actor = ray.remote(EngineActor).options(
            name=name, namespace=NAMESPACE, num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=index),
        ).remote(self.engine_address, msgspec.to_builtins(self.config), str(self.cache_dir), str(self.run_dir),
                 f"ray-engine-{index}")
        slot = _Slot(index, name, actor, actor.where.remote(), actor.wait.remote(ACTOR_WAIT_S))
        with self._lock:
            self._slots[index] = slot
        log.info("engine_actor_started", slot=index, actor=name, attempt=attempt)

    def _watch(self) -> None:
        """Learn where each engine runs; restart a slot whose engine ended."""
        import ray

        while not self._stopping.is_set():
            with self._lock:
                live = [s for s in self._slots.values() if not s.done]
            refs = [s.wait_ref for s in live] + [s.where_ref for s in live if s.placement is None]
            if not refs:
                self._stopping.wait(WATCH_INTERVAL_S)
                continue
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=WATCH_INTERVAL_S)
                for slot in live:
                    if slot.placement is None and slot.where_ref in ready:
                        self._located(slot)
                    if slot.wait_ref in ready:
                        self._waited(slot)
            except Exception:  # noqa: BLE001 - a Ray hiccup must not end the supervision
                log.exception("ray_engines_watch_failed")
                self._stopping.wait(WATCH_INTERVAL_S)

    def _located(self, slot: _Slot) -> None:
        import ray

        try:
            host, pid, node_ip, actor_id = ray.get(slot.where_ref)
        except ray.exceptions.RayError:
            return  # died before it could say: _ended reports it
        slot.placement = EnginePlacement(host_id=host, pid=pid, node_ip=node_ip, actor_id=actor_id)
        log.info("engine_actor_placed", slot=slot.index, actor=slot.name, actor_id=actor_id, node_ip=node_ip, pid=pid)

    def _waited(self, slot: _Slot) -> None:
        import ray

        try:
            code = ray.get(slot.wait_ref)
        except ray.exceptions.RayError as exc:
            self._ended(slot, f"its Ray actor died ({type(exc).__name__})")
            return
        if code is None:  # still running: ask again
            slot.wait_ref = slot.actor.wait.remote(ACTOR_WAIT_S)
        else:
            self._ended(slot, f"its engine process exited with code {code}")

    def _ended(self, slot: _Slot, reason: str) -> None:
        import ray

        if slot.placement is None:
            self._located(slot)  # the actor may have answered where() before it ended
        where = slot.placement
        reason = f"Ray actor {slot.name}" + (f" on {where.node_ip}" if where else "") + f": {reason}"
        with self._lock:
            if slot.placement is not None:
                self._lost.append(LostEngine(slot.placement, reason))
            restart = self._budget.should_restart(slot.index, self._stopping.is_set())
            if not restart:
                slot.done = True
        ray.kill(slot.actor)
        if restart:
            attempt = self._budget.restarted(slot.index)
            log.warning("engine_actor_restarted", slot=slot.index, reason=reason, attempt=attempt,
                        max_restarts=self.cluster.max_restarts)
            self._start_slot(slot.index, attempt)
        elif not self._stopping.is_set():
            log.error("engine_actor_given_up", slot=slot.index, reason=reason, max_restarts=self.cluster.max_restarts,
                      fix="see the engine's ray-engine-N.out on its node; raise cluster.max_restarts")
