"""Stalls longer than ``engines.heartbeat_timeout_s`` (a CPU hog on the same cores,
swapping, a long collection; here SIGSTOP), of the daemon or of one engine.

* The daemon stands still: a spawned engine whose parent, the daemon, still runs waits for
  it instead of exiting (``engines/worker.py``), and the control plane counts its own stall
  against no engine (``Registry.loop_stalled``). A rollout in flight across the stall
  completes with every sample once, on the same engine processes. (A real replay once
  failed with ``no_engines`` after a 29.7 s stall of the daemon's loop: both engines had
  exited.)
* One engine stands still: the control plane declares it lost and gives its work to the
  other; when it wakes, its first message gets ``HelloRejected(say_hello_again=True)``,
  and it registers again, empty, as the same process (it used to sit unused until stop)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from seer.client import SamplingParams, SeerClient
from tests.daemon_helpers import Daemon, pid_alive, wait_for, write_sim_config

HEARTBEAT_S = 3.0  # short, so the stalls are short; a loaded machine can still starve an engine this long
STALL_S = 3 * HEARTBEAT_S


def _events(path, name: str) -> list[dict]:
    if not path.exists():
        return []
    return [e for line in path.read_text().splitlines() if line.startswith("{")
            and (e := json.loads(line)).get("event") == name]


@pytest.fixture
def daemon(tmp_path):
    # 16 prompts x 4 samples x 64 tokens at 20 ms per step: a rollout of a few seconds.
    config = write_sim_config(tmp_path / "sim.toml", heartbeat_timeout_s=HEARTBEAT_S, sim_step_s=0.02,
                              server={"client_timeout_s": 120.0})
    daemon = Daemon(tmp_path / "run", config)
    daemon.info = daemon.start()
    yield daemon
    daemon.stop()


def _rollout_across_a_stall(daemon: Daemon, client: SeerClient, pid: int) -> None:
    """Start a rollout, SIGSTOP ``pid`` for STALL_S once it runs, and check that the rollout
    then finishes with every sample, each of its full length."""
    result: dict = {}

    def roll() -> None:
        with SeerClient(daemon.address, timeout_s=120) as roller:
            result["rollout"] = roller.rollout([f"prompt {i}" for i in range(16)], 4,
                                               SamplingParams(max_tokens=64, ignore_eos=True))

    thread = threading.Thread(target=roll)
    thread.start()
    wait_for(lambda: bool(client.status().rollouts), 30, "the rollout to start")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(120)
    assert not thread.is_alive(), "the rollout did not finish after the stall"
    samples = [s for g in result["rollout"].groups for s in g.samples]
    assert len(samples) == 64 and all(len(s.token_ids) == 64 for s in samples)


def _wait_ready_as(client: SeerClient, engines: dict[int, int], what: str) -> None:
    """Every engine ``ready`` as the process it was (``engines``: id -> pid)."""
    wait_for(lambda: {e.engine_id: (e.pid, e.state) for e in client.status().engines}
             == {engine_id: (pid, "ready") for engine_id, pid in engines.items()}, 30, what)


def test_engines_outlive_a_stall_of_the_daemon_and_the_rollout_completes(daemon):
    with SeerClient(daemon.address, timeout_s=120) as client:
        engines = {e.engine_id: e.pid for e in client.status().engines}
        assert len(engines) == 2 and all(pid_alive(pid) for pid in engines.values())
        _rollout_across_a_stall(daemon, client, daemon.info["pid"])  # the whole daemon stands still
        _wait_ready_as(client, engines, "both engines ready as the same processes")
    daemon.stop()
    for engine_id in engines:
        log = daemon.run_dir / f"engine-{engine_id}.log"
        assert _events(log, "control_plane_silent"), f"engine {engine_id} never noticed the stall"
        assert _events(log, "control_plane_back")
        assert not _events(log, "control_plane_lost")


def test_an_engine_that_stalls_is_declared_lost_then_comes_back(daemon):
    with SeerClient(daemon.address, timeout_s=120) as client:
        engines = {e.engine_id: e.pid for e in client.status().engines}
        _rollout_across_a_stall(daemon, client, engines[1])
        _wait_ready_as(client, engines, "engine 1 to be ready again as the same process")
        again = client.rollout([f"again {i}" for i in range(8)], 4, SamplingParams(max_tokens=8))
        assert sum(len(g.samples) for g in again.groups) == 32
    daemon.stop()
    control = daemon.run_dir / "controlplane.log"
    # (On a loaded machine engine 0 may be starved past the timeout too, and come back the same way.)
    assert 1 in [e["engine_id"] for e in _events(control, "engine_lost")]
    assert 1 in [e["engine_id"] for e in _events(control, "lost_engine_heard")]
    assert [e["engine_id"] for e in _events(control, "engine_ready")].count(1) >= 2
    assert _events(daemon.run_dir / "engine-1.log", "engine_rejoining")
