"""A daemon started for one process ends with it: `seerctl start --owner-pid PID` and the
embedded daemon of `seerctl rollout` stop (engines, run dir lock, shared memory) when their
owner is SIGKILLed. A daemon of a plain `seerctl start` outlives the command that started it.

Sim engines create no KV pool (no block geometry), so these daemons make no /dev/shm file of
their own: the checks are that none named after the daemon or an engine is left (the pool's
segment would be seer-kv-<daemon pid>-*), and tests/unit/test_owner_watch.py covers the
sweep of a pool segment a killed daemon left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from seer.cli.daemon import lock_held, read_info
from seer.client import SeerClient
from seer.process import process_start_time
from tests.daemon_helpers import SEERCTL, Daemon, pid_alive, seerctl, shm_entries, wait_for, write_sim_config

# Generous: a loaded 2-core machine starts sim engines in seconds, stops them within 30 s.
START_S = 180
GONE_S = 90


def _slow_config(path: Path) -> Path:
    # 400 tokens x 50 ms = 20 s per sample, no early EOS: a rollout still runs when its owner is killed.
    return write_sim_config(path, sim_step_s=0.05, sim_mean_output_tokens=100000)


def _engine_pids(info: dict) -> list[int]:
    with SeerClient(info["client_address"], timeout_s=30) as client:
        return [e.pid for e in client.status().engines]


def _ours(name: str, pids: list[int]) -> bool:
    """A /dev/shm name of Seer's that carries one of these pids (seer-kv-<pid>-..., seer-draft-<pid>-...)."""
    return name.startswith("seer-") and any(str(p) in name.split("-") for p in pids)


def _assert_nothing_left(run_dir: Path, daemon_pid: int, engine_pids: list[int], shm_before: set[str]) -> None:
    pids = [daemon_pid, *engine_pids]
    wait_for(lambda: not any(pid_alive(p) for p in pids), GONE_S, "the daemon and its engines to exit")
    wait_for(lambda: not lock_held(run_dir), 30, "the run dir's lock to be released")
    assert not (run_dir / "daemon.json").exists()  # an orderly stop, not a kill
    assert not (run_dir / "client.sock").exists() and not (run_dir / "engines.sock").exists()
    assert not [n for n in shm_entries() - shm_before if _ours(n, pids)]
    log = (run_dir / "controlplane.log").read_text()
    assert '"owner_exited"' in log and '"control_plane_stopped"' in log


def test_a_daemon_started_with_an_owner_stops_when_the_owner_is_sigkilled(tmp_path):
    run_dir = tmp_path / "run"
    config = write_sim_config(tmp_path / "sim.toml")
    shm_before = shm_entries()
    # The owner starts its daemon as examples/trl_grpo.py --start-daemon does, then waits.
    script = ("import os, subprocess, sys, time\n"
              f"subprocess.run({SEERCTL!r} + ['start', '--config', {str(config)!r}, '--run-dir', {str(run_dir)!r}, "
              "'--owner-pid', str(os.getpid())], check=True, capture_output=True)\n"
              "print('started', flush=True)\n"
              "time.sleep(1000)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "started"
        info = read_info(run_dir)
        assert info is not None and info["owner_pid"] == owner.pid and info["state"] == "ready"
        status = seerctl("status", "--run-dir", str(run_dir))
        assert status.returncode == 0 and f"owned by process {owner.pid}" in status.stdout
        engine_pids = _engine_pids(info)
        assert len(engine_pids) == 2
        owner.send_signal(signal.SIGKILL)  # not reaped until the end: a zombie owner has exited too
        _assert_nothing_left(run_dir, info["pid"], engine_pids, shm_before)
    finally:
        owner.kill()
        owner.wait()
        seerctl("stop", "--run-dir", str(run_dir), "--timeout", "10")


def test_seerctl_rollout_killed_mid_rollout_takes_its_embedded_daemon_with_it(tmp_path):
    run_dir = tmp_path / "run"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"question {i}"}) + "\n" for i in range(4)))
    shm_before = shm_entries()
    rollout = subprocess.Popen([*SEERCTL, "rollout", "--config", str(_slow_config(tmp_path / "sim.toml")),
                                "--run-dir", str(run_dir), "--prompts", str(prompts), "--group-size", "2",
                                "--max-tokens", "400", "--out", str(tmp_path / "out.jsonl")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (read_info(run_dir) or {}).get("state") == "ready", START_S, "the embedded daemon to be ready")
        info = read_info(run_dir)
        assert info["owner_pid"] == rollout.pid
        with SeerClient(info["client_address"], timeout_s=30) as client:
            wait_for(lambda: bool(client.status().rollouts), 60, "the rollout to run")
            engine_pids = [e.pid for e in client.status().engines]
        rollout.send_signal(signal.SIGKILL)
        rollout.wait()
        _assert_nothing_left(run_dir, info["pid"], engine_pids, shm_before)
        assert not (tmp_path / "out.jsonl").exists()
    finally:
        rollout.kill()
        rollout.wait()
        seerctl("stop", "--run-dir", str(run_dir), "--timeout", "10")


def test_a_plain_start_outlives_the_command_that_started_it(tmp_path):
    daemon = Daemon(tmp_path / "run", write_sim_config(tmp_path / "sim.toml"))
    info = daemon.start()  # `seerctl start` has exited by now
    try:
        assert "owner_pid" not in info
        status = seerctl("status", "--run-dir", str(daemon.run_dir))
        assert status.returncode == 0 and "owned by" not in status.stdout
        assert pid_alive(info["pid"]) and lock_held(daemon.run_dir)
    finally:
        daemon.stop()
    wait_for(lambda: not pid_alive(info["pid"]), GONE_S, "the daemon to exit")


def test_an_owner_that_is_gone_starts_nothing(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    run_dir = tmp_path / "run"
    proc = seerctl("start", "--config", str(write_sim_config(tmp_path / "sim.toml")), "--run-dir", str(run_dir),
                   "--owner-pid", str(gone.pid))
    assert proc.returncode == 1 and f"owner process {gone.pid}" in " ".join(proc.stderr.split())
    assert read_info(run_dir) is None and not lock_held(run_dir)
    assert seerctl("start", "--owner-pid", "0", "--run-dir", str(run_dir)).returncode == 2
    # The daemon itself checks too: its owner's pid now runs a process started at another time.
    reused = seerctl("start", "--foreground", "--config", str(tmp_path / "sim.toml"), "--run-dir", str(run_dir),
                     "--owner-pid", str(os.getpid()), "--owner-start-time", str(process_start_time(os.getpid()) + 1))
    assert reused.returncode == 1 and "is not running" in (run_dir / "daemon.error").read_text()
    assert read_info(run_dir) is None and not lock_held(run_dir)
