"""The draft server as a real process (``python -m seer.dataplane.draft_server``) with
DraftClients as engines: forwarding only for registered groups, backlog on a late
registration, TTL drop, weights-version reset, nothing lost through full rings, an
engine in another process, crash recovery (SIGKILL: stale rings swept, clients
reconnect), and the supervisor's start/stop.

Every wait is a poll with a generous timeout on an observable effect (tokens in a
store, a line in the server's log), never a sleep-then-assert.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from seer.config import SeerConfig
from seer.controlplane.supervisor import Supervisor, grouped_drafting
from seer.dataplane.draft_client import DraftClient
from seer.dataplane.draft_server import INFO_FILE, PREFIX, SHM_DIR, read_info
from tests.daemon_helpers import wait_for

TIMEOUT_S = 60.0


class ServerProcess:
    def __init__(self, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.log_file = run_dir / "draft-server.log"
        self.popen = subprocess.Popen([sys.executable, "-m", "seer.dataplane.draft_server", "--dir", str(run_dir),
                                       "--log-file", str(self.log_file), "--log-level", "debug",
                                       "--scan-interval-s", "0.05", *args],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: (info := read_info(run_dir)) is not None and info.pid == self.popen.pid, TIMEOUT_S,
                 "the draft server's info file")

    @property
    def pid(self) -> int:
        return self.popen.pid

    def events(self, name: str) -> list[dict]:
        if not self.log_file.exists():
            return []
        out = []
        for line in self.log_file.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if event.get("event") == name:
                out.append(event)
        return out

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout=TIMEOUT_S)


@pytest.fixture
def server_factory(tmp_path):
    servers: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(tmp_path, *args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        if server.popen.poll() is None:
            server.popen.kill()
            server.popen.wait(timeout=TIMEOUT_S)
        for path in SHM_DIR.glob(f"{PREFIX}{server.pid}-*"):
            path.unlink(missing_ok=True)


def client(run_dir: Path, engine_id: int, **kwargs) -> DraftClient:
    c = DraftClient(str(run_dir), engine_id, connect_interval_s=0.05, **kwargs)
    wait_for(lambda: (c.sync(), c.connected)[1], TIMEOUT_S, f"engine {engine_id} to connect")
    return c


def synced(clients: list[DraftClient], predicate) -> bool:
    for c in clients:
        c.sync()
    return predicate()


def test_appends_reach_registered_engines_and_backlog_on_late_register(server_factory, tmp_path):
    """Engine 0's tokens show up in engine 1's store for a group engine 1 registered, not
    for one it did not; registering that one later delivers its backlog."""
    server_factory()
    e0, e1 = client(tmp_path, 0), client(tmp_path, 1)
    for c in (e0, e1):
        c.register_group("g", 0, [7, 7])
    e0.register_group("solo", 0, [8])
    e0.append("g", "g/0", 0, [1, 2, 3])
    e0.append("solo", "solo/0", 0, [4, 5])
    e0.append("g", "g/0", 3, [4, 5, 6])
    wait_for(lambda: synced([e0, e1], lambda: e1.store.tokens("g", "g/0") == [1, 2, 3, 4, 5, 6]), TIMEOUT_S,
             "engine 0's tokens on engine 1")
    e1.append("g", "g/1", 0, [9, 9])
    wait_for(lambda: synced([e0, e1], lambda: e0.store.tokens("g", "g/1") == [9, 9]), TIMEOUT_S,
             "engine 1's tokens on engine 0")
    # "solo" went to the server before "g/1": had it been forwarded, it would be here now.
    assert "solo" not in e1.store.group_ids()
    assert e1.store.speculate("g", "g/1", 4, context_tail=[2, 3]).linear == [4, 5, 6]
    e1.register_group("solo", 0, [8])
    wait_for(lambda: synced([e0, e1], lambda: e1.store.tokens("solo", "solo/0") == [4, 5]), TIMEOUT_S,
             "the backlog of a late registration")
    e0.close()
    e1.close()


def test_group_is_dropped_after_ttl(server_factory, tmp_path):
    """After every engine unregistered a group, the server drops it once the TTL passed:
    a later registration gets no backlog for it (but does for a live group)."""
    server = server_factory("--ttl-s", "0.5")
    e0, e1 = client(tmp_path, 0), client(tmp_path, 1)
    e0.register_group("old", 0, [1])
    e0.register_group("live", 0, [1])
    e0.append("old", "old/0", 0, [1, 2, 3])
    e0.append("live", "live/0", 0, [4, 5])
    e0.unregister_group("old")
    wait_for(lambda: synced([e0], lambda: any(ev["group_id"] == "old" for ev in server.events("draft_group_expired"))),
             TIMEOUT_S, "the server to expire the group")
    assert not any(ev["group_id"] == "live" for ev in server.events("draft_group_expired"))
    e1.register_group("old", 0, [1])
    e1.register_group("live", 0, [1])
    wait_for(lambda: synced([e1], lambda: e1.store.tokens("live", "live/0") == [4, 5]), TIMEOUT_S,
             "the live group's backlog")
    assert e1.store.tokens("old", "old/0") == []  # its backlog would have come first
    e0.close()
    e1.close()


def test_newer_weights_version_resets_every_engine(server_factory, tmp_path):
    """An engine registering with a newer weights version makes the server drop all groups
    and every other engine drop its old-version groups; old tokens never come back."""
    server_factory()
    e0, e1 = client(tmp_path, 0), client(tmp_path, 1)
    for c in (e0, e1):
        c.register_group("g", 0, [1])
    e0.append("g", "g/0", 0, [1, 2, 3])
    wait_for(lambda: synced([e0, e1], lambda: e1.store.tokens("g", "g/0") == [1, 2, 3]), TIMEOUT_S, "v0 tokens")
    e1.register_group("h", 1, [1])
    wait_for(lambda: synced([e0, e1], lambda: e0.store.weights_version == 1), TIMEOUT_S, "the reset on engine 0")
    assert e0.store.group_ids() == []
    e0.register_group("g", 1, [1])
    e0.append("g", "g/0", 0, [5])
    e1.register_group("g", 1, [1])
    wait_for(lambda: synced([e0, e1], lambda: e1.store.tokens("g", "g/0") == [5]), TIMEOUT_S, "v1 tokens")
    e0.close()
    e1.close()


def test_nothing_is_lost_when_rings_are_full(server_factory, tmp_path):
    """With 4 KiB rings, 3,000 tokens (12 KiB of records) from engine 0 in one step and a
    receiving engine that does not read meanwhile: the up ring takes what fits and the
    rest waits in engine 0's outbox, the down ring fills and the rest waits in the
    server; engine 1 ends with every token, in order."""
    server_factory("--ring-bytes", "4096")
    e0, e1 = client(tmp_path, 0), client(tmp_path, 1)
    e0.register_group("g", 0, [1])
    e1.register_group("g", 0, [1])
    wait_for(lambda: synced([e0, e1], lambda: e0._outbox == [] and e1._outbox == []), TIMEOUT_S, "registrations sent")
    for i in range(60):
        request = f"g/{i % 3}"
        e0.append("g", request, len(e0.store.tokens("g", request)), [(i * 50 + j) % 30000 for j in range(50)])
    e0.sync()
    assert e0._outbox  # the up ring was full: records wait, in order
    want = {r: e0.store.tokens("g", r) for r in ("g/0", "g/1", "g/2")}
    assert sum(len(v) for v in want.values()) == 3000
    wait_for(lambda: synced([e0], lambda: not e0._outbox), TIMEOUT_S, "engine 0's outbox to empty")
    wait_for(lambda: synced([e0, e1], lambda: all(e1.store.tokens("g", r) == v for r, v in want.items())),
             TIMEOUT_S, "every token on engine 1")
    e0.close()
    e1.close()


def _engine_process(run_dir: str, count: int) -> None:
    e = DraftClient(run_dir, 7, connect_interval_s=0.05)
    wait_for(lambda: (e.sync(), e.connected)[1], TIMEOUT_S, "engine 7 to connect")
    e.register_group("g", 0, [1])
    for i in range(count):
        e.append("g", "g/7", i * 4, [i, i + 1, i + 2, i + 3])
        e.sync()
    wait_for(lambda: (e.sync(), not e._outbox)[1], TIMEOUT_S, "engine 7's outbox to empty")
    e.close()


def test_engine_in_another_process(server_factory, tmp_path):
    """An engine in a spawned process appends 2,000 small chunks through 4 KiB rings; this
    process (engine 1) receives all 8,000 tokens in order."""
    server_factory("--ring-bytes", "4096")
    e1 = client(tmp_path, 1)
    e1.register_group("g", 0, [1])
    count = 2000
    want = [t for i in range(count) for t in (i, i + 1, i + 2, i + 3)]
    proc = multiprocessing.get_context("spawn").Process(target=_engine_process, args=(str(tmp_path), count))
    proc.start()
    try:
        wait_for(lambda: synced([e1], lambda: e1.store.tokens("g", "g/7") == want), TIMEOUT_S * 2,
                 "the other process's tokens")
    finally:
        proc.join(timeout=TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    e1.close()


def test_killed_server_is_replaced_and_clients_catch_up(server_factory, tmp_path):
    """SIGKILL leaves rings behind; the next server sweeps them at start, clients notice the
    dead pid, reconnect and re-send what they own, so siblings see it again."""
    first = server_factory()
    e0, e1 = client(tmp_path, 0), client(tmp_path, 1)
    e0.register_group("g", 0, [1])
    e0.append("g", "g/0", 0, [1, 2, 3])
    wait_for(lambda: synced([e0], lambda: not e0._outbox), TIMEOUT_S, "engine 0's records sent")
    first.popen.kill()
    first.popen.wait(timeout=TIMEOUT_S)
    wait_for(lambda: synced([e0, e1], lambda: not e0.connected and not e1.connected), TIMEOUT_S,
             "clients to notice the dead server")
    assert list(SHM_DIR.glob(f"{PREFIX}{first.pid}-*")) == []  # clients unlinked their own
    e0.append("g", "g/0", 3, [4])  # local-only meanwhile
    assert e0.store.tokens("g", "g/0") == [1, 2, 3, 4]
    second = server_factory()
    assert second.pid != first.pid
    wait_for(lambda: synced([e0, e1], lambda: e0.connected and e1.connected), TIMEOUT_S, "reconnection")
    e1.register_group("g", 0, [1])
    wait_for(lambda: synced([e0, e1], lambda: e1.store.tokens("g", "g/0") == [1, 2, 3, 4]), TIMEOUT_S,
             "engine 0's re-sent tokens on engine 1")
    e0.close()
    e1.close()
    assert second.stop() == 0
    assert list(SHM_DIR.glob(f"{PREFIX}{second.pid}-*")) == []
    assert not (tmp_path / INFO_FILE).exists()


def test_stale_rings_of_a_dead_server_are_removed_at_start(server_factory, tmp_path):
    """Rings named after a server pid that no longer exists are unlinked by the next server."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = SHM_DIR / f"{PREFIX}{dead.pid}-0-{os.getpid()}-up"
    stale.write_bytes(b"x")
    try:
        server_factory()  # sweeps before it writes its info file, which the factory waits for
        # (Not asserted through the server's log: another test run on this machine may
        # start a draft server, which sweeps the same ring first.)
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_supervisor_starts_and_stops_the_draft_server(tmp_path):
    """The supervisor starts the server only for grouped drafting, waits for its info file,
    and at stop leaves no process, ring or info file behind."""
    assert not grouped_drafting(SeerConfig())
    assert grouped_drafting(SimpleNamespace(speculative=SimpleNamespace(method="grouped")))
    supervisor = Supervisor(SeerConfig(), tmp_path, engine_address="", model_path="")
    popen = supervisor.start_draft_server()
    assert popen is not None and read_info(tmp_path).pid == popen.pid
    e0 = client(tmp_path, 0)
    assert list(SHM_DIR.glob(f"{PREFIX}{popen.pid}-*"))
    supervisor.stop_all(grace_s=1.0)
    assert popen.returncode == 0  # SIGTERM: a clean exit
    assert list(SHM_DIR.glob(f"{PREFIX}{popen.pid}-*")) == []
    assert not (tmp_path / INFO_FILE).exists()
    e0.close()


def test_daemon_runs_the_draft_server_with_grouped_drafting(tmp_path):
    """`seerctl start` with `[speculative] method = "grouped"` runs a draft server that
    engines can reach through the run dir; `seerctl stop` ends it and removes its file and
    rings. (Without grouped drafting the supervisor starts none: see the test above.)"""
    from seer.process import pid_alive
    from tests.daemon_helpers import Daemon, write_sim_config

    config = write_sim_config(tmp_path / "grouped.toml")
    config.write_text(config.read_text() + '\n[speculative]\nmethod = "grouped"\n')
    daemon = Daemon(tmp_path / "run", config)
    daemon.start()
    try:
        info = read_info(daemon.run_dir)
        assert info is not None and pid_alive(info.pid)
        e0 = client(daemon.run_dir, 0)
        assert list(SHM_DIR.glob(f"{PREFIX}{info.pid}-*"))
    finally:
        daemon.stop()
    wait_for(lambda: not pid_alive(info.pid), TIMEOUT_S, "the draft server to exit")
    assert not (daemon.run_dir / INFO_FILE).exists()
    assert list(SHM_DIR.glob(f"{PREFIX}{info.pid}-*")) == []
    e0.close()
