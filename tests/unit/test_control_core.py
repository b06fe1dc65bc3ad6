"""The control plane's decisions that span its parts (controlplane/core.py), without
sockets: weights updates, engine hellos and heartbeats, the ticker's judgement of engines."""

from __future__ import annotations

from structlog.testing import capture_logs

from seer.controlplane.launcher import EnginePlacement, LostEngine
from seer.controlplane.outbox import ToClient, ToEngine
from seer.controlplane.state import EngineState
from seer.protocol import (
    JOIN_ENGINE_ID,
    EngineLoad,
    ErrorReply,
    HelloAccepted,
    LoadWeights,
    UpdateWeightsRequest,
    WeightsLoaded,
    WeightsUpdated,
    pack_steps,
)
from tests.unit.core_parts import CLIENT, Clock, admit, dispatch, hello, make_core, start_rollout


def update(path: str) -> UpdateWeightsRequest:
    return UpdateWeightsRequest(call_id="u", path=path)


def test_a_weights_update_is_refused_while_a_rollout_runs(tmp_path):
    """An open rollout: the client is told ``rollout_running`` and no engine is sent anything."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    start_rollout(core)
    ((refusal,),) = [core.update_weights(CLIENT, update(str(tmp_path)))]
    assert isinstance(refusal, ToClient) and isinstance(refusal.msg, ErrorReply)
    assert refusal.msg.code == "rollout_running" and core.weights.update is None


def test_a_weights_update_ends_with_the_last_answer_and_is_replayed_to_a_later_joiner(tmp_path):
    """Every ready engine gets ``LoadWeights`` of the next version; the last answer moves
    the service to it and answers the client; an engine that joins later with the old
    weights loads the same checkpoint before it is admitted."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    admit(core, 1)
    path = str(tmp_path)
    assert core.update_weights(CLIENT, update(path)) == [
        ToEngine(0, LoadWeights(path=path, weights_version=1)), ToEngine(1, LoadWeights(path=path, weights_version=1))]
    assert core.weights_loaded(WeightsLoaded(engine_id=0, weights_version=1)).sends == []
    answer = core.weights_loaded(WeightsLoaded(engine_id=1, weights_version=1))
    assert answer.sends == [ToClient(CLIENT, WeightsUpdated(call_id="u", weights_version=1))] and not answer.admitted
    assert core.weights.service_version == 1 and core.registry.weights_path == path
    assert [core.registry.engines[e].loaded_weights_version for e in (0, 1)] == [1, 1]

    joiner = core.hello(b"join-a", hello(JOIN_ENGINE_ID, pid=7))
    assert joiner.sends == [ToEngine(2, HelloAccepted(engine_id=2)), ToEngine(2, LoadWeights(path=path, weights_version=1))]
    assert not joiner.admitted and core.registry.engines[2].state is EngineState.UPDATING
    caught_up = core.weights_loaded(WeightsLoaded(engine_id=2, weights_version=1))
    assert caught_up.admitted and core.registry.engines[2].state is EngineState.READY


def test_an_engine_lost_during_an_update_fails_it_at_the_next_tick(tmp_path):
    """The update stops waiting for a lost engine and fails: the client is told which, the
    service stays at its version and no checkpoint is recorded for joiners."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    admit(core, 1)
    core.update_weights(CLIENT, update(str(tmp_path)))
    core.weights_loaded(WeightsLoaded(engine_id=0, weights_version=1))
    assert core.expire_weights(clock.now) == []
    core.health.lose_engine(1, "silent")
    ((reply,),) = [core.expire_weights(clock.now)]
    assert reply.msg.code == "weights_update_failed" and "engine 1 was lost during the update" in reply.msg.message
    assert core.weights.service_version == 0 and core.registry.weights_path is None


def test_a_weights_update_past_its_deadline_names_the_engines_that_did_not_answer(tmp_path):
    """``engines.startup_timeout_s`` after the start, the update fails naming the silent engines."""
    clock = Clock()
    core = make_core(tmp_path, clock, startup_timeout_s=10.0)
    admit(core, 0)
    admit(core, 1)
    core.update_weights(CLIENT, update(str(tmp_path)))
    core.weights_loaded(WeightsLoaded(engine_id=1, weights_version=1))
    assert core.expire_weights(10.0) == []
    ((reply,),) = [core.expire_weights(10.5)]
    assert "engines [0] did not answer in time" in reply.msg.message


def test_a_new_process_joining_under_a_live_engines_identity_loses_that_engine_first(tmp_path):
    """One identity is one connection: the engine registered under it is lost (its chunks
    requeued) before the newcomer is admitted under a fresh id."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    assert core.hello(b"join-a", hello(JOIN_ENGINE_ID, pid=7)).admitted  # engine 2
    start_rollout(core, group_size=2)
    core.registry.mark_unhealthy(0)  # the group goes to engine 2
    assert {s.engine_id for s in dispatch(core, clock)} == {2}
    answer = core.hello(b"join-a", hello(JOIN_ENGINE_ID, pid=8))
    assert answer.admitted and answer.sends == [ToEngine(3, HelloAccepted(engine_id=3))]
    assert core.registry.engines[2].state is EngineState.LOST
    assert core.registry.loss_reasons[2] == "another engine process said hello under its identity"
    assert core.scheduler.num_waiting() == 2
    assert core.hello(b"join-a", hello(JOIN_ENGINE_ID, pid=8)).sends == [ToEngine(3, HelloAccepted(engine_id=3))]


def test_a_heartbeat_is_heard_and_malformed_step_records_are_refused(tmp_path):
    """A heartbeat refreshes the engine's liveness and load; step records that are not
    whole records are dropped and reported (the server counts a bad frame)."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    clock.now = 5.0
    load = EngineLoad(num_running=3)
    assert core.heartbeat(0, load, b"", clock.now)
    assert core.registry.engines[0].last_heard_s == 5.0 and core.registry.engines[0].load == load
    assert core.heartbeat(0, load, pack_steps([(0.01, 4.0, 100.0, 0.0)]), clock.now)
    with capture_logs() as logs:
        assert not core.heartbeat(0, load, b"\x00\x01\x02", 6.0)
    assert [e["event"] for e in logs] == ["engine_steps_refused"]
    assert core.registry.engines[0].last_heard_s == 6.0


def test_the_ticker_loses_engines_whose_process_exited_or_whose_launcher_saw_them_end(tmp_path):
    """A spawned engine's exit and a launched engine's end (matched by host and pid) each
    lose that engine with its reason; an end that matches no engine loses nothing."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    for engine_id in range(3):
        admit(core, engine_id, pid=100 + engine_id)
    ended = EnginePlacement(host_id="here", pid=101, node_ip="10.0.0.2", actor_id="a1")
    elsewhere = EnginePlacement(host_id="other", pid=102, node_ip="10.0.0.3", actor_id="a2")
    out = core.judge_engines(clock.now, exits=[(0, 100, 1)],
                             lost=[LostEngine(ended, "actor died"), LostEngine(elsewhere, "actor died")])
    assert out == []
    assert [core.registry.engines[e].state for e in range(3)] == [EngineState.LOST, EngineState.LOST, EngineState.READY]
    assert "process 100 exited with code 1" in core.registry.loss_reasons[0]
    assert core.registry.loss_reasons[1] == "actor died"
