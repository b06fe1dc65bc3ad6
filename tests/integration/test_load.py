"""The control plane under load (simulated engines): 10,000-sample rollouts, 100 concurrent
clients, and memory that does not grow from one rollout to the next.

Two views of memory: the daemon process's RSS (what an operator sees; allocator noise
included, so the margin is wide) and, in-process, the bytes the control plane's own
modules still hold after each rollout (tracemalloc; exact, so the margin is tight).
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from benchmarks.load import big_rollout, error_events, run_load, write_config
from tests.daemon_helpers import Daemon, in_process_plane, plane_logging

# RSS after the 5th large rollout may exceed RSS after the 1st by at most this factor.
# Measured 1.27-1.60x on this shared 2-core machine although the Python objects the
# control plane holds return to the same size after every rollout (tracemalloc, below):
# the allocators keep freed pages. So this is a coarse guard against gross growth; the
# exact check is the tracemalloc test.
RSS_GROWTH_FACTOR = 2.0


@pytest.mark.timeout(900)
def test_ten_thousand_samples_and_a_hundred_concurrent_clients(tmp_path):
    """A 10,000-sample rollout, then 100 clients each with a rollout and a status call in
    flight at once, then 4 more 10,000-sample rollouts: every sample exactly once, no
    failed call, no error in the daemon log, and RSS does not keep growing."""
    config = write_config(tmp_path / "load.toml", engines=2, step_s=0.002, policy="group", mean_output_tokens=16)
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    try:
        rounds = run_load(info["client_address"], int(info["pid"]), num_requests=10_000, group_size=8,
                          max_tokens=32, num_clients=100, prompts_per_client=4, num_repeats=5, timeout_s=600)
        errors = error_events(daemon.run_dir / "controlplane.log")
    finally:
        daemon.stop()
    for r in rounds:
        print(f"{r.name}: {r.num_samples} samples in {r.wall_s:.1f} s, RSS {r.rss_kib / 1024:.1f} MiB, "
              f"peak {r.hwm_kib / 1024:.1f} MiB")
    assert [p for r in rounds for p in r.problems] == []
    assert errors == []
    assert [r.num_samples for r in rounds] == [10_000, 100 * 4 * 8, 10_000, 10_000, 10_000, 10_000]
    large = [r for r in rounds if r.name.startswith("rollout")]
    assert large[-1].rss_kib <= RSS_GROWTH_FACTOR * large[0].rss_kib, [r.rss_kib for r in large]


def _held_by_control_plane(snapshot: tracemalloc.Snapshot) -> int:
    traces = snapshot.filter_traces([tracemalloc.Filter(True, "*/controlplane/*")])
    return sum(stat.size for stat in traces.statistics("filename"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy", ["group", "divided", "context"])
def test_the_control_plane_keeps_nothing_of_finished_rollouts(tmp_path, policy):
    """In-process control plane, real sim engine processes: once three 2,000-sample
    rollouts have warmed caches and grown dicts, two more leave < 64 KiB more in memory
    allocated by controlplane/ modules. A rollout's state is MiBs, and per-group state
    kept forever (the chunked policies did, until 7f1b854) is ~75 KB per rollout."""
    from seer.config import load_config

    config = load_config(write_config(tmp_path / "c.toml", engines=2, step_s=0.001, policy=policy,
                                      mean_output_tokens=8))

    async def go() -> tuple[list[int], int]:
        held: list[int] = []
        peak = 0
        async with in_process_plane(config, tmp_path) as (plane, client_address):
            for k in range(5):
                tracemalloc.reset_peak()
                result, problems = await big_rollout(client_address, 250, 8, 16, f"r{k}", 300)
                assert problems == []
                # The client has every result; the server drops the engines' in-flight logs,
                # which still reach the rollout, at its next tick after the rollout ended.
                for _ in range(6000):
                    if result.rollout_id not in plane.rollout_ends:
                        break
                    await asyncio.sleep(0.01)
                assert result.rollout_id not in plane.rollout_ends, "the server never saw the rollout end"
                peak = max(peak, tracemalloc.get_traced_memory()[1])
                gc.collect()
                held.append(_held_by_control_plane(tracemalloc.take_snapshot()))
        return held, peak

    tracemalloc.start()
    try:
        with plane_logging(tmp_path):
            held, peak = asyncio.run(go())
    finally:
        tracemalloc.stop()
    print(f"{policy}: bytes held by controlplane/ after each rollout {held}; traced peak {peak}")
    assert peak > 1024 * 1024  # a rollout's state is MiBs: the measurement sees it
    assert held[-1] - held[2] < 64 * 1024, held
