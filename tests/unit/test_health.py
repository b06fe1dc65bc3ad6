"""What the control plane does about chunks that do not come back and engines that stop
working (controlplane/health.py), decided without sockets: every decision is the outbox
the server would deliver."""

from __future__ import annotations

from structlog.testing import capture_logs

from seer.controlplane.health import MAX_CHUNK_FAILURES
from seer.controlplane.membership import lost_message
from seer.controlplane.outbox import ToEngine
from seer.controlplane.state import EngineState
from seer.protocol import AbortTasks
from tests.unit.chunks import finished
from tests.unit.core_parts import Clock, admit, dispatch, errors, make_core, start_rollout


def test_a_chunk_past_its_deadline_is_aborted_requeued_and_its_engine_gets_no_new_work(tmp_path):
    """Both chunks of a group pass their deadline: each is aborted on its engine and goes
    back to the buffer with one failure; the engine gets no new work until a chunk of its
    comes back, even late."""
    clock = Clock()
    core = make_core(tmp_path, clock, chunk_deadline_unmeasured_s=60.0, chunk_deadline_min_s=1.0)
    admit(core, 0)
    admit(core, 1)
    start_rollout(core, group_size=2)
    sent = dispatch(core, clock)
    assert {s.engine_id for s in sent} == {0}
    clock.now = 59.0
    assert core.health.expire_chunks(clock.now) == []
    clock.now = 61.0
    out = core.health.expire_chunks(clock.now)
    assert out == [ToEngine(0, AbortTasks(task_ids=[s.task.task_id])) for s in sent]
    assert [s.request.num_failures for s in sent] == [1, 1]
    assert [e.engine_id for e in core.registry.schedulable()] == [1]
    assert {s.engine_id for s in dispatch(core, clock)} == {1}
    core.health.chunk_finished(finished(0, sent[0].task.task_id, [9, 9], [-0.1, -0.1], "stop"), clock.now)
    assert [e.engine_id for e in core.registry.schedulable()] == [0, 1]
    late = core.health.expire_chunks(clock.now + 1000.0)  # the ones given up on are not reported again
    assert {send.engine_id for send in late} == {1}


def test_a_chunk_reported_failed_goes_back_and_the_last_allowed_failure_fails_its_rollout(tmp_path):
    """A ``ChunkFailed`` requeues its request; the failure that reaches the limit fails the
    rollout: its other chunks are aborted and its client gets ``request_failed`` naming the
    engine's error. A failure of a chunk not on that engine changes nothing."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    start_rollout(core, group_size=2)
    first, other = dispatch(core, clock)
    assert core.health.chunk_failed(1, first.task.task_id, "not mine", clock.now) == []
    assert first.request.num_failures == 0
    for _ in range(MAX_CHUNK_FAILURES - 1):
        assert core.health.chunk_failed(0, first.task.task_id, "boom", clock.now) == []
        (first,) = dispatch(core, clock)
    out = core.health.chunk_failed(0, first.task.task_id, "out of memory", clock.now)
    assert out[0] == ToEngine(0, AbortTasks(task_ids=[other.task.task_id]))
    ((code, message),) = errors(out)
    assert code == "request_failed" and f"failed {MAX_CHUNK_FAILURES} times" in message
    assert "last error on engine 0: out of memory" in message
    assert "r" not in core.scheduler.rollouts


def test_a_stalled_engine_has_all_its_chunks_moved_and_its_rollout_fails_once(tmp_path):
    """An engine that answers nothing for ``stall_heartbeats`` heartbeats while another
    answers: one ``AbortTasks`` with all its chunks, the engine unhealthy; two requests
    reaching the failure limit in that one sweep fail their rollout once."""
    clock = Clock()
    core = make_core(tmp_path, clock, stall_heartbeats=3, heartbeat_interval_s=1.0)
    admit(core, 0)
    admit(core, 1)
    start_rollout(core, "r", group_size=2)
    stuck = dispatch(core, clock)
    start_rollout(core, "s", group_size=1)
    (working,) = dispatch(core, clock)
    assert {s.engine_id for s in stuck} == {0} and working.engine_id == 1
    for send in stuck:
        send.request.num_failures = MAX_CHUNK_FAILURES - 1  # two earlier failures each
    clock.now = 2.0
    core.chunk_finished(finished(1, working.task.task_id, [9, 9], [-0.1, -0.1], "stop"), clock.now)
    assert core.health.move_stalled(clock.now) == []  # within the window
    clock.now = 3.5
    with capture_logs() as logs:
        out = core.health.move_stalled(clock.now)
    assert out[0] == ToEngine(0, AbortTasks(task_ids=[s.task.task_id for s in stuck]))
    assert [code for code, _ in errors(out)] == ["request_failed"]
    assert [e["event"] for e in logs] == ["engine_stalled", "engine_unhealthy", "rollout_failed"]
    assert core.registry.engines[0].unhealthy and core.registry.engines[0].state is EngineState.READY


def test_a_fleet_that_is_slow_as_a_whole_stalls_no_engine(tmp_path):
    """No engine answered anything meanwhile (a loaded machine): nobody is stalled."""
    clock = Clock()
    core = make_core(tmp_path, clock, stall_heartbeats=3, heartbeat_interval_s=1.0)
    admit(core, 0)
    admit(core, 1)
    start_rollout(core, "r", group_size=2)
    start_rollout(core, "s", group_size=1)
    dispatch(core, clock)
    clock.now = 100.0
    assert core.health.move_stalled(clock.now) == []


def test_losing_the_last_engine_fails_its_rollouts_at_once_without_a_replacement_wait(tmp_path):
    """With ``replacement_wait_s = 0``, losing the only engine requeues its chunks and fails
    every open rollout with ``no_engines``, naming the engine and the reason."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    start_rollout(core)
    dispatch(core, clock)
    out = core.health.lose_engine(0, "process 100 exited with code 9")
    assert errors(out) == [("no_engines", lost_message(0, "process 100 exited with code 9"))]
    assert core.registry.engines[0].state is EngineState.LOST
    assert core.registry.loss_reasons[0] == "process 100 exited with code 9"


def test_stranded_rollouts_wait_for_a_joiner_and_fail_only_when_none_came_in_time(tmp_path):
    """With ``replacement_wait_s``, losing the last engine fails nothing at once; the
    rollout fails with ``no_engines`` once the wait is over, and once only."""
    clock = Clock()
    core = make_core(tmp_path, clock, replacement_wait_s=10.0)
    admit(core, 0)
    start_rollout(core)
    dispatch(core, clock)
    assert core.health.lose_engine(0, "silent") == []
    assert core.health.check_stranded(9.0) == []
    ((code, message),) = errors(core.health.check_stranded(10.0))
    assert code == "no_engines" and "none joined within engines.replacement_wait_s = 10 s" in message
    assert core.health.check_stranded(20.0) == []


def test_an_engine_that_joins_in_time_takes_the_stranded_rollouts_over(tmp_path):
    """A joiner within ``replacement_wait_s`` ends the wait: nothing fails, and the
    requeued chunks go to it."""
    clock = Clock()
    core = make_core(tmp_path, clock, replacement_wait_s=10.0)
    admit(core, 0)
    start_rollout(core, group_size=2)
    dispatch(core, clock)
    core.health.lose_engine(0, "silent")
    admit(core, 1)
    assert core.health.check_stranded(5.0) == []
    assert core.health.check_stranded(50.0) == []
    assert {s.engine_id for s in dispatch(core, clock)} == {1}


def test_a_silent_engine_is_lost_but_time_the_loop_stood_still_is_not_held_against_it(tmp_path):
    """Silent past ``heartbeat_timeout_s`` is lost; a stall of the control plane's own loop
    does not count as the engine's silence."""
    clock = Clock()
    core = make_core(tmp_path, clock, heartbeat_timeout_s=5.0)
    admit(core, 0)
    core.health.loop_stalled(3.0, 4.0)
    assert core.health.lose_silent(7.0) == []
    assert core.registry.engines[0].state is EngineState.READY
    core.health.lose_silent(8.5)
    assert core.registry.engines[0].state is EngineState.LOST
    assert core.registry.loss_reasons[0] == "silent for more than 5 s"


def test_an_exited_process_loses_its_engine_if_it_was_starting_or_live(tmp_path):
    """A spawned engine whose process exits before its hello is lost, naming its exit code
    and output file; the same exit seen again, or an exit of an unknown engine, loses
    nothing more."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    core.registry.expect(0, 4242, clock.now)
    core.health.process_exited(0, 4242, -9)
    assert core.registry.engines[0].state is EngineState.LOST
    reason = core.registry.loss_reasons[0]
    assert "process 4242 exited with code -9" in reason and str(tmp_path / "engine-0.out") in reason
    core.registry.loss_reasons[0] = "first"
    assert core.health.process_exited(0, 4242, -9) == [] and core.registry.loss_reasons[0] == "first"
    assert core.health.process_exited(7, 1, 0) == [] and 7 not in core.registry.engines


def test_losing_an_unknown_or_already_lost_engine_changes_nothing(tmp_path):
    """Only a live engine can be lost; a second loss keeps the first reason."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    admit(core, 1)
    assert core.health.lose_engine(9, "unreachable") == [] and 9 not in core.registry.engines
    core.health.lose_engine(0, "unreachable")
    assert core.health.lose_engine(0, "silent") == [] and core.registry.loss_reasons[0] == "unreachable"
