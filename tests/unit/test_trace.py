"""Rollout traces rebuilt from hand-written control-plane log lines (controlplane/trace.py).

Every expected figure below is worked out by hand from the lines of the test.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from seer.controlplane.trace import (
    ALL_ROLLOUTS,
    TraceError,
    build_trace,
    read_log,
    select_rollouts,
    summarize,
    union_length_s,
)

T0 = datetime(2026, 11, 30, tzinfo=UTC)
R = "r1"


def line(t: float, event: str, **fields: object) -> str:
    """A log line as seer/logs.py writes it, ``t`` seconds after T0."""
    stamp = (T0 + timedelta(seconds=t)).isoformat().replace("+00:00", "Z")
    return json.dumps({**fields, "event": event, "level": "info", "timestamp": stamp,
                       "process": "controlplane"})


def dispatched(t: float, task_id: int, request: str, engine_id: int, **extra: object) -> str:
    return line(t, "chunk_dispatched", request_id=request, group_id=request.rsplit("/", 1)[0],
                engine_id=engine_id, task_id=task_id, max_tokens=16, num_prompt_tokens=10, **extra)


def finished(t: float, task_id: int, request: str, engine_id: int, num_tokens: int, reason: str = "length",
             **extra: object) -> str:
    return line(t, "chunk_finished", request_id=request, group_id=request.rsplit("/", 1)[0],
                engine_id=engine_id, task_id=task_id, num_tokens=num_tokens, num_cached_tokens=0,
                finish_reason=reason, **extra)


# Three requests of one group on two engines, window t=2..9:
#   engine 0: task1 [2,4]  task5 [5,6] failed  task6 [6,8]  task7 [7,9] (migrated in, not logged)
#   engine 1: task2 [2,5]  task3 [4,7] (migrated in through the KV pool, logged)
DIVIDED_LOG = [
    line(0, "control_plane_started", policy="divided"),
    line(0, "engine_ready", engine_id=0),
    line(1, "engine_ready", engine_id=1),
    line(2, "rollout_accepted", rollout_id=R, policy="divided", num_groups=1, num_samples=3, max_tokens=64),
    dispatched(2, 1, f"{R}/0/0", 0),
    dispatched(2, 2, f"{R}/0/1", 1),
    finished(4, 1, f"{R}/0/0", 0, 16),
    dispatched(4, 3, f"{R}/0/0", 1, rollout_id=R),
    line(4, "chunk_migrated", request_id=f"{R}/0/0", group_id=f"{R}/0", task_id=3, from_engine_id=0,
         to_engine_id=1, prefix_tokens=26, kv_loaded_tokens=26, num_bytes=1000, load_ms=5.0,
         reprefill_tokens=0, mode="pool"),
    finished(5, 2, f"{R}/0/1", 1, 10, "stop"),
    dispatched(5, 5, f"{R}/0/2", 0),
    line(6, "chunk_failed", engine_id=0, task_id=5, error="boom"),
    dispatched(6, 6, f"{R}/0/2", 0),
    finished(7, 3, f"{R}/0/0", 1, 8),
    dispatched(7, 7, f"{R}/0/0", 0),
    finished(8, 6, f"{R}/0/2", 0, 4, "stop"),
    finished(9, 7, f"{R}/0/0", 0, 2),
    line(9, "rollout_finished", rollout_id=R, policy="divided", num_samples=3, num_output_tokens=40,
         wall_time_s=7.0, tail_time_s=1.0, num_preemptions=2),
]


def trace_of(lines: list[str], tmp_path: Path):
    (tmp_path / "controlplane.log").write_text("\n".join(lines) + "\n")
    return build_trace(*read_log(tmp_path))


def test_summary_of_a_divided_rollout_matches_the_hand_count(tmp_path):
    """Chunks, outcomes, tokens, samples, preemptions and both kinds of migration come out
    as counted by hand from the log lines."""
    trace = trace_of(DIVIDED_LOG, tmp_path)
    s = summarize(trace, select_rollouts(trace, None))
    assert s.rollout_ids == [R] and s.policies == ["divided"]
    assert s.duration_s == pytest.approx(7.0)
    assert (s.num_chunks, s.num_chunks_by_outcome, s.num_requests) == (6, {"finished": 5, "failed": 1}, 3)
    assert (s.num_output_tokens, s.num_samples, s.num_preemptions) == (40, 3, 2)
    assert (s.num_migrations, s.num_pool_migrations) == (2, 1)
    assert (s.num_reprefill_migrations, s.num_unknown_migrations) == (0, 1)
    assert (s.num_bytes_moved, s.load_ms_total, s.num_reprefill_tokens) == (1000, 5.0, 0)
    assert [sp.task_id for sp in trace.spans if sp.migrated] == [3, 7]


def test_engine_busy_time_is_the_union_of_chunks_in_flight(tmp_path):
    """Engine 0 is busy [2,4] and [5,9] (overlapping chunks counted once) = 6 of 7 s;
    engine 1 is busy [2,7] = 5 of 7 s."""
    trace = trace_of(DIVIDED_LOG, tmp_path)
    e0, e1 = summarize(trace, [R]).engines
    assert (e0.engine_id, e0.num_chunks, e0.num_tokens, e0.num_migrations_in) == (0, 4, 22, 1)
    assert (e0.busy_s, e0.alive_s) == (pytest.approx(6.0), pytest.approx(7.0))
    assert e0.idle_pct == pytest.approx(100 / 7)
    assert (e1.engine_id, e1.num_chunks, e1.num_tokens, e1.num_migrations_in) == (1, 2, 18, 1)
    assert (e1.busy_s, e1.idle_pct) == (pytest.approx(5.0), pytest.approx(200 / 7))


def test_old_logs_without_dispatches_or_migration_events_still_summarise(tmp_path):
    """A chunk_finished without its dispatch starts at its latency; the rollout is read from
    the group id; with no chunk_migrated events, bytes moved are unknown, not zero."""
    lines = [finished(10, 1, "old/0/0", 0, 5, latency_ms=1500.0),
             finished(11, 2, "old/0/0", 1, 5, "stop", latency_ms=500.0)]
    trace = trace_of(lines, tmp_path)
    assert [(sp.start_s - T0.timestamp(), sp.rollout_id) for sp in trace.spans] == [
        (pytest.approx(8.5), "old"), (pytest.approx(10.5), "old")]
    s = summarize(trace, select_rollouts(trace, None))
    assert (s.num_migrations, s.num_unknown_migrations, s.num_bytes_moved, s.num_reprefill_tokens) == (
        1, 1, None, None)
    assert (s.num_samples, s.num_preemptions) == (None, None)
    assert s.duration_s == pytest.approx(2.5)


def test_a_lost_engine_ends_its_chunks_and_its_up_time(tmp_path):
    """engine_lost at t=4 marks the chunk in flight there lost; that engine's idle share
    counts only the 2 s it was up in the window [2,6]."""
    lines = [line(0, "engine_ready", engine_id=0), line(0, "engine_ready", engine_id=1),
             line(2, "rollout_accepted", rollout_id=R, policy="group", num_samples=2),
             dispatched(2, 1, f"{R}/0/0", 0), dispatched(2, 2, f"{R}/0/1", 1),
             finished(3, 1, f"{R}/0/0", 0, 4, "stop"),
             line(4, "engine_lost", engine_id=1, reason="killed"),
             dispatched(4, 3, f"{R}/0/1", 0), finished(6, 3, f"{R}/0/1", 0, 4, "stop"),
             line(6, "rollout_finished", rollout_id=R, num_samples=2, num_preemptions=0)]
    trace = trace_of(lines, tmp_path)
    assert [(sp.task_id, sp.outcome) for sp in trace.spans] == [(1, "finished"), (2, "lost"), (3, "finished")]
    e0, e1 = summarize(trace, [R]).engines
    assert (e0.busy_s, e0.idle_pct) == (pytest.approx(3.0), pytest.approx(25.0))
    assert (e1.busy_s, e1.alive_s) == (pytest.approx(2.0), pytest.approx(2.0))
    assert e1.idle_pct == pytest.approx(0.0)
    assert summarize(trace, [R]).num_migrations == 1  # task 3 re-ran the lost request elsewhere


def test_aborted_rollout_closes_only_its_own_chunks(tmp_path):
    """rollout_aborted ends the aborted rollout's chunks; another rollout's chunk stays in
    flight and, with no end in the log, is unfinished at the last line."""
    lines = [dispatched(0, 1, "a/0/0", 0), dispatched(0, 2, "b/0/0", 0),
             line(1, "rollout_aborted", rollout_id="a", reason="client_lost"), line(3, "group_finished")]
    trace = trace_of(lines, tmp_path)
    assert [(sp.rollout_id, sp.outcome, sp.end_s - T0.timestamp()) for sp in trace.spans] == [
        ("a", "aborted", pytest.approx(1.0)), ("b", "unfinished", pytest.approx(3.0))]
    assert trace.rollouts["a"].outcome == "aborted"


def test_rollout_selection_by_default_prefix_and_all(tmp_path):
    """Default is the last rollout accepted; a unique prefix picks one; an ambiguous or
    unknown one is refused naming the rollouts; 'all' takes every rollout."""
    lines = [line(0, "rollout_accepted", rollout_id="abc1"), dispatched(0, 1, "abc1/0/0", 0),
             line(1, "rollout_accepted", rollout_id="abd2"), dispatched(1, 2, "abd2/0/0", 0)]
    trace = trace_of(lines, tmp_path)
    assert select_rollouts(trace, None) == ["abd2"]
    assert select_rollouts(trace, "abc") == ["abc1"]
    assert select_rollouts(trace, ALL_ROLLOUTS) == ["abc1", "abd2"]
    for wanted in ("ab", "zz"):
        with pytest.raises(TraceError, match="abc1, abd2"):
            select_rollouts(trace, wanted)


def test_malformed_lines_are_counted_and_skipped(tmp_path):
    """A cut last line or non-event JSON does not stop the trace; it is counted."""
    (tmp_path / "controlplane.log").write_text(DIVIDED_LOG[4] + "\n[1, 2]\n\n" + DIVIDED_LOG[6][:30] + "\n")
    events, bad = read_log(tmp_path)
    assert (len(events), bad) == (1, 2)


def test_missing_log_is_a_clear_error(tmp_path):
    """A run dir without controlplane.log names the file it looked for."""
    with pytest.raises(TraceError, match="controlplane.log"):
        read_log(tmp_path)


def test_union_length_counts_overlaps_once():
    """[0,2] u [1,3] u [5,6] u [5.5,5.7] covers 4 s."""
    assert union_length_s([(5, 6), (0, 2), (1, 3), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_length_s([]) == 0.0


def test_a_daemon_restart_ends_chunks_in_flight_and_task_ids_start_over(tmp_path):
    """A new control_plane_started leaves the old life's chunk unfinished at the restart;
    the new life's task 2 migration marks only the new life's task 2."""
    lines = [line(0, "control_plane_started"), line(0, "engine_ready", engine_id=0),
             line(1, "rollout_accepted", rollout_id="a"),
             dispatched(1, 1, "a/0/0", 0), finished(2, 1, "a/0/0", 0, 4), dispatched(2, 2, "a/0/0", 0),
             line(5, "control_plane_started"), line(6, "engine_ready", engine_id=0),
             line(6, "engine_ready", engine_id=1), line(7, "rollout_accepted", rollout_id="b"),
             dispatched(7, 1, "b/0/0", 0), finished(8, 1, "b/0/0", 0, 4), dispatched(8, 2, "b/0/0", 1),
             finished(9, 2, "b/0/0", 1, 4, "stop"),
             line(9, "chunk_migrated", request_id="b/0/0", task_id=2, from_engine_id=0, to_engine_id=1,
                  num_bytes=0, load_ms=0.0, reprefill_tokens=14, mode="reprefill")]
    trace = trace_of(lines, tmp_path)
    assert [(sp.rollout_id, sp.task_id, sp.outcome, sp.migrated, sp.end_s - T0.timestamp())
            for sp in trace.spans] == [
        ("a", 1, "finished", False, pytest.approx(2.0)), ("a", 2, "unfinished", False, pytest.approx(5.0)),
        ("b", 1, "finished", False, pytest.approx(8.0)), ("b", 2, "finished", True, pytest.approx(9.0))]
    a, b = summarize(trace, ["a"]), summarize(trace, ["b"])
    assert (a.num_migrations, b.num_migrations) == (0, 1)
    assert (b.num_reprefill_migrations, b.num_reprefill_tokens) == (1, 14)
    assert [(e.engine_id, e.alive_s) for e in a.engines] == [(0, pytest.approx(4.0))]  # down at the restart
