"""Engines joining a running daemon (`seerctl engine --join`) and control-plane restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from seer.client import SamplingParams, SeerClient, SeerError, SeerServiceError
from tests.daemon_helpers import SEERCTL, Daemon, pid_alive, stop_process, wait_for, write_sim_config



def _join(engine_address: str, config: Path, log_file: Path) -> subprocess.Popen:
    return subprocess.Popen([*SEERCTL, "engine", "--join", engine_address, "--config", str(config),
                             "--log-file", str(log_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _states(client: SeerClient) -> dict[int, str]:
    return {e.engine_id: e.state for e in client.status().engines}


def _events(log_file: Path, name: str) -> list[dict]:
    out = []
    for line in log_file.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == name:
            out.append(event)
    return out


def test_a_replacement_engine_joins_and_the_rollout_completes(tmp_path):
    """One spawned engine is SIGKILLed mid-rollout; a replacement started with
    `seerctl engine --join` gets a fresh id, takes the work, and every sample comes back
    exactly once with the same tokens as an undisturbed run."""
    config = write_sim_config(tmp_path / "sim.toml", count=1, sim_step_s=0.01, replacement_wait_s=120.0)
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    joined: subprocess.Popen | None = None
    prompts = [f"q{i}" for i in range(6)]
    sampling = SamplingParams(max_tokens=300, ignore_eos=True, seed=5)
    try:
        with SeerClient(daemon.address, timeout_s=120) as client:
            victim = client.status().engines[0].pid
            outcome: dict = {}

            def run() -> None:
                with SeerClient(daemon.address, timeout_s=120) as c:
                    outcome["result"] = c.rollout(prompts, 3, sampling)

            thread = threading.Thread(target=run)
            thread.start()
            # 300 tokens x 10 ms = 3 s of work per sample: kill once it is under way.
            wait_for(lambda: sum(e.load.num_running for e in client.status().engines) > 0, 30, "work to start")
            os.killpg(victim, signal.SIGKILL)
            wait_for(lambda: _states(client) == {0: "lost"}, 30, "the engine to be declared lost")
            assert client.status().rollouts, "the rollout waits for a replacement instead of failing"
            joined = _join(info["engine_address"], config, tmp_path / "joined.log")
            thread.join(180)
            assert not thread.is_alive()
            result = outcome["result"]
            assert _states(client) == {0: "lost", 1: "ready"}
            assert [g.group_index for g in result.groups] == list(range(6))
            assert all([s.sample_index for s in g.samples] == [0, 1, 2] for g in result.groups)
            assert all(len(s.token_ids) == 300 and s.engine_ids[-1] == 1 for g in result.groups for s in g.samples)
            again = client.rollout(prompts, 3, sampling)  # undisturbed, all on the joined engine
            assert [[s.token_ids for s in g.samples] for g in result.groups] == \
                   [[s.token_ids for s in g.samples] for g in again.groups]
        log = daemon.run_dir / "controlplane.log"
        ready = _events(log, "engine_ready")
        assert [(e["engine_id"], e["joined"]) for e in ready] == [(0, False), (1, True)]
        assert _events(log, "waiting_for_engines")
    finally:
        if joined is not None:
            stop_process(joined)
        daemon.stop()


def test_without_replacement_wait_losing_every_engine_still_fails_fast(tmp_path):
    """replacement_wait_s bounds the wait: when no engine joins in time the rollout fails
    with no_engines, naming the setting."""
    config = write_sim_config(tmp_path / "sim.toml", count=1, sim_step_s=0.02, replacement_wait_s=2.0)
    daemon = Daemon(tmp_path / "run", config)
    daemon.start()
    try:
        with SeerClient(daemon.address, timeout_s=60) as client:
            pid = client.status().engines[0].pid
            threading.Thread(target=lambda: (time.sleep(0.5), os.killpg(pid, signal.SIGKILL))).start()
            with pytest.raises(SeerServiceError) as info:
                client.rollout(["q"] * 2, 2, SamplingParams(max_tokens=400, ignore_eos=True))
            assert info.value.code == "no_engines" and "replacement_wait_s" in info.value.message
    finally:
        daemon.stop()


def test_a_joined_engine_reregisters_after_control_plane_restarts(tmp_path):
    """The control plane is SIGKILLed mid-rollout: the client gets a clear error, the
    daemon restarts on the same run dir, the joined engine registers again on its own, and
    the retried rollout completes on both engines. A graceful stop/start does the same."""
    config = write_sim_config(tmp_path / "sim.toml", count=1, sim_step_s=0.01)
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    joined = _join(info["engine_address"], config, tmp_path / "joined.log")
    prompts = [f"q{i}" for i in range(8)]
    sampling = SamplingParams(max_tokens=200, ignore_eos=True, seed=9)
    try:
        with SeerClient(daemon.address, timeout_s=30) as client:
            wait_for(lambda: _states(client) == {0: "ready", 1: "ready"}, 60, "the joined engine")
        outcome: dict = {}

        def run() -> None:
            try:
                with SeerClient(info["client_address"], timeout_s=5) as c:
                    outcome["result"] = c.rollout(prompts, 2, sampling)
            except SeerError as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)
        os.kill(info["pid"], signal.SIGKILL)  # a crash: no drain, no goodbye
        thread.join(60)
        assert "result" not in outcome
        assert "did not answer" in str(outcome["error"])  # SeerTimeoutError, with what to check
        wait_for(lambda: not pid_alive(info["pid"]), 15, "the old control plane to die")
        daemon.start()
        with SeerClient(daemon.address, timeout_s=30) as client:
            wait_for(lambda: _states(client) == {0: "ready", 1: "ready"}, 60, "the joined engine to re-register")
            result = client.rollout(prompts, 2, sampling)  # the retry
            assert sum(len(g.samples) for g in result.groups) == 16
            assert {s.engine_ids[0] for g in result.groups for s in g.samples} == {0, 1}
        daemon.stop()  # graceful: the joined engine is told to shut down, and waits for the next one
        daemon.start()
        with SeerClient(daemon.address, timeout_s=30) as client:
            wait_for(lambda: _states(client) == {0: "ready", 1: "ready"}, 60, "the joined engine to re-register")
            assert len(client.rollout(prompts[:2], 2, sampling).groups) == 2
        rejoins = _events(tmp_path / "joined.log", "engine_rejoining")
        assert len(rejoins) == 2 and joined.poll() is None
    finally:
        stop_process(joined)
        daemon.stop()
    assert joined.returncode == 0  # SIGTERM stops a joined engine cleanly
