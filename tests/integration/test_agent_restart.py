"""A host agent outlives its control plane and registers with the next one on the address.

A real daemon (`seerctl start`, simulated engines) and a real agent process
(dataplane/transfer/agent.py) on another "host": a network namespace created by the test
(dataplane/netns.py; skipped with the reason where namespaces cannot be created),
reaching the daemon's ipc:// engine socket through the shared filesystem, with its own
pool segment. The daemon is SIGKILLed and started again on the same run dir, then
stopped and started gracefully: each time the agent -- which never exits -- notices the
silence after ``engines.heartbeat_timeout_s`` (5 s here) and the new control plane logs
``kv_agent_registered`` for it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from pathlib import Path

import pytest

from seer.protocol import PoolGeometry
from seer.dataplane.transfer import host_id
from seer.dataplane.transfer.agent import EXIT_OK, AgentProcess
from seer.dataplane.netns import NetnsPair
from seer.process import pid_alive as process_exists
from tests.daemon_helpers import Daemon, netns_pair_or_skip, wait_for, write_sim_config

GEOM = PoolGeometry(num_layers=2, num_kv_heads=1, head_size=8, block_size=16, dtype="float32")
REGISTER_TIMEOUT_S = 180.0  # heartbeat_timeout_s (5) + a daemon start + agent start, on a loaded machine


@pytest.fixture
def host_b():
    yield from netns_pair_or_skip()


def _events(log_file: Path, name: str) -> list[dict]:
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def _registrations_by_control_plane(log_file: Path, agent_pid: int) -> list[int]:
    """For each control plane that ran on the run dir (in order), how many times it logged
    ``kv_agent_registered`` for this agent (controlplane.log is appended to)."""
    counts: list[int] = []
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    for event in map(json.loads, lines):
        if event.get("event") == "control_plane_started":
            counts.append(0)
        elif event.get("event") == "kv_agent_registered" and event.get("pid") == agent_pid and counts:
            counts[-1] += 1
    return counts


def test_an_agent_registers_again_after_the_control_plane_restarts(tmp_path: Path, host_b: NetnsPair):
    """Registered with the first control plane; after a crash (SIGKILL) and restart, and
    after a graceful stop and start, the same agent process is registered once with each
    new control plane, having logged control_plane_lost and agent_reregistered each time."""
    config = write_sim_config(tmp_path / "sim.toml", count=1)  # engines.heartbeat_timeout_s = 5
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    log_file = daemon.run_dir / "controlplane.log"
    agent_log = tmp_path / "agent.log"
    name = f"seertest-restart-{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp_path / "agent.out", "wb") as out:
        agent = AgentProcess(connect=info["engine_address"], pool=name, bind_host=host_b.addresses[1],
                             transport="tcp", config_file=config, create=(GEOM, 8), log_file=agent_log,
                             prefix=host_b.prefix(1), stdout=out)
    try:
        wait_for(lambda: _registrations_by_control_plane(log_file, agent.pid) == [1], REGISTER_TIMEOUT_S,
                 "the agent to register with the first control plane")
        (first,) = _events(log_file, "kv_agent_registered")
        assert first["host_id"] != host_id() and first["pool"] == name  # another host's pool

        os.kill(info["pid"], signal.SIGKILL)  # a crash: the agent is told nothing
        # Gone *and reaped*: `seerctl start` takes a zombie for a running daemon.
        wait_for(lambda: not process_exists(info["pid"]), 60, "the old control plane to die")
        daemon.start()
        wait_for(lambda: _registrations_by_control_plane(log_file, agent.pid) == [1, 1], REGISTER_TIMEOUT_S,
                 "the agent to register with the restarted control plane")
        assert agent.poll() is None, "a lost control plane never makes the agent exit"
        wait_for(lambda: len(_events(agent_log, "agent_reregistered")) == 1, 30, "the agent to hear the new one")

        daemon.stop()  # graceful: the daemon does not stop agents of other hosts
        daemon.start()
        wait_for(lambda: _registrations_by_control_plane(log_file, agent.pid) == [1, 1, 1], REGISTER_TIMEOUT_S,
                 "the agent to register with the control plane started after a graceful stop")
        wait_for(lambda: len(_events(agent_log, "agent_reregistered")) == 2, 30, "the agent to hear the third one")
        lost = _events(agent_log, "control_plane_lost")
        assert len(lost) == 2 and all(e["silent_s"] >= 5.0 for e in lost)
        assert agent.poll() is None
    finally:
        daemon.stop()
        code = agent.stop()
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)
    assert code == EXIT_OK  # SIGTERM still ends it cleanly
    assert not Path(f"/dev/shm/{name}").exists()
