"""`seerctl stop` decides liveness by the run dir's daemon.lock, never by the pid alone."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

from seer.cli.daemon import lock_held, running_daemon, stop
from tests.daemon_helpers import pid_alive, seerctl


def _write_info(run_dir: Path, pid: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "daemon.json").write_text(json.dumps({"pid": pid, "state": "ready", "run_dir": str(run_dir)}))


def test_stop_never_signals_a_stranger_whose_pid_is_in_a_stale_daemon_json(tmp_path):
    """A daemon.json naming an unrelated live process (no lock held) is stale: seerctl stop
    says no daemon runs, removes the file, and the process lives on."""
    stranger = subprocess.Popen(["sleep", "1000"])
    try:
        run_dir = tmp_path / "run"
        _write_info(run_dir, stranger.pid)
        (run_dir / "daemon.lock").touch()  # left behind by a SIGKILLed daemon
        proc = seerctl("stop", "--run-dir", str(run_dir), "--timeout", "5")
        assert proc.returncode == 0 and "no Seer daemon running" in proc.stdout
        assert stranger.poll() is None and pid_alive(stranger.pid)
        assert not (run_dir / "daemon.json").exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_status_treats_a_live_pid_without_the_lock_as_no_daemon(tmp_path):
    """running_daemon answers None for a daemon.json whose pid is alive but holds no lock."""
    run_dir = tmp_path / "run"
    _write_info(run_dir, 1)  # pid 1 is always alive
    assert running_daemon(run_dir) is None
    assert not lock_held(run_dir)


def test_stop_terminates_the_process_that_holds_the_lock(tmp_path):
    """A process holding daemon.lock whose pid is in daemon.json is the daemon: stop
    (no client address to ask politely) SIGTERMs it and returns once the lock is free."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder_code = ("import fcntl, sys, time\n"
                   f"f = open({str(run_dir / 'daemon.lock')!r}, 'a+')\n"
                   "fcntl.flock(f, fcntl.LOCK_EX)\n"
                   "print('locked', flush=True)\n"
                   "time.sleep(1000)\n")
    holder = subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        _write_info(run_dir, holder.pid)
        assert lock_held(run_dir) and running_daemon(run_dir) is not None
        assert stop(run_dir, 10.0) is True
        holder.wait(10)  # stop reaped it already (it is our child): only "gone" is observable
        assert not pid_alive(holder.pid)
        assert not lock_held(run_dir)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_stop_does_not_signal_a_pid_that_lacks_the_lock_file_while_another_holds_it(tmp_path):
    """With the lock held by one process and daemon.json naming another, stop signals
    neither stranger: the named pid does not have daemon.lock open."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stranger = subprocess.Popen(["sleep", "1000"])
    lock = open(run_dir / "daemon.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _write_info(run_dir, stranger.pid)
        assert stop(run_dir, 1.0) is True
        assert stranger.poll() is None
    finally:
        lock.close()
        stranger.kill()
        stranger.wait()
