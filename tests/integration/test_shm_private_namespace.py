"""Nothing Seer or its engines create stays in /dev/shm after `seerctl stop`, even after
every engine was killed with kill -9 (issue 38, point 4), multiprocessing semaphores
included (``sem.mp-*``: vLLM's engines create them at start-up, and glibc maps them under a
temporary name, so they were never attributed to the engine).

The daemon runs in a private mount namespace (``unshare -m``) with a fresh tmpfs on
/dev/shm, so "nothing left" is checked exactly (an empty /dev/shm), without other programs'
files on this machine in the way. A ``sitecustomize`` makes each simulated engine create
what vLLM's processes create: a multiprocessing lock (a ``sem.mp-*`` semaphore) in the
worker, and in engine 0 a child holding a ``psm_*`` segment and another lock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_helpers import write_sim_config

SITECUSTOMIZE = r'''
import os, subprocess, sys
_argv = getattr(sys, "orig_argv", [])
if os.environ.get("SEER_TEST_SHM_PRIVATE") and "seer.engines.worker" in _argv:
    import multiprocessing
    _seer_test_lock = multiprocessing.get_context("spawn").Lock()  # /dev/shm/sem.mp-*, held for the process life
    if _argv[_argv.index("--engine-id") + 1] == "0":
        subprocess.Popen([sys.executable, "-c",
            "import multiprocessing, time; from multiprocessing import shared_memory as s; "
            "m = s.SharedMemory(name='psm_seer_test', create=True, size=65536); "
            "l = multiprocessing.get_context('spawn').Lock(); time.sleep(1000)"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
'''

# Runs inside the namespace: start a daemon, wait for the engines' files, kill -9 every
# engine's process group, stop the daemon, report what /dev/shm holds at each step.
SCENARIO = r'''
import json, os, signal, subprocess, sys, time
config, run_dir = sys.argv[1], sys.argv[2]
seerctl = [sys.executable, "-m", "seer.cli.main"]
def shm():
    return sorted(os.listdir("/dev/shm"))
report = {"before": shm()}
start = subprocess.run([*seerctl, "start", "--config", config, "--run-dir", run_dir], capture_output=True, text=True)
report["start"] = start.returncode, start.stdout + start.stderr
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # two locks of the workers, the child's lock and segment
    names = shm()
    if sum(n.startswith("sem.mp-") for n in names) >= 3 and "psm_seer_test" in names:
        break
    time.sleep(0.2)
log = os.path.join(run_dir, "controlplane.log")
while time.monotonic() < deadline and "engine_shm_recorded" not in open(log).read():
    time.sleep(0.2)  # the supervisor's watcher scanned the engines at least once
time.sleep(2.5)  # and once more, after every file above existed (SHM_SCAN_INTERVAL_S = 2)
report["running"] = shm()
status = subprocess.run([*seerctl, "status", "--json", "--run-dir", run_dir], capture_output=True, text=True)
for engine in json.loads(status.stdout)["engines"]:
    os.killpg(engine["pid"], signal.SIGKILL)
report["killed"] = shm()
stop = subprocess.run([*seerctl, "stop", "--run-dir", run_dir], capture_output=True, text=True)
report["stop"] = stop.returncode, stop.stdout + stop.stderr
report["after"] = shm()
print(json.dumps(report))
'''


def _private_shm_or_skip() -> list[str]:
    """The command prefix that runs a process in a private mount namespace with an empty
    tmpfs on /dev/shm; skip (naming why) where this machine does not allow it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) on this machine: cannot give the daemon a private /dev/shm")
    probe = subprocess.run([unshare, "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm && ls -A /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip():
        pytest.skip(f"cannot mount a private /dev/shm here (unshare -m needs root or user namespaces): "
                    f"{probe.stderr.strip()[:200]}")
    return [unshare, "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]


def test_stop_leaves_an_empty_dev_shm_after_every_engine_was_sigkilled(tmp_path):
    """In a private /dev/shm: the engines' semaphores and segment exist while they run,
    outlive the kill -9 of every engine's process group, and none is left after `seerctl
    stop` (the directory is empty, as before the start)."""
    prefix = _private_shm_or_skip()
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "SEER_TEST_SHM_PRIVATE": "1",
           "PYTHONPATH": os.pathsep.join([str(inject), *filter(None, [os.environ.get("PYTHONPATH")])])}
    config = write_sim_config(tmp_path / "sim.toml", heartbeat_timeout_s=30.0)
    out = subprocess.run([*prefix, sys.executable, "-c", SCENARIO, str(config), str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["before"] == []
    assert report["start"][0] == 0, report["start"][1]
    assert sum(n.startswith("sem.mp-") for n in report["running"]) >= 3, report["running"]
    assert "psm_seer_test" in report["running"]
    assert report["stop"][0] == 0, report["stop"][1]
    assert report["after"] == [], f"left in /dev/shm after stop: {report['after']} (after the kill: {report['killed']})"
    log = (tmp_path / "run" / "controlplane.log").read_text()
    reclaimed = [json.loads(line) for line in log.splitlines() if "engine_shm_reclaimed" in line]
    assert any(n.startswith("sem.mp-") for r in reclaimed for n in r["names"]), reclaimed
