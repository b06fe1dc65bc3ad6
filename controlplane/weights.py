"""Weights updates: the version the service is at, and the one update in flight.

Owns: the service's weights version (``service_version``: how many updates succeeded;
what engines must have to take work, what ``RolloutAccepted`` and ``RolloutCompleted``
report), the update in flight (at most one: its ``target_version``, the engines that still
owe a ``WeightsLoaded``, their errors, the deadline), whether an update may start now (and
which refusal otherwise), the ``LoadWeights`` it sends and the reply its caller gets when
it ends (an ``Outbox``, ``outbox.py``). Pure: the server delivers those, logs
``weights_update_started`` / ``weights_updated`` / ``weights_update_failed``, and records
the checkpoint for engines that join later (``Registry.weights_path``). Not to be confused
with an engine's loaded version (``EngineView.loaded_weights_version``) or the KV pool's
epoch (``Scheduler.kv_epoch``), which counts update *attempts*.

An update ends once every engine it was sent to has answered, been lost, or the
deadline (``engines.startup_timeout_s`` after the start) has passed. Any error fails
it as a whole: the service stays at its version; engines that did load the checkpoint
report the new version in their status.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from seer.controlplane.outbox import Outbox, ToClient, ToEngine
from seer.protocol import ErrorReply, LoadWeights, WeightsUpdated
from seer.weights_segment import source_exists


@dataclass
class WeightUpdate:
    identity: bytes  # the client that asked, and its call: where the reply goes
    call_id: str
    target_version: int  # the service's version once this update succeeds
    path: str
    pending: set[int]  # engines sent LoadWeights that have not answered yet
    errors: list[str]
    deadline_s: float


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str


class Weights:
    def __init__(self) -> None:
        self.service_version = 0
        self.update: WeightUpdate | None = None

    def refuse_update(self, path: str, *, num_sessions: int, rollouts_running: bool, engines_updating: bool,
                      ready_ids: list[int], exists: Callable[[str], bool] = source_exists) -> Refusal | None:
        """Why an update of ``path`` (a weights source: a checkpoint path or a trainer's
        segment, ``seer/weights_segment.py``) may not start now (None: it may)."""
        if num_sessions or rollouts_running:
            return Refusal("rollout_running", f"{num_sessions} rollout(s) are running; weights can only be "
                           "updated between rollouts (wait for them or cancel them first)")
        if self.update is not None or engines_updating:
            return Refusal("busy", "another weights update is in progress (or an engine is loading the current "
                           "weights); retry in a moment")
        if not exists(path):
            return Refusal("bad_weights_path", f"weights path {path!r} does not exist on the daemon's host (a "
                           "checkpoint path, or shm://<segment>?generation=<n> in this host's /dev/shm)")
        if not ready_ids:
            return Refusal("no_engines", "no engine is ready to load weights")
        return None

    def start(self, identity: bytes, call_id: str, path: str, engine_ids: list[int], deadline_s: float) -> Outbox:
        """Begin an update (after ``refuse_update`` said None) to the next version: the
        ``LoadWeights`` each of ``engine_ids`` is sent."""
        assert self.update is None
        version = self.service_version + 1
        self.update = WeightUpdate(identity, call_id, version, path, set(engine_ids), [], deadline_s)
        return [ToEngine(e, LoadWeights(path=path, weights_version=version)) for e in engine_ids]

    def loaded(self, engine_id: int, error: str) -> bool:
        """An engine answered ``LoadWeights``; False if the update was not waiting for it."""
        update = self.update
        if update is None or engine_id not in update.pending:
            return False
        update.pending.discard(engine_id)
        if error:
            update.errors.append(f"engine {engine_id}: {error}")
        return True

    def expire(self, now_s: float, ready_ids: Collection[int]) -> None:
        """Stop waiting for engines lost since the update started and, past the deadline,
        for every engine that has not answered."""
        update = self.update
        if update is None:
            return
        for engine_id in list(update.pending):
            if engine_id not in ready_ids:
                update.pending.discard(engine_id)
                update.errors.append(f"engine {engine_id} was lost during the update")
        if now_s > update.deadline_s:
            update.errors.append(f"engines {sorted(update.pending)} did not answer in time")
            update.pending.clear()

    def answered(self) -> bool:
        """True when an update is in flight and no engine is left to wait for: ``finish()`` it."""
        return self.update is not None and not self.update.pending

    def finish(self) -> tuple[WeightUpdate, Outbox]:
        """End the update in flight; the service moves to its version only if it had no
        error. Its client's reply goes out."""
        update = self.update
        assert update is not None
        self.update = None
        if not update.errors:
            self.service_version = update.target_version
        return update, [ToClient(update.identity, update_reply(update))]


def update_reply(update: WeightUpdate) -> ErrorReply | WeightsUpdated:
    """What the client that asked for a finished update is told."""
    if update.errors:
        return ErrorReply(call_id=update.call_id, code="weights_update_failed",
                          message="; ".join(update.errors) + ". Engines that failed keep their previous weights; "
                          "fix the checkpoint and call update_weights again")
    return WeightsUpdated(call_id=update.call_id, weights_version=update.target_version)
