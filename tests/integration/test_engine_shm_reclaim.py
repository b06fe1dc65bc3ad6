"""A kill -9'd engine tree's /dev/shm leftovers are reclaimed by the supervisor (issue 14,
defect 10), while the daemon runs and in any case by `seerctl stop`.

Simulated engines allocate no shared memory, so a ``sitecustomize`` on the daemon's
PYTHONPATH makes engine 0's worker start a child that creates a ``psm_*`` segment, as
vLLM's worker processes do. The test SIGKILLs engine 0's process group (the child and
the worker; nothing can clean up) and checks /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

from tests.daemon_helpers import seerctl, wait_for, write_sim_config

SITECUSTOMIZE = r'''
import os, subprocess, sys
_argv = getattr(sys, "orig_argv", [])
_tag = os.environ.get("SEER_TEST_SHM_TAG")
if _tag and "seer.engines.worker" in _argv and _argv[_argv.index("--engine-id") + 1] == "0":
    subprocess.Popen([sys.executable, "-c",
        "import sys, time; from multiprocessing import shared_memory as s; "
        "m = s.SharedMemory(name=sys.argv[1], create=True, size=65536); time.sleep(1000)",
        "psm_" + _tag], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
'''


def test_a_sigkilled_engine_trees_segment_is_reclaimed(tmp_path):
    """Engine 0's child maps psm_<tag>; after kill -9 of engine 0's process group the
    segment is unlinked while the daemon runs (engine_shm_reclaimed), and stop leaves none."""
    tag = f"hrobust{uuid.uuid4().hex[:8]}"
    segment = Path("/dev/shm") / f"psm_{tag}"
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    run_dir = tmp_path / "run"
    env = {"SEER_TEST_SHM_TAG": tag,
           "PYTHONPATH": os.pathsep.join([str(inject), *filter(None, [os.environ.get("PYTHONPATH")])])}
    config = write_sim_config(tmp_path / "sim.toml")
    started = seerctl("start", "--config", str(config), "--run-dir", str(run_dir), env=env)
    assert started.returncode == 0, started.stderr + started.stdout
    log = run_dir / "controlplane.log"
    try:
        wait_for(lambda: segment.exists(), 30, "engine 0's child to create its segment")
        # Recorded by the supervisor's scan of engine 0's tree before the kill.
        wait_for(lambda: f"psm_{tag}" in log.read_text() and "engine_shm_recorded" in log.read_text(), 30,
                 "the supervisor to record the segment")
        status = json.loads(seerctl("status", "--json", "--run-dir", str(run_dir)).stdout)
        engine0 = next(e for e in status["engines"] if e["engine_id"] == 0)
        os.killpg(engine0["pid"], signal.SIGKILL)
        wait_for(lambda: not segment.exists(), 30, "the leaked segment to be reclaimed")
        reclaimed = [json.loads(line) for line in log.read_text().splitlines() if "engine_shm_reclaimed" in line]
        assert reclaimed and reclaimed[0]["engine_id"] == 0 and f"psm_{tag}" in reclaimed[0]["names"]
    finally:
        seerctl("stop", "--run-dir", str(run_dir), env=env)
        leftover = sorted(p.name for p in Path("/dev/shm").glob(f"*{tag}*"))
        for name in leftover:  # never leave the test's own leak on the machine
            (Path("/dev/shm") / name).unlink(missing_ok=True)
    assert leftover == []
