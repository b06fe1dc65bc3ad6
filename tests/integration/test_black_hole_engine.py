"""A rollout sharing the daemon with a black-hole engine (it joins, heartbeats and never
finishes a chunk) finishes within 3x its time without it, on a warm daemon and on a fresh
one where nothing was measured yet, with every sample exactly once and the same tokens
(issue 38, point 3). The black hole is found as stalled (no answer for a few heartbeats
while the sim engines answer theirs): its chunks move, it is marked unhealthy.

It used to hold its chunks until their deadline: 60 s at least, 600 s before anything was
measured. Heartbeats every 0.5 s here, so "a few heartbeats" is 1.5 s; the rollout takes
a few seconds alone, so the bound has room on a loaded machine."""

from __future__ import annotations

import json
import time

from seer.client import SamplingParams, SeerClient
from tests.daemon_helpers import Daemon, wait_for, write_sim_config
from tests.integration.test_engine_trust import StuckEngine, caps

PROMPTS = [f"question {i}" for i in range(8)]
SAMPLING = SamplingParams(max_tokens=96, ignore_eos=True, seed=11)


def _config(tmp_path):
    return write_sim_config(tmp_path / "sim.toml", sim_step_s=0.02, heartbeat_interval_s=0.5,
                            heartbeat_timeout_s=30.0, server={"client_timeout_s": 30.0})


def _timed_rollout(client: SeerClient, timeout_s: float | None = None):
    """(seconds, {(group, sample): token ids}); past ``timeout_s`` the client cancels it and
    raises SeerTimeoutError (a black hole holding chunks for a deadline fails the test fast)."""
    t0 = time.monotonic()
    result = client.rollout(PROMPTS, 4, SAMPLING, timeout_s=timeout_s)
    return time.monotonic() - t0, {(g.group_index, s.sample_index): s.token_ids for g in result.groups for s in g.samples}


def _join_black_hole(daemon: Daemon, client: SeerClient, num_engines: int) -> StuckEngine:
    hole = StuckEngine(json.loads((daemon.run_dir / "daemon.json").read_text())["engine_address"], caps())
    hole.start()
    wait_for(lambda: len(client.status().engines) == num_engines, 30, "the black hole to join")
    return hole


def _events(daemon: Daemon, name: str) -> list[dict]:
    lines = (daemon.run_dir / "controlplane.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_a_black_hole_engine_costs_a_rollout_less_than_3x_warm_and_fresh(tmp_path):
    """Baseline on two sim engines; then the same seeded rollout with a black hole joined
    (warm daemon), and on a fresh daemon the black hole joined before anything ran: each
    within 3x the baseline, every sample once, token for token the baseline's."""
    warm = Daemon(tmp_path / "warm", _config(tmp_path))
    warm.start()
    hole = None
    try:
        with SeerClient(warm.address, timeout_s=60) as client:
            alone_s, expected = _timed_rollout(client)
            hole = _join_black_hole(warm, client, 3)
            warm_s, samples = _timed_rollout(client, 3 * alone_s + 10)
            assert hole.num_tasks > 0, "the black hole got no work: the test would prove nothing"
            assert samples == expected
    finally:
        if hole is not None:
            hole.stop.set()
        warm.stop()
    fresh = Daemon(tmp_path / "fresh", _config(tmp_path))
    fresh.start()
    hole = None
    try:
        with SeerClient(fresh.address, timeout_s=60) as client:
            hole = _join_black_hole(fresh, client, 3)
            fresh_s, samples = _timed_rollout(client, 3 * alone_s + 10)
            assert hole.num_tasks > 0
            assert samples == expected
    finally:
        if hole is not None:
            hole.stop.set()
        fresh.stop()
    timings = f"alone {alone_s:.2f} s, warm with a black hole {warm_s:.2f} s, fresh with one {fresh_s:.2f} s"
    print(timings)
    assert warm_s <= 3 * alone_s and fresh_s <= 3 * alone_s, timings
    for daemon in (warm, fresh):
        assert [e["engine_id"] for e in _events(daemon, "engine_stalled")] == [2]
        assert [e["engine_id"] for e in _events(daemon, "engine_unhealthy")] == [2]
        assert not _events(daemon, "rollout_failed")
