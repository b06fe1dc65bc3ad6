"""Who starts a host's KV pool and agent (controlplane/kvpool/segment.py: ``claim_host_agent``,
``release_host_agent``): the first claimant of a host, never two at once; a dead agent or
a vanished segment is replaced; the file names only one host."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from seer.controlplane.kvpool.segment import HostAgentInfo, claim_host_agent, host_agent_file, release_host_agent


@pytest.fixture
def host():
    name = f"test-host:{secrets.token_hex(4)}/x"
    segment = Path("/dev/shm") / f"seer-kv-test-agentfile-{secrets.token_hex(4)}"
    segment.write_bytes(b"")
    yield name, segment.name
    segment.unlink(missing_ok=True)
    for path in (host_agent_file(name), host_agent_file(name).with_suffix(".lock")):
        path.unlink(missing_ok=True)


def test_the_first_claim_starts_the_agent_and_later_ones_reuse_it(host):
    name, pool = host
    started = []

    def start() -> HostAgentInfo:
        started.append(1)
        return HostAgentInfo(pid=os.getpid(), pool_name=pool)

    results = []
    threads = [threading.Thread(target=lambda: results.append(claim_host_agent(name, start))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(started) == 1
    assert sorted(r[0] for r in results) == [False] * 7 + [True]
    assert all(r[1] == HostAgentInfo(pid=os.getpid(), pool_name=pool) for r in results)
    assert "/" not in host_agent_file(name).name


def test_a_dead_agent_or_a_missing_segment_is_replaced(host):
    name, pool = host
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    assert claim_host_agent(name, lambda: HostAgentInfo(pid=int(dead), pool_name=pool))[0]
    # The recorded agent is dead: the next claim starts a new one (here: one whose segment is missing).
    assert claim_host_agent(name, lambda: HostAgentInfo(pid=os.getpid(), pool_name="seer-kv-no-such"))[0]
    # Alive, but its segment is gone: replaced too.
    assert claim_host_agent(name, lambda: HostAgentInfo(pid=os.getpid(), pool_name=pool))[0]
    # Alive with its segment: kept.
    kept, info = claim_host_agent(name, lambda: HostAgentInfo(pid=1, pool_name=pool))
    assert not kept and info == HostAgentInfo(pid=os.getpid(), pool_name=pool)


def test_release_forgets_only_the_agent_it_names(host):
    name, pool = host
    claim_host_agent(name, lambda: HostAgentInfo(pid=os.getpid(), pool_name=pool))
    release_host_agent(name, os.getpid() + 1)
    assert host_agent_file(name).exists()
    release_host_agent(name, os.getpid())
    assert not host_agent_file(name).exists()
