"""The pieces of an owned daemon and of `seerctl stop`'s sweep: a process's start time, the
wait for a process that is not our child, the owner check, and the unlinking of the KV pool
segment a daemon killed mid-shutdown left (seer-kv-<daemon pid>-*)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from seer.cli.daemon import DaemonError, lock_held, owner_of, stop
from seer.dataplane.kvpool import SEGMENT_PREFIX
from seer.process import process_start_time, remove_stale_shm, wait_exit
from tests.daemon_helpers import pid_alive, seerctl, wait_for

SHM = Path("/dev/shm")


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _zombie() -> subprocess.Popen:
    """A child that has exited and is not reaped yet."""
    proc = subprocess.Popen(["sleep", "1000"])
    proc.kill()
    wait_for(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z", 30,
             "the child to become a zombie", interval_s=0.02)
    return proc


def test_process_start_time_names_a_running_process_only():
    assert isinstance(process_start_time(os.getpid()), int)
    assert process_start_time(_dead_pid()) is None
    zombie = _zombie()
    try:
        assert process_start_time(zombie.pid) is None  # exited: not running any more
    finally:
        zombie.wait()


def test_owner_of_refuses_an_owner_that_is_gone_or_another_process():
    assert owner_of(os.getpid()) == (os.getpid(), process_start_time(os.getpid()))
    with pytest.raises(DaemonError, match="is not running"):
        owner_of(_dead_pid())
    with pytest.raises(DaemonError, match="is not running"):  # the pid now runs a process started later
        owner_of(os.getpid(), process_start_time(os.getpid()) + 1)


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "poll"])
def test_wait_exit_returns_when_a_process_that_is_not_our_child_is_killed(monkeypatch, pidfd):
    """The owner is any process (here a grandchild-like stranger to the waiter's loop): SIGKILL
    ends the wait, with a pidfd or, where there is none, by polling."""
    if not pidfd:
        def no_pidfd(pid: int, flags: int = 0) -> int:
            raise OSError("no pidfd here")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    owner = subprocess.Popen(["sleep", "1000"])
    start = process_start_time(owner.pid)

    async def go() -> None:
        waiting = asyncio.create_task(wait_exit(owner.pid, start, poll_s=0.05))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the owner lives: the wait goes on
        owner.kill()  # not reaped: the owner is a zombie, which has exited all the same
        await asyncio.wait_for(waiting, 60)

    try:
        asyncio.run(go())
    finally:
        owner.kill()
        owner.wait()


def test_wait_exit_returns_at_once_for_a_pid_now_running_another_process():
    start = process_start_time(os.getpid())

    async def go() -> None:
        await asyncio.wait_for(wait_exit(os.getpid(), start + 1), 30)  # our pid, another start time
        await asyncio.wait_for(wait_exit(_dead_pid(), start), 30)

    asyncio.run(go())


def test_remove_stale_shm_of_one_owner(tmp_path):
    dead, other_dead = _dead_pid(), _dead_pid()
    zombie = _zombie()
    try:
        names = [f"seer-kv-{dead}-a", f"seer-kv-{other_dead}-b", f"seer-kv-{os.getppid()}-c", f"seer-kv-{zombie.pid}-d"]
        for name in names:
            (tmp_path / name).touch()
        assert remove_stale_shm("seer-kv-", tmp_path, pid=dead) == [f"seer-kv-{dead}-a"]
        assert remove_stale_shm("seer-kv-", tmp_path, pid=os.getppid()) == []  # alive: never
        assert remove_stale_shm("seer-kv-", tmp_path, pid=zombie.pid) == [f"seer-kv-{zombie.pid}-d"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:3])
    finally:
        zombie.wait()


def _fake_segment(pid: int) -> Path:
    path = SHM / f"{SEGMENT_PREFIX}{pid}-ownertest{secrets.token_hex(4)}"
    path.write_bytes(b"\0" * 4096)
    return path


def test_stop_that_kills_the_daemon_after_its_timeout_unlinks_its_kv_pool_segment(tmp_path):
    """The reported leak: `seerctl stop --timeout 5` SIGKILLs a daemon still shutting down
    (engines slower than the timeout) before it unlinks its KV pool. The stop now unlinks
    the dead daemon's seer-kv-<pid>-* itself. Here a fake daemon holds the lock, ignores
    SIGTERM (as a slow shutdown) and has a pool segment named like the real one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code = ("import fcntl, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"f = open({str(run_dir / 'daemon.lock')!r}, 'a+')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(1000)\n")
    daemon = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    segment = other = None
    try:
        assert daemon.stdout.readline().strip() == "locked"
        segment = _fake_segment(daemon.pid)
        other = _fake_segment(os.getpid())  # a live daemon's (ours): never touched
        (run_dir / "daemon.json").write_text(json.dumps({"pid": daemon.pid, "state": "ready"}))
        proc = seerctl("stop", "--run-dir", str(run_dir), "--timeout", "2")
        assert proc.returncode == 0 and "stopped" in proc.stdout, proc.stdout + proc.stderr
        wait_for(lambda: daemon.poll() is not None, 30, "the fake daemon to be killed")
        assert not lock_held(run_dir)
        assert not segment.exists()
        assert other.exists()
    finally:
        daemon.kill()
        daemon.wait()
        for path in (segment, other):
            if path is not None:
                path.unlink(missing_ok=True)


def test_stop_of_a_daemon_that_was_already_killed_unlinks_its_kv_pool_segment(tmp_path):
    """A daemon SIGKILLed earlier (the OOM killer, or a stop from before this fix) left
    daemon.json and its segment: a stop finds no daemon, and removes both."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = _dead_pid()
    (run_dir / "daemon.lock").touch()
    (run_dir / "daemon.json").write_text(json.dumps({"pid": dead, "state": "ready"}))
    segment = _fake_segment(dead)
    try:
        assert stop(run_dir, 5.0) is False
        assert not segment.exists() and not (run_dir / "daemon.json").exists()
    finally:
        segment.unlink(missing_ok=True)


def test_stop_leaves_the_segments_of_a_daemon_that_holds_its_lock_alone_until_it_exits(tmp_path):
    """No sweep while the daemon's pid runs: a stop that could not end it (not ours to
    signal) leaves its segment."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = open(run_dir / "daemon.lock", "a+")  # noqa: SIM115 - held for the test
    fcntl.flock(lock, fcntl.LOCK_EX)
    stranger = subprocess.Popen(["sleep", "1000"])  # in daemon.json, but holds no lock file: never signalled
    segment = _fake_segment(stranger.pid)
    try:
        (run_dir / "daemon.json").write_text(json.dumps({"pid": stranger.pid, "state": "ready"}))
        assert stop(run_dir, 0.5) is True
        assert pid_alive(stranger.pid) and segment.exists()
    finally:
        stranger.kill()
        stranger.wait()
        segment.unlink(missing_ok=True)
        lock.close()
