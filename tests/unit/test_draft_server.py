"""The grouped draft server's logic (dataplane/draft_core.py), its shell driven step by
step in one process (dataplane/draft_server.py), and the engine-side client
(dataplane/draft_client.py) in local-only and connected mode. No extra processes and no
sleeping: clocks are injected, the server is stepped by hand; the real-process tests are
in tests/integration/test_draft_server.py.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import msgspec
import pytest

from seer.dataplane.draft_client import DraftClient
from seer.dataplane.draft_core import DraftServerCore, GapBuffer, SampleLog, split_append
from seer.dataplane.draft_server import (
    INFO_FILE,
    PREFIX,
    DraftServer,
    parse_ring_name,
    read_info,
    remove_stale_rings,
    ring_names,
)
from seer.protocol import (
    DraftAppend,
    DraftRegister,
    DraftUnregister,
    pack_token_ids,
    unpack_token_ids,
)

SHM = Path("/dev/shm")


def app(group: str, request: str, start: int, tokens: list[int], version: int = 1) -> DraftAppend:
    return DraftAppend(group_id=group, request_id=request, weights_version=version, start_pos=start,
                       token_ids=pack_token_ids(tokens))


def decoded(out) -> list[tuple]:
    """Outgoing messages as comparable tuples."""
    rows = []
    for engine, msg in out:
        if isinstance(msg, DraftAppend):
            rows.append((engine, msg.group_id, msg.request_id, msg.start_pos, unpack_token_ids(msg.token_ids)))
        else:
            rows.append((engine, "reset", msg.weights_version))
    return rows


# ---------------------------------------------------------------------------
# Pure pieces


def test_gap_buffer_releases_runs_in_order_and_is_bounded():
    """Held runs come back once the log reaches their start, sorted; the farthest run is
    dropped when over the bound."""
    gaps = GapBuffer(max_runs=2)
    gaps.hold(10, array("i", [1]))
    gaps.hold(5, array("i", [2, 3]))
    gaps.hold(5, array("i", [9]))  # shorter re-send of the same start: the longer run stays
    assert gaps.take_ready(4) == []
    gaps.hold(20, array("i", [7]))
    assert gaps.num_dropped == 1 and 20 not in gaps.runs
    assert [(s, list(r)) for s, r in gaps.take_ready(10)] == [(5, [2, 3]), (10, [1])]
    assert len(gaps) == 0


def test_sample_log_merges_out_of_order_chunks_and_skips_resends():
    """A later chunk waits for the gap; an overlapping re-send adds only what is new."""
    log = SampleLog()
    assert log.add(4, array("i", [5, 6])) == 0
    assert list(log.tokens) == []
    assert log.add(0, array("i", [1, 2, 3, 4])) == 0
    assert list(log.tokens) == [1, 2, 3, 4, 5, 6]
    assert log.add(2, array("i", [3, 4, 5, 6, 7])) == 6
    assert list(log.tokens) == [1, 2, 3, 4, 5, 6, 7]


def test_split_append_keeps_positions():
    """A long append becomes pieces with consecutive start positions and the same tokens."""
    msg = app("g", "g/0", 10, list(range(10)))
    pieces = split_append(msg, 4)
    assert [p.start_pos for p in pieces] == [10, 14, 18]
    assert sum((unpack_token_ids(p.token_ids) for p in pieces), []) == list(range(10))
    assert split_append(msg, 10) == [msg]


# ---------------------------------------------------------------------------
# DraftServerCore


def test_appends_go_to_other_registered_engines_only():
    """Engine 0's tokens reach engines registered for the group, never engine 0 itself
    and never an engine that registered another group."""
    core = DraftServerCore(ttl_s=10)
    for e in (0, 1, 2):
        core.connect(e)
    core.handle(0, DraftRegister(group_id="g", weights_version=1), now=0)
    core.handle(1, DraftRegister(group_id="g", weights_version=1), now=0)
    core.handle(2, DraftRegister(group_id="h", weights_version=1), now=0)
    out = core.handle(0, app("g", "g/0", 0, [1, 2, 3]), now=1)
    assert decoded(out) == [(1, "g", "g/0", 0, [1, 2, 3])]
    out = core.handle(0, app("g", "g/0", 3, [4]), now=1)
    assert decoded(out) == [(1, "g", "g/0", 3, [4])]
    assert core.handle(0, app("g", "g/0", 0, [1, 2]), now=1) == []  # re-sent: nothing new
    assert core.num_tokens("g") == 4


def test_register_sends_the_backlog():
    """An engine registering a known group gets every sample's tokens so far, from 0."""
    core = DraftServerCore(ttl_s=10)
    core.connect(0)
    core.connect(1)
    core.handle(0, DraftRegister(group_id="g", weights_version=1), now=0)
    core.handle(0, app("g", "g/0", 0, [1, 2, 3]), now=0)
    core.handle(0, app("g", "g/1", 0, [7, 8]), now=0)
    out = core.handle(1, DraftRegister(group_id="g", weights_version=1), now=1)
    assert decoded(out) == [(1, "g", "g/0", 0, [1, 2, 3]), (1, "g", "g/1", 0, [7, 8])]


def test_gap_from_a_migrated_chunk_is_filled_for_everyone():
    """Engine 1 appends chunk 2 of a request before engine 0's chunk 1 arrives: nothing
    is forwarded until the gap closes, then engine 1 gets chunk 1 and engine 0 gets the
    part of chunk 2 it never had."""
    core = DraftServerCore(ttl_s=10)
    for e in (0, 1):
        core.connect(e)
        core.handle(e, DraftRegister(group_id="g", weights_version=1), now=0)
    assert core.handle(1, app("g", "g/0", 3, [4, 5]), now=0) == []
    out = core.handle(0, app("g", "g/0", 0, [1, 2, 3]), now=0)
    assert decoded(out) == [(0, "g", "g/0", 3, [4, 5]), (1, "g", "g/0", 0, [1, 2, 3, 4, 5])]


def test_unregistered_group_is_dropped_after_ttl_and_not_before():
    """A group stays while any engine has it registered; TTL seconds after the last
    unregistration (or disconnect) it is dropped. Re-registering in time keeps it."""
    core = DraftServerCore(ttl_s=5)
    core.connect(0)
    core.connect(1)
    core.handle(0, DraftRegister(group_id="g", weights_version=1), now=0)
    core.handle(0, app("g", "g/0", 0, [1, 2]), now=0)
    core.handle(0, DraftUnregister(group_id="g"), now=1)
    assert core.expire(now=5.9) == []
    core.handle(1, DraftRegister(group_id="g", weights_version=1), now=5.9)  # next chunk elsewhere
    assert core.expire(now=100) == []
    core.disconnect(1, now=100)
    assert core.expire(now=104.9) == []
    assert core.expire(now=105) == ["g"]
    assert core.groups == {}
    # Tokens for a group nobody registered are kept for the TTL too.
    core.handle(0, app("h", "h/0", 0, [1]), now=200)
    assert core.expire(now=205) == ["h"]


def test_newer_weights_version_resets_and_older_is_refused():
    """A newer version drops every group and tells every engine; older messages are refused."""
    core = DraftServerCore(ttl_s=10)
    core.connect(0)
    core.connect(1)
    core.handle(0, DraftRegister(group_id="g", weights_version=1), now=0)
    core.handle(0, app("g", "g/0", 0, [1, 2]), now=0)
    out = core.handle(1, DraftRegister(group_id="h", weights_version=2), now=1)
    assert decoded(out) == [(0, "reset", 2), (1, "reset", 2)]
    assert list(core.groups) == ["h"]
    assert core.handle(0, app("g", "g/0", 2, [3]), now=1) == []
    assert core.handle(0, DraftRegister(group_id="g", weights_version=1), now=1) == []
    assert core.num_stale_refused == 2 and "g" not in core.groups


# ---------------------------------------------------------------------------
# DraftClient, local-only


def test_local_client_drafts_from_its_own_siblings():
    """Without a server the client is a local store: appends are visible to speculate at
    once; sync is harmless; an idle group is dropped after the TTL."""
    now = [0.0]
    client = DraftClient(None, engine_id=0, ttl_s=10, clock=lambda: now[0])
    client.register_group("g", 0, [100, 101])
    client.append("g", "g/0", 0, [1, 2, 3, 4, 5])
    client.append("g", "g/1", 0, [1, 2])
    client.sync()
    assert client.store.speculate("g", "g/1", 3).linear == [3, 4, 5]
    assert not client.connected
    client.unregister_group("g")
    now[0] = 9.0
    client.sync()
    assert client.store.num_tokens("g") > 0
    now[0] = 11.0
    client.sync()
    assert client.store.group_ids() == []
    client.close()


def test_local_client_holds_a_later_chunk_until_the_gap_closes():
    """A chunk appended before the one it follows is kept and applied when the gap closes."""
    client = DraftClient(None, engine_id=0)
    client.register_group("g", 0, [9])
    client.append("g", "g/0", 3, [4, 5])
    assert client.store.tokens("g", "g/0") == []
    client.append("g", "g/0", 0, [1, 2, 3])
    assert client.store.tokens("g", "g/0") == [1, 2, 3, 4, 5]


def test_local_client_new_weights_version_drops_old_groups():
    """Registering with a newer version resets the store; an older one is ignored."""
    client = DraftClient(None, engine_id=0)
    client.register_group("g", 1, [9])
    client.append("g", "g/0", 0, [1, 2])
    client.register_group("h", 2, [9])
    assert client.store.group_ids() == ["h"] and client.store.weights_version == 2
    client.register_group("old", 1, [9])
    assert "old" not in client.store.group_ids()


# ---------------------------------------------------------------------------
# Server shell + clients in one process (stepped by hand)


@pytest.fixture
def run_dir(tmp_path):
    yield tmp_path
    for path in SHM.glob(f"{PREFIX}{os.getpid()}-*"):
        path.unlink(missing_ok=True)


def _pump(server: DraftServer, clients: list[DraftClient], rounds: int = 4) -> None:
    for _ in range(rounds):
        for c in clients:
            c.sync()
        server.step(now=0.0)
    for c in clients:
        c.sync()


def test_in_process_server_forwards_between_two_clients(run_dir):
    """Two clients and a server in one process: the server's info file is found, rings
    are created and attached, engine 0's tokens reach engine 1 for a registered group
    only, a late registration gets the backlog, and close unlinks everything."""
    server = DraftServer(run_dir, ttl_s=30, ring_bytes=1 << 16)
    server.start()
    assert read_info(run_dir).pid == os.getpid()
    c0 = DraftClient(str(run_dir), engine_id=0)
    c1 = DraftClient(str(run_dir), engine_id=1)
    assert c0.connected and c1.connected
    server.scan(now=0.0)
    assert len(server.connections) == 2
    c0.register_group("g", 0, [50, 51])
    c1.register_group("g", 0, [50, 51])
    c0.register_group("other", 0, [60])
    _pump(server, [c0, c1])
    c0.append("g", "g/0", 0, [1, 2, 3])
    c0.append("g", "g/0", 3, [4])  # coalesced with the previous one into one record
    c0.append("other", "other/0", 0, [9, 9])
    _pump(server, [c0, c1])
    assert c1.store.tokens("g", "g/0") == [1, 2, 3, 4]
    assert "other" not in c1.store.group_ids()
    c1.register_group("other", 0, [60])  # late: backlog
    _pump(server, [c0, c1])
    assert c1.store.tokens("other", "other/0") == [9, 9]
    names = [p.name for p in SHM.glob(f"{PREFIX}{os.getpid()}-*")]
    assert len(names) == 4
    c0.close()
    server.scan(now=1.0)
    assert len(server.connections) == 1
    c1.close()
    server.close()
    assert list(SHM.glob(f"{PREFIX}{os.getpid()}-*")) == []
    assert not (run_dir / INFO_FILE).exists()


def test_client_that_connects_late_resends_its_state(run_dir):
    """A client started before the server works locally, then connects at its next check
    and re-sends its registered groups and own tokens, so siblings elsewhere see them."""
    now = [0.0]
    c0 = DraftClient(str(run_dir), engine_id=0, connect_interval_s=1.0, clock=lambda: now[0])
    assert not c0.connected
    c0.register_group("g", 0, [5])
    c0.append("g", "g/0", 0, [1, 2, 3])
    server = DraftServer(run_dir, ttl_s=30, ring_bytes=1 << 16)
    server.start()
    c0.sync()
    assert not c0.connected  # not time to look yet
    now[0] = 1.0
    c0.sync()
    assert c0.connected
    c1 = DraftClient(str(run_dir), engine_id=1)
    server.scan(now=0.0)
    c1.register_group("g", 0, [5])
    _pump(server, [c0, c1])
    assert c1.store.tokens("g", "g/0") == [1, 2, 3]
    c0.close()
    c1.close()
    server.close()


def test_backlog_is_applied_within_the_per_sync_budget(run_dir):
    """A large backlog is applied over several sync calls, max_apply_tokens at a time."""
    server = DraftServer(run_dir, ttl_s=30, ring_bytes=1 << 16)
    server.start()
    c0 = DraftClient(str(run_dir), engine_id=0)
    c1 = DraftClient(str(run_dir), engine_id=1, max_apply_tokens=100)
    server.scan(now=0.0)
    c0.register_group("g", 0, [5])
    c0.append("g", "g/0", 0, list(range(1000)))
    _pump(server, [c0])
    c1.register_group("g", 0, [5])
    c1.sync()
    server.step(now=0.0)
    c1.sync()
    assert 0 < len(c1.store.tokens("g", "g/0")) <= 100
    for _ in range(12):
        c1.sync()
    assert c1.store.tokens("g", "g/0") == list(range(1000))
    c0.close()
    c1.close()
    server.close()


def test_stale_rings_of_dead_processes_are_swept(tmp_path):
    """Rings naming a dead server or a dead client are removed; live ones and other files
    stay. (A folder of its own: other draft servers on the machine sweep /dev/shm too.)"""
    dead = 2**22 + 12345  # above the default pid_max: never a live pid
    while os.path.exists(f"/proc/{dead}"):
        dead += 1
    live = ring_names(os.getpid(), 0, os.getpid())[0]
    stale_server = ring_names(dead, 0, os.getpid())[0]
    stale_client = ring_names(os.getpid(), 1, dead)[1]
    for name in (live, stale_server, stale_client, "seer-kv-1-2"):
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_rings(tmp_path)
    assert sorted(removed) == sorted([stale_server, stale_client])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, "seer-kv-1-2"])
    assert parse_ring_name(live) == (os.getpid(), 0, os.getpid(), "up")
    assert parse_ring_name("seer-kv-1-2") is None


def test_bad_records_are_counted_and_skipped(run_dir):
    """Garbage on an up ring is logged and skipped; the server keeps serving."""
    server = DraftServer(run_dir, ttl_s=30, ring_bytes=1 << 16)
    server.start()
    c0 = DraftClient(str(run_dir), engine_id=0)
    server.scan(now=0.0)
    c0._up.try_put(b"\x93not msgpack")
    c0._up.try_put(msgspec.msgpack.encode(app("g", "g/0", -1, [1])))  # negative start_pos
    c0.register_group("g", 0, [1])
    c0.append("g", "g/0", 0, [1, 2])
    c0.sync()
    server.step(now=0.0)
    assert server.num_bad_records == 2
    assert server.core.num_tokens("g") == 2
    c0.close()
    server.close()


def test_client_ignores_appends_for_groups_retired_by_a_reset():
    """After a weights reset, tokens still coming for a group of the old version are not
    stored (they were generated by the old policy) until the group is registered again."""
    client = DraftClient(None, engine_id=0)
    client.register_group("g", 1, [9])
    client.append("g", "g/0", 0, [1, 2])
    client.register_group("h", 2, [9])  # new weights
    client.append("g", "g/0", 2, [3])
    client.append("g", "g/1", 0, [4])
    assert "g" not in client.store.group_ids()
    client.register_group("g", 2, [9])
    client.append("g", "g/1", 0, [5])
    assert client.store.tokens("g", "g/1") == [5]


def test_tokens_written_just_before_close_still_reach_siblings(run_dir):
    """An engine that appends and closes at once (its rings are unlinked before the
    server read them) loses nothing: close flushes, and the server drains a vanished
    connection's ring before dropping it."""
    server = DraftServer(run_dir, ttl_s=30, ring_bytes=1 << 16)
    server.start()
    c0 = DraftClient(str(run_dir), engine_id=0)
    c1 = DraftClient(str(run_dir), engine_id=1)
    server.scan(now=0.0)
    c0.register_group("g", 0, [5])
    c1.register_group("g", 0, [5])
    _pump(server, [c0, c1])
    c0.append("g", "g/0", 0, [1, 2, 3])
    c0.close()
    server.scan(now=1.0)
    assert len(server.connections) == 1
    _pump(server, [c1])
    assert c1.store.tokens("g", "g/0") == [1, 2, 3]
    c1.close()
    server.close()
