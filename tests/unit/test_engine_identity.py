"""An engine's id belongs to the process that registered it: bound to its connection (the
ZeroMQ identity of its current session) and to its secret (controlplane/registry.py,
``Registry.expect``/``bind_secret``/``proves``; controlplane/membership.py, ``claim_hello``).
A hello from another connection for an id whose engine registered with a secret is refused
without it, and nothing about the engine changes; with it, the same process takes its id
back (its live session, if any, replaced and its work requeued). The secret is handed to a
spawned engine through a pipe and never logged."""

from __future__ import annotations

import os

import msgspec
from structlog.testing import capture_logs

from seer.config import SeerConfig
from seer.controlplane import supervisor as supervisor_module
from seer.controlplane.membership import claim_hello, spawned_identity
from seer.controlplane.outbox import ToEngine, ToPeer
from seer.controlplane.registry import Registry
from seer.controlplane.state import EngineState
from seer.controlplane.supervisor import Supervisor, secret_pipe
from seer.engines.worker import read_secret
from seer.protocol import JOIN_ENGINE_ID, EngineHeartbeat, EngineLoad, HelloAccepted, HelloRejected
from tests.unit.core_parts import Clock, caps, dispatch, hello, make_core, start_rollout

SECRET = "s3cret-of-the-spawn"


def with_secret(engine_id: int, pid: int, secret: str = "", **fields: object):
    return msgspec.structs.replace(hello(engine_id, pid), secret=secret, **fields)


def heartbeat(engine_id: int) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, load=EngineLoad())


# ---------------------------------------------------------------------------- the registry


def test_the_first_secret_is_kept_and_compared_whole():
    """``bind_secret`` keeps the first secret (a later hello never replaces it), ``expect``
    sets the spawn's; ``proves`` is None without one, True only for the same secret."""
    registry = Registry()
    registry.admit(3, caps(), identity=b"join-a", joined=True)
    assert registry.proves(3, "") is None and registry.proves(3, "x") is None
    registry.bind_secret(3, "first")
    registry.bind_secret(3, "second")
    assert registry.proves(3, "first") is True
    assert registry.proves(3, "second") is False and registry.proves(3, "firs") is False
    assert registry.proves(3, "") is False and registry.proves(3, "first\u00e9") is False
    registry.expect(0, pid=10, now_s=0.0, secret=SECRET)
    assert registry.proves(0, SECRET) is True and registry.proves(0, "") is False


def test_an_engine_is_reached_through_its_current_connection_only():
    """A spawned engine is under no identity until its hello; admitted again under a new
    connection, its previous connection no longer names it."""
    registry = Registry()
    registry.expect(1, pid=10, now_s=0.0, secret=SECRET)
    assert registry.by_identity(b"engine-1") is None and registry.engines[1].identity == b""
    registry.admit(1, caps(), pid=10, identity=b"engine-1.aaaa")
    assert registry.by_identity(b"engine-1.aaaa").engine_id == 1
    registry.lose(1)
    registry.admit(1, caps(), pid=10, identity=b"engine-1.bbbb")
    assert registry.by_identity(b"engine-1.aaaa") is None
    assert registry.by_identity(b"engine-1.bbbb").engine_id == 1 and registry.engines[1].identity == b"engine-1.bbbb"


# ---------------------------------------------------------------------------- the claim, decided


def test_connection_names_of_spawned_engines():
    assert spawned_identity(1, b"engine-1") and spawned_identity(1, b"engine-1.3fa9c0")
    assert not spawned_identity(1, b"engine-12") and not spawned_identity(1, b"engine-1.")
    assert not spawned_identity(1, b"join-abc") and not spawned_identity(1, b"engine-1.a.b")


def test_a_spawned_id_needs_the_spawns_secret_from_its_first_hello_on():
    """Starting (expected with a secret): no or a wrong secret is refused; the spawn's own
    is accepted, from any connection of its name."""
    registry = Registry()
    registry.expect(1, pid=10, now_s=0.0, secret=SECRET)
    missing = claim_hello(registry, b"engine-1", with_secret(1, 10), "cp")
    wrong = claim_hello(registry, b"engine-1.x", with_secret(1, 10, "guess"), "cp")
    assert "engine id 1 belongs to the starting engine 1 (pid 10)" in missing.refusal
    assert "carries no secret" in missing.refusal and "carries the wrong secret" in wrong.refusal
    ok = claim_hello(registry, b"engine-1.x", with_secret(1, 10, SECRET), "cp")
    assert ok.refusal == "" and ok.engine_id == 1 and not ok.replaces_session


def test_a_live_engines_id_is_refused_to_another_connection_without_its_secret():
    """Ready on its connection: another connection is refused without the secret (or with
    a wrong one) whatever pid it claims; with it, it replaces the session; its own
    connection is its own; an engine that registered without a secret cannot be replaced."""
    registry = Registry()
    registry.expect(1, pid=10, now_s=0.0, secret=SECRET)
    registry.admit(1, caps(), pid=10, identity=b"engine-1.live")
    for identity, secret in ((b"engine-1", ""), (b"engine-1", "guess"), (b"engine-1.other", "")):
        claim = claim_hello(registry, identity, with_secret(1, 10, secret), "cp")
        assert "belongs to the ready engine 1 (pid 10), registered on another connection" in claim.refusal
    back = claim_hello(registry, b"engine-1.new", with_secret(1, 10, SECRET), "cp")
    assert back.refusal == "" and back.replaces_session
    assert claim_hello(registry, b"engine-1.live", with_secret(1, 10), "cp").refusal == ""
    other_pid = claim_hello(registry, b"engine-1.live", with_secret(1, 11), "cp")
    assert "taken by the ready engine of pid 10" in other_pid.refusal
    registry.admit(2, caps(), pid=20, identity=b"engine-2")  # no secret on record
    unprovable = claim_hello(registry, b"engine-2.x", with_secret(2, 20, "any"), "cp")
    assert "registered without a secret" in unprovable.refusal


def test_a_lost_engine_takes_its_id_back_with_its_secret_only():
    registry = Registry()
    registry.expect(1, pid=10, now_s=0.0, secret=SECRET)
    registry.admit(1, caps(), pid=10, identity=b"engine-1.old")
    registry.lose(1)
    thief = claim_hello(registry, b"engine-1.new", with_secret(1, 10, "guess"), "cp")
    assert "the lost engine 1" in thief.refusal
    back = claim_hello(registry, b"engine-1.new", with_secret(1, 10, SECRET), "cp")
    assert back.refusal == "" and not back.replaces_session


def test_an_id_nobody_holds_needs_a_connection_of_its_name():
    registry = Registry()
    assert claim_hello(registry, b"engine-5.x", with_secret(5, 1), "cp").refusal == ""
    assert "expected engine-5[.<connection>]" in claim_hello(registry, b"fuzz-1", with_secret(5, 1), "cp").refusal


def test_a_joiner_claims_its_id_only_from_the_control_plane_that_gave_it():
    """A joiner names its previous id and control plane: another control plane, an
    unknown, spawned or stopped record means a fresh id; this control plane's joined
    record needs the joiner's secret."""
    registry = Registry()
    registry.admit(0, caps(), pid=5, identity=b"engine-0.a")
    registry.admit(3, caps(), pid=7, identity=b"join-old", joined=True)
    registry.bind_secret(3, "joiner")
    registry.lose(3)

    def claim(previous: int, control_plane: str, secret: str):
        return claim_hello(registry, b"join-new", with_secret(JOIN_ENGINE_ID, 7, secret, previous_engine_id=previous,
                                                            previous_control_plane=control_plane), "cp")

    for fresh in (claim(3, "other", "joiner"), claim(3, "", "joiner"), claim(9, "cp", "joiner"),
                  claim(0, "cp", "joiner"), claim(JOIN_ENGINE_ID, "cp", "joiner")):
        assert (fresh.engine_id, fresh.joined, fresh.refusal) == (JOIN_ENGINE_ID, True, "")
    assert "carries the wrong secret" in claim(3, "cp", "guess").refusal
    assert "carries no secret" in claim(3, "cp", "").refusal
    back = claim(3, "cp", "joiner")
    assert (back.engine_id, back.joined, back.refusal, back.replaces_session) == (3, True, "", False)
    registry.stop(0)
    registry.admit(3, caps(), pid=7, identity=b"join-mid", joined=True)
    registry.stop(3)
    assert claim(3, "cp", "joiner").engine_id == JOIN_ENGINE_ID


# ---------------------------------------------------------------------------- the core, end to end


def test_an_impostor_hello_changes_nothing_for_the_live_engine(tmp_path):
    """Engine 0 spawned with a secret runs chunks; a hello for id 0 from another connection
    without or with a wrong secret is refused to that connection (``engine_claim_refused``,
    the secret never logged); engine 0 keeps its connection, its chunks and its state."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    core.registry.expect(0, pid=100, now_s=0.0, secret=SECRET)
    assert core.hello(b"engine-0.real", with_secret(0, 100, SECRET)).admitted
    start_rollout(core, group_size=2)
    sent = dispatch(core, clock)
    assert {d.engine_id for d in sent} == {0}
    with capture_logs() as logs:
        for secret in ("", "guess-xyz"):
            answer = core.hello(b"engine-0", with_secret(0, 100, secret))
            [refusal] = answer.sends
            assert not answer.admitted and isinstance(refusal, ToPeer) and refusal.identity == b"engine-0"
            assert isinstance(refusal.msg, HelloRejected) and not refusal.msg.say_hello_again
        asked = core.membership.refuse_sender(b"engine-0", heartbeat(0))
    assert asked is not None and asked.say_hello_again
    view = core.registry.engines[0]
    assert view.state is EngineState.READY and view.identity == b"engine-0.real" and view.num_inflight == len(sent)
    assert core.membership.refuse_sender(b"engine-0.real", heartbeat(0)) is None
    assert [(e["event"], e.get("secret_given")) for e in logs] == [
        ("engine_claim_refused", False), ("engine_claim_refused", True), ("unregistered_engine_message", None)]
    assert not any(SECRET in repr(e) or "guess-xyz" in repr(e) for e in logs)


def test_a_lost_engine_comes_back_on_a_new_connection_with_its_secret(tmp_path):
    """Declared lost, the spawned engine says hello from a new connection with its secret:
    ready again as the same id; its old connection is no longer heard."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    core.registry.expect(1, pid=101, now_s=0.0, secret=SECRET)
    assert core.hello(b"engine-1.old", with_secret(1, 101, SECRET)).admitted
    core.health.lose_engine(1, "silent for more than 30 s")
    assert not core.hello(b"engine-1.thief", with_secret(1, 101, "guess")).admitted
    answer = core.hello(b"engine-1.new", with_secret(1, 101, SECRET))
    assert answer.admitted and answer.sends == [ToEngine(1, HelloAccepted(engine_id=1))]
    assert core.registry.engines[1].state is EngineState.READY and core.registry.engines[1].identity == b"engine-1.new"
    assert core.membership.refuse_sender(b"engine-1.old", heartbeat(1)) is not None
    assert core.membership.refuse_sender(b"engine-1.new", heartbeat(1)) is None
    assert core.registry.engines[1].hello is None


def test_a_joiner_that_reconnects_while_live_replaces_its_session_and_its_work_is_requeued(tmp_path):
    """The only engine, a joiner, registers again from a new connection with its secret
    while this control plane still counts it live with chunks in flight (it heard nothing
    for a while and dropped them): the same id is admitted again, its chunks requeued and
    their clocks dropped, and no rollout fails (no ``no_engines``: it is back at once)."""
    clock = Clock()
    core = make_core(tmp_path, clock, count=0)
    first = core.hello(b"join-a", with_secret(JOIN_ENGINE_ID, 7, "joiner"))
    [accepted] = first.sends
    assert first.admitted and isinstance(accepted.msg, HelloAccepted) and accepted.msg.engine_id == 0
    control_plane = accepted.msg.control_plane
    assert control_plane == core.membership.control_plane
    start_rollout(core, group_size=2)
    sent = dispatch(core, clock)
    assert len(sent) == 2 and len(core.health.deadlines) == 2
    with capture_logs() as logs:
        again = core.hello(b"join-b", with_secret(JOIN_ENGINE_ID, 7, "joiner", previous_engine_id=0,
                                                  previous_control_plane=control_plane))
    assert again.admitted and again.sends == [ToEngine(0, HelloAccepted(engine_id=0, control_plane=control_plane))]
    assert [e["event"] for e in logs] == ["engine_session_replaced", "engine_ready"]
    assert logs[0]["num_requeued"] == 2 and not any("joiner" in repr(e) for e in logs)
    view = core.registry.engines[0]
    assert view.state is EngineState.READY and view.identity == b"join-b" and view.joined and not view.inflight
    assert len(core.health.deadlines) == 0 and core.scheduler.num_waiting() == 2
    assert core.clients.sessions and not core.scheduler.rollouts["r"].done  # waiting, not failed
    assert {d.engine_id for d in dispatch(core, clock)} == {0}
    assert sorted(core.registry.engines) == [0]


# ---------------------------------------------------------------------------- the secret's way to the engine


def test_the_spawn_secret_travels_through_a_pipe_not_the_command_line_or_environment(tmp_path, monkeypatch):
    """The supervisor writes a fresh secret per spawn into a pipe the engine inherits
    (``--secret-fd``): the command line and environment do not hold it, the engine reads it
    whole, and the record's repr does not show it."""
    seen: list[dict] = []

    class FakePopen:
        pid = 424242

        def __init__(self, cmd, env, pass_fds, **kwargs) -> None:
            fd = int(cmd[cmd.index("--secret-fd") + 1])
            assert pass_fds == (fd,)
            seen.append(dict(cmd=cmd, env=env, secret=read_secret(os.dup(fd))))

        def poll(self) -> None:
            return None

    monkeypatch.setattr(supervisor_module.subprocess, "Popen", FakePopen)
    supervisor = Supervisor(SeerConfig(), tmp_path, "ipc://x", "")
    procs = [supervisor.spawn(0, "0"), supervisor.spawn(1, "1")]
    assert [s["secret"] for s in seen] == [p.secret for p in procs]
    assert procs[0].secret != procs[1].secret and len(procs[0].secret) >= 32
    for proc, spawn in zip(procs, seen, strict=True):
        assert not any(proc.secret in arg for arg in spawn["cmd"])
        assert not any(proc.secret in value for value in spawn["env"].values())
        assert proc.secret not in repr(proc)


def test_a_secret_pipe_reads_back_whole_and_is_closed_after():
    fd = secret_pipe(SECRET)
    assert read_secret(fd) == SECRET
    try:
        os.fstat(fd)
    except OSError:
        pass
    else:
        raise AssertionError("the pipe was not closed")
