"""A kill -9'd real vLLM engine's /dev/shm segments are reclaimed (issue 14, defect 10).

Own daemon (destructive: an engine is killed), two float32 SmolLM2 engines. vLLM creates
``psm_*`` segments and ``sem.mp-*`` semaphores at start-up; the supervisor records them
per engine session (``engine_shm_recorded``). After ``kill -9`` of engine 0's process
group (its resource tracker included) they must be unlinked while the daemon runs, and
after ``seerctl stop`` none of either engine's recorded files may exist. Only recorded
names are checked: other programs on the machine may create psm_ segments meanwhile."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, seerctl, wait_for
from tests.engine.conftest import vllm_config

pytestmark = pytest.mark.engine

SHM = Path("/dev/shm")


def _recorded(log: Path) -> dict[int, set[str]]:
    names: dict[int, set[str]] = {}
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "engine_shm_recorded":
            names.setdefault(event["engine_id"], set()).update(event["names"])
    return names


def test_a_sigkilled_vllm_engines_shared_memory_is_reclaimed(tmp_path, model_dir):
    """kill -9 of a real engine's process group: its psm_/sem.mp- files are unlinked while
    the daemon runs, and none of any engine's recorded files survive seerctl stop."""
    daemon = Daemon(tmp_path / "run", vllm_config(tmp_path / "seer.toml", engines=2))
    daemon.start()
    log = daemon.run_dir / "controlplane.log"
    try:
        wait_for(lambda: _recorded(log).get(0), 60, "engine 0's shared memory to be recorded")
        status = json.loads(seerctl("status", "--json", "--run-dir", str(daemon.run_dir)).stdout)
        engine0 = next(e for e in status["engines"] if e["engine_id"] == 0)
        own = {n for n in _recorded(log)[0] if n.startswith(("psm_", "sem.mp-")) and (SHM / n).exists()}
        assert own, f"engine 0 holds no psm_/sem.mp- file: {_recorded(log)[0]}"
        os.killpg(engine0["pid"], signal.SIGKILL)
        wait_for(lambda: not any((SHM / n).exists() for n in own), 120, "engine 0's files to be reclaimed")
    finally:
        daemon.stop()
    left = sorted(n for names in _recorded(log).values() for n in names
                  if n.startswith(("psm_", "sem.mp-")) and (SHM / n).exists())
    assert left == []


def _session_members(session_id: int) -> list[int]:
    """Live processes of session ``session_id`` (a spawned engine's: its vLLM processes too)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[3]) == session_id:  # state, ppid, pgrp, session
                members.append(int(entry.name))
    return members


def test_a_sigkilled_daemons_real_engine_leaves_nothing(tmp_path, model_dir):
    """The daemon SIGKILLed (the OOM killer): its engine gets SIGTERM (die-with-parent),
    stops like on Shutdown, and vLLM's engine core and workers stop with it (they used to be
    handed to init and live on, ~4 GB each); the engine also unlinks the dead daemon's KV
    pool segment. Nothing of the engine's session and none of its recorded /dev/shm files is
    left."""
    daemon = Daemon(tmp_path / "run", vllm_config(tmp_path / "seer.toml", engines=1))
    info = daemon.start()
    log = daemon.run_dir / "controlplane.log"
    try:
        wait_for(lambda: _recorded(log).get(0), 60, "engine 0's shared memory to be recorded")
        status = json.loads(seerctl("status", "--json", "--run-dir", str(daemon.run_dir)).stdout)
        engine = next(e for e in status["engines"] if e["engine_id"] == 0)
        members = _session_members(engine["pid"])
        assert len(members) >= 2, f"engine 0's session has no vLLM process: {members}"
        files = {n for n in _recorded(log)[0] if (SHM / n).exists()}
        files |= {p.name for p in SHM.glob(f"seer-kv-{info['pid']}-*")}
        assert any(n.startswith("seer-kv-") for n in files), f"no KV pool segment of daemon {info['pid']}"
        os.kill(info["pid"], signal.SIGKILL)
        wait_for(lambda: not _session_members(engine["pid"]), 120, "the engine's processes to exit")
        assert sorted(n for n in files if (SHM / n).exists()) == []
    finally:
        for pid in _session_members(engine["pid"]) if "engine" in locals() else []:
            os.kill(pid, signal.SIGKILL)
        daemon.stop()
