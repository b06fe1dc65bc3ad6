"""Chunk deadlines follow measured speed, recomputed as results arrive, and an engine that
makes no progress while others do is found within a few heartbeats (issue 38, point 3):
controlplane/deadlines.py, pure, with the time passed in."""

from __future__ import annotations

from seer.config import EnginesConfig
from seer.controlplane.deadlines import ChunkDeadlines


def deadlines(**kw) -> ChunkDeadlines:
    settings = {"chunk_deadline_min_s": 20.0, "chunk_deadline_factor": 10.0, "chunk_deadline_unmeasured_s": 600.0,
                "heartbeat_interval_s": 1.0, "stall_heartbeats": 3, "stall_factor": 3.0, **kw}
    return ChunkDeadlines(EnginesConfig(**settings))


def measure(d: ChunkDeadlines, engine_id: int, task_id: int, at_s: float, per_token_s: float = 0.01) -> None:
    """Engine ``engine_id`` finishes a 16-token chunk at ``at_s`` taking ``per_token_s`` a token."""
    d.sent(engine_id, task_id, max_tokens=16, now_s=at_s - 16 * per_token_s)
    d.finished(engine_id, task_id, num_tokens=16, elapsed_s=16 * per_token_s, now_s=at_s)


def test_a_chunk_sent_before_anything_was_measured_follows_the_fleet_once_it_is():
    """Engine 1's chunk went out on a fresh daemon (nothing measured: 600 s); once engine 0
    reports its speed, the same chunk's deadline is max(min, factor x budget x the fleet's
    time per token) from its dispatch: 20 s, not 600."""
    d = deadlines()
    d.sent(1, task_id=1, max_tokens=16, now_s=0.0)
    assert d.expired(30.0) == []  # unmeasured: 600 s
    measure(d, 0, task_id=2, at_s=30.5)
    assert d.expired(30.6) == [(1, 1)]  # sent at 0, allowed 20 s by engine 0's speed
    assert d.expired(1000.0) == [] and len(d) == 0


def test_the_deadline_uses_the_engines_own_speed_before_the_fleets():
    """A measured engine is judged by its own time per token; an unmeasured one by the
    slowest measured engine; a long budget gets factor x budget x time per token."""
    d = deadlines()
    measure(d, 0, 1, at_s=1.0, per_token_s=0.5)   # slow engine 0
    measure(d, 1, 2, at_s=1.0, per_token_s=0.01)  # fast engine 1
    assert d.allowance_s(1, 16) == 20.0  # the floor: 10 x 16 x 0.01 = 1.6
    assert d.allowance_s(0, 16) == 80.0  # its own: 10 x 16 x 0.5
    assert d.allowance_s(2, 16) == 80.0  # unmeasured: the slowest measured
    assert d.allowance_s(1, 1000) == 100.0


def test_an_engine_that_answers_nothing_while_others_do_is_stalled_after_a_few_heartbeats():
    """Engine 1 (a black hole) took two chunks at 0 s; engine 0 keeps finishing its own.
    After 3 heartbeats (3 s > 3 x 16 x 0.01 s expected) engine 1 is stalled: both its
    chunks are handed back, once."""
    d = deadlines()
    d.sent(1, task_id=10, max_tokens=16, now_s=0.0)
    d.sent(1, task_id=11, max_tokens=16, now_s=0.1)
    for i in range(1, 5):
        measure(d, 0, task_id=i, at_s=0.5 * i)
    assert d.stalled(2.9) == {}
    assert d.stalled(3.1) == {1: [10, 11]}
    assert d.stalled(10.0) == {} and d.expired(100.0) == []  # handed back once, no longer watched
    assert "never" in d.stall_reason(1, 2, 3.1)


def test_no_engine_is_stalled_while_no_other_engine_answers():
    """Every engine silent (a loaded machine, a paused fleet): nobody is stalled; only the
    deadlines apply."""
    d = deadlines()
    measure(d, 0, 1, at_s=1.0)
    measure(d, 1, 2, at_s=1.0)
    d.sent(0, task_id=3, max_tokens=16, now_s=2.0)
    d.sent(1, task_id=4, max_tokens=16, now_s=2.0)
    assert d.stalled(15.0) == {}
    assert sorted(d.expired(22.5)) == [(0, 3), (1, 4)]


def test_an_engine_that_answers_now_and_then_is_not_stalled():
    """A slow engine that keeps answering (each answer restarts its window) is not stalled,
    however fast the others are."""
    d = deadlines()
    task = 100
    for t in range(0, 20, 2):
        d.sent(1, task_id=task, max_tokens=16, now_s=float(t))
        d.finished(1, task_id=task - 1, num_tokens=16, elapsed_s=2.0, now_s=float(t))
        measure(d, 0, task_id=1000 + t, at_s=t + 1.0)
        assert d.stalled(t + 1.9) == {}
        task += 1


def test_the_stall_window_follows_the_expected_time_of_the_oldest_chunk():
    """A 512-token chunk at 0.05 s a token is expected to take 25.6 s: with stall_factor 3 the
    engine may stay silent 76.8 s before it counts as stalled, although others answer."""
    d = deadlines()
    measure(d, 1, 1, at_s=1.0, per_token_s=0.05)
    d.sent(1, task_id=2, max_tokens=512, now_s=1.0)
    for i in range(10):
        measure(d, 0, task_id=10 + i, at_s=2.0 + 10 * i, per_token_s=0.05)
    assert d.stalled(70.0) == {}
    assert d.stalled(78.0) == {1: [2]}


def test_a_stall_of_the_control_planes_own_loop_counts_against_no_engine():
    """Time the control plane's loop stood still is not held against a chunk or an engine."""
    d = deadlines()
    d.sent(1, task_id=1, max_tokens=16, now_s=0.0)
    measure(d, 0, 2, at_s=0.5)
    d.loop_stalled(5.0)
    assert d.stalled(6.0) == {}  # 1 s of its own, 5 s of the control plane's
    assert d.expired(24.0) == []  # 19 s counted
    assert d.stalled(8.1) == {1: [1]}


def test_a_late_result_of_a_handed_back_chunk_still_measures_and_counts_as_an_answer():
    """After a stall, the engine's late result measures its speed (capped by the time seen)
    and is an answer: the engine is judged afresh from then on."""
    d = deadlines()
    d.sent(1, task_id=1, max_tokens=16, now_s=0.0)
    measure(d, 0, 2, at_s=1.0)
    assert d.stalled(3.5) == {1: [1]}
    d.finished(1, task_id=1, num_tokens=16, elapsed_s=1e9, now_s=8.0)
    assert d.per_token_s[1] == 0.5  # 8 s seen here / 16 tokens
    d.sent(1, task_id=3, max_tokens=16, now_s=8.0)
    measure(d, 0, 4, at_s=9.0)
    assert d.stalled(10.0) == {}
