"""Engines that join after a weights update, and losing every engine under `seerctl rollout`
(simulated engines, real daemons)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

from seer.client import SamplingParams, SeerClient
from tests.daemon_helpers import SEERCTL, Daemon, seerctl, stop_process, wait_for, write_sim_config


def _join(engine_address: str, config: Path, log_file: Path) -> subprocess.Popen:
    return subprocess.Popen([*SEERCTL, "engine", "--join", engine_address, "--config", str(config),
                             "--log-file", str(log_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_an_engine_joining_after_update_weights_gets_the_current_weights_before_work(tmp_path):
    """After update_weights (version 1), a newly joined engine is sent the last update's
    checkpoint before anything else: it shows `updating`, gets no chunk until it has
    loaded version 1, then serves at version 1 -- no stale policy ever runs."""
    config = write_sim_config(tmp_path / "sim.toml", count=1, sim_step_s=0.005)
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    checkpoint = tmp_path / "step-1.safetensors"
    checkpoint.write_bytes(b"weights")
    joined = None
    try:
        with SeerClient(daemon.address, timeout_s=60) as client:
            assert client.update_weights(checkpoint) == 1
            joined = _join(info["engine_address"], config, tmp_path / "joined.log")
            wait_for(lambda: [(e.state, e.weights_version) for e in client.status().engines] ==
                     [("ready", 1), ("ready", 1)], 60, "the joined engine at weights version 1")
            # Enough work that both engines take some.
            result = client.rollout([f"q{i}" for i in range(8)], 4, SamplingParams(max_tokens=64, ignore_eos=True))
            assert result.weights_version == 1
            assert sum(len(g.samples) for g in result.groups) == 32
            assert 1 in {e for g in result.groups for s in g.samples for e in s.engine_ids}
        events = _log(daemon.run_dir / "controlplane.log")
        names = [(e["event"], e.get("engine_id")) for e in events]
        replayed = next(e for e in events if e["event"] == "engine_weights_replayed")
        assert (replayed["engine_id"], replayed["from_weights_version"], replayed["weights_version"],
                replayed["path"]) == (1, 0, 1, str(checkpoint))
        ready_at = names.index(("engine_ready", 1))
        assert names.index(("engine_weights_replayed", 1)) < ready_at
        assert events[ready_at]["weights_version"] == 1
        assert ("chunk_dispatched", 1) not in names[:ready_at]  # no work before the weights
        loaded = [e for e in _log(tmp_path / "joined.log") if e["event"] == "weights_loaded"]
        assert [e["weights_version"] for e in loaded] == [1]
    finally:
        if joined is not None:
            stop_process(joined)
        daemon.stop()


def test_a_newcomer_that_cannot_load_the_current_weights_is_refused(tmp_path):
    """If the last update's checkpoint is gone when an engine joins, the replay fails:
    the engine never gets work, it is refused naming the checkpoint, and it exits."""
    config = write_sim_config(tmp_path / "sim.toml", count=1)
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    checkpoint = tmp_path / "step-1.safetensors"
    checkpoint.write_bytes(b"weights")
    joined = None
    try:
        with SeerClient(daemon.address, timeout_s=60) as client:
            assert client.update_weights(checkpoint) == 1
            checkpoint.unlink()
            joined = _join(info["engine_address"], config, tmp_path / "joined.log")
            assert joined.wait(120) == 3  # refused at its next hello: exits instead of looping
            assert str(checkpoint) in joined.stderr.read()
            assert [(e.engine_id, e.state) for e in client.status().engines] == [(0, "ready"), (1, "lost")]
            result = client.rollout(["q"], 2, SamplingParams(max_tokens=8))
            assert {e for g in result.groups for s in g.samples for e in s.engine_ids} == {0}
        events = _log(daemon.run_dir / "controlplane.log")
        rejected = [e for e in events if e["event"] == "engine_rejected"]
        assert rejected and "weights replay failed" in rejected[0]["reason"]
        assert not [e for e in events if e["event"] == "engine_ready" and e["engine_id"] != 0]
    finally:
        if joined is not None:
            stop_process(joined)
        daemon.stop()


def test_seerctl_rollout_fails_fast_when_every_engine_dies(tmp_path):
    """Both engines are SIGKILLed under a running `seerctl rollout`: the command exits 1
    with the daemon's no_engines error naming the cause, instead of hanging."""
    config = write_sim_config(tmp_path / "sim.toml", count=2, sim_step_s=0.05)  # 400 tokens: 20 s a sample
    daemon = Daemon(tmp_path / "run", config)
    daemon.start()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(4)))
    try:
        with SeerClient(daemon.address, timeout_s=30) as client:
            pids = [e.pid for e in client.status().engines]
            outcome: dict = {}
            thread = threading.Thread(target=lambda: outcome.update(proc=seerctl(
                "rollout", "--run-dir", str(daemon.run_dir), "--prompts", str(prompts), "--group-size", "2",
                "--max-tokens", "400", "--out", str(tmp_path / "out.jsonl"), timeout=300)))
            thread.start()
            wait_for(lambda: bool(client.status().rollouts) or not thread.is_alive(), 60, "the rollout to start")
            assert thread.is_alive(), outcome["proc"].stderr
            for pid in pids:
                os.killpg(pid, signal.SIGKILL)
            thread.join(300)
            proc = outcome["proc"]
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert "every engine is lost" in " ".join(proc.stderr.split())
            assert [e.state for e in client.status().engines] == ["lost", "lost"]
        assert not (tmp_path / "out.jsonl").exists()
    finally:
        daemon.stop()
