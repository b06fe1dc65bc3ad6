"""The /dev/shm files a SIGKILLed engine tree leaves behind are reclaimed, and nothing else
(issue 14, defect 10): attribution by session, never by name pattern."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from seer.controlplane.shm_reclaim import SHM_DIR, ShmReclaimer
from tests.daemon_helpers import wait_for

# The "engine": a session leader that maps the segments named on its command line and
# whose child creates one more (as vLLM's worker processes do), then both sleep.
TREE = r"""
import mmap, os, subprocess, sys, time
from multiprocessing import shared_memory
tag, attach = sys.argv[1], sys.argv[2:]
child = subprocess.Popen([sys.executable, "-c",
    "import sys, time; from multiprocessing import shared_memory as s; "
    "m = s.SharedMemory(name=sys.argv[1], create=True, size=8192); print('ok', flush=True); time.sleep(1000)",
    f"psm_{tag}_child"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ok"
fd = os.open(f"/dev/shm/sem.mp-{tag}", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 32)
sem = mmap.mmap(fd, 32)
held = [shared_memory.SharedMemory(name=n) for n in attach]
print("ready", flush=True)
time.sleep(1000)
"""


@pytest.fixture
def tag():
    tag = f"hrobust{uuid.uuid4().hex[:8]}"
    yield tag
    for path in SHM_DIR.glob(f"*{tag}*"):
        path.unlink(missing_ok=True)


def _segment(name: str) -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(name=name, create=True, size=4096)


def _spawn_tree(tag: str, attach: list[str]) -> subprocess.Popen:
    tree = subprocess.Popen([sys.executable, "-c", TREE, tag, *attach], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert tree.stdout.readline().strip() == "ready"
    return tree


def _kill_tree(reclaimer: ShmReclaimer, tree: subprocess.Popen) -> None:
    os.killpg(tree.pid, signal.SIGKILL)  # the whole tree, its resource tracker included
    tree.wait()
    wait_for(lambda: not reclaimer.session_alive(tree.pid), 10, "the killed tree to be gone")


def test_a_sigkilled_trees_segments_are_reclaimed_and_shared_ones_are_kept(tag):
    """After kill -9 of the whole tree, its own psm_ segment and sem.mp- file are unlinked;
    a segment that existed before the spawn and one a live process still maps are kept."""
    before = _segment(f"{tag}_before")  # e.g. the control plane's KV pool
    reclaimer = ShmReclaimer()
    baseline = reclaimer.names()  # taken before the spawn, as the supervisor does
    shared = _segment(f"{tag}_shared")  # created after the spawn, e.g. a draft-server ring
    tree = _spawn_tree(tag, [before.name, shared.name])
    try:
        reclaimer.watch(tree.pid, engine_id=3, baseline=baseline)
        reclaimer.scan()
        assert reclaimer.session_alive(tree.pid)
        _kill_tree(reclaimer, tree)
        leaked = {f"psm_{tag}_child", f"sem.mp-{tag}"}
        assert leaked <= reclaimer.names(), "the kill did not leak: the test would prove nothing"
        reclaimed = reclaimer.reclaim(tree.pid)
        assert set(reclaimed) == leaked
        names = reclaimer.names()
        assert not leaked & names
        assert {before.name, shared.name} <= names
    finally:
        if tree.poll() is None:
            os.killpg(tree.pid, signal.SIGKILL)
        for segment in (before, shared):
            segment.close()
            segment.unlink()


def test_a_session_never_scanned_reclaims_nothing(tag):
    """Without a scan while it lived, nothing is attributed to a tree: nothing is unlinked."""
    reclaimer = ShmReclaimer()
    baseline = reclaimer.names()
    tree = _spawn_tree(tag, [])
    try:
        reclaimer.watch(tree.pid, engine_id=0, baseline=baseline)
        _kill_tree(reclaimer, tree)
        assert reclaimer.reclaim(tree.pid) == []
        assert f"psm_{tag}_child" in reclaimer.names()
    finally:
        if tree.poll() is None:
            os.killpg(tree.pid, signal.SIGKILL)


def test_reclaim_reads_a_fake_proc_tree(tmp_path):
    """Maps and fds under /dev/shm are attributed by session id; zombies count as gone."""
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (shm / "psm_a").write_bytes(b"x" * 10)
    (shm / "psm_b").write_bytes(b"y")

    def process(pid: int, session: int, state: str = "S", maps: str = "", fds: dict | None = None) -> None:
        base = proc / str(pid)
        (base / "fd").mkdir(parents=True)
        (base / "stat").write_text(f"{pid} (py thon) {state} 1 {session} {session} 0 0")
        (base / "maps").write_text(maps)
        for fd, target in (fds or {}).items():
            os.symlink(target, base / "fd" / str(fd))

    process(100, 100, maps=f"7f00-7f10 rw-s 00000000 00:1a 5 {shm}/psm_a\n")
    process(101, 100, fds={3: f"{shm}/psm_b"})
    reclaimer = ShmReclaimer(shm_dir=shm, proc_dir=proc)
    reclaimer.watch(100, engine_id=1, baseline=frozenset())
    reclaimer.scan()
    for pid in (100, 101):
        (proc / str(pid) / "stat").write_text(f"{pid} (py thon) Z 1 100 100 0 0")
    assert not reclaimer.session_alive(100)
    assert sorted(reclaimer.reclaim(100)) == ["psm_a", "psm_b"]
    assert list(shm.iterdir()) == []


# An "engine" whose worker creates a multiprocessing lock the way vLLM's start-up does
# (spawn context: a named POSIX semaphore, /dev/shm/sem.mp-*), then sleeps.
SEMAPHORE_TREE = r"""
import multiprocessing, sys, time
lock = multiprocessing.get_context("spawn").Lock()
print(lock._semlock.name, flush=True)
time.sleep(1000)
"""


def test_a_sigkilled_trees_multiprocessing_semaphore_is_reclaimed():
    """glibc maps a new semaphore under a temporary name it unlinks (``sem.XXXXXX
    (deleted)`` in /proc/PID/maps) before linking it as ``sem.mp-*``: the file is found
    by its inode, and unlinked after kill -9 of the tree (issue 38: it outlived `seerctl stop`)."""
    reclaimer = ShmReclaimer()
    baseline = reclaimer.names()
    tree = subprocess.Popen([sys.executable, "-c", SEMAPHORE_TREE], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    name = "sem." + tree.stdout.readline().strip().lstrip("/")
    try:
        assert name.startswith("sem.mp-") and name in reclaimer.names()
        reclaimer.watch(tree.pid, engine_id=0, baseline=baseline)
        reclaimer.scan()
        _kill_tree(reclaimer, tree)
        assert name in reclaimer.names(), "the kill did not leak: the test would prove nothing"
        assert reclaimer.reclaim(tree.pid) == [name]
        assert name not in reclaimer.names()
    finally:
        if tree.poll() is None:
            os.killpg(tree.pid, signal.SIGKILL)
        (SHM_DIR / name).unlink(missing_ok=True)


def test_files_of_other_mount_namespaces_do_not_count_as_in_use(tmp_path):
    """A live process elsewhere mapping a /dev/shm file of the same name, or with the same
    inode number on another tmpfs (another mount namespace's /dev/shm: other engineers'
    daemons, containers), does not keep a dead engine's file: use is judged by device and
    inode of the very file."""
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (shm / "psm_a").write_bytes(b"x")
    (shm / "sem.mp-b").write_bytes(b"y")
    ino_b = (shm / "sem.mp-b").stat().st_ino

    def process(pid: int, session: int, maps: str, state: str = "S") -> None:
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (python) {state} 1 {session} {session} 0 0")
        (proc / str(pid) / "maps").write_text(maps)

    dev = (shm / "psm_a").stat().st_dev
    here = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    process(100, 100, f"7f00-7f10 rw-s 00000000 {here} {(shm / 'psm_a').stat().st_ino} {shm}/psm_a\n"
                      f"7f10-7f11 rw-s 00000000 {here} {ino_b} {shm}/sem.Xy12Ab (deleted)\n")
    # Another namespace: same name as ours, and another file with our semaphore's inode number.
    process(200, 200, f"7f00-7f10 rw-s 00000000 ff:fe 77 {shm}/psm_a\n"
                      f"7f10-7f11 rw-s 00000000 ff:fe {ino_b} {shm}/sem.other\n")
    reclaimer = ShmReclaimer(shm_dir=shm, proc_dir=proc)
    reclaimer.watch(100, engine_id=1, baseline=frozenset())
    reclaimer.scan()
    (proc / "100" / "stat").write_text("100 (python) Z 1 100 100 0 0")
    assert sorted(reclaimer.reclaim(100)) == ["psm_a", "sem.mp-b"]
