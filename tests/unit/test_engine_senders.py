"""Every engine message but a hello must come from the engine it names, registered and
not declared lost (controlplane/membership.py, ``Membership.refuse_sender``); any other
sender is asked to say hello again and its message is not handled."""

from __future__ import annotations

from structlog.testing import capture_logs

from seer.protocol import ChunkFailed, EngineHeartbeat, EngineLoad
from tests.unit.core_parts import Clock, admit, make_core


def heartbeat(engine_id: int) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, load=EngineLoad())


def test_the_registered_engine_is_heard(tmp_path):
    """The identity an engine registered under, with its own id: no refusal."""
    core = make_core(tmp_path, Clock())
    admit(core, 0)
    assert core.membership.refuse_sender(b"engine-0", heartbeat(0)) is None


def test_an_unknown_identity_or_another_engines_id_is_asked_to_say_hello_again(tmp_path):
    """A peer this control plane never registered (it outlived a previous one), or one
    that names another engine's id: refused, asked to say hello again."""
    core = make_core(tmp_path, Clock())
    admit(core, 0)
    admit(core, 1)
    with capture_logs() as logs:
        ghost = core.membership.refuse_sender(b"engine-7", heartbeat(7))
        other = core.membership.refuse_sender(b"engine-0", ChunkFailed(engine_id=1, task_id=3, error="x"))
    assert ghost is not None and ghost.say_hello_again and "no engine registered as b'engine-7'" in ghost.reason
    assert other is not None and other.say_hello_again
    assert [(e["event"], e["message"]) for e in logs] == [("unregistered_engine_message", "EngineHeartbeat"),
                                                          ("unregistered_engine_message", "ChunkFailed")]


def test_an_engine_declared_lost_is_asked_to_say_hello_again_naming_why(tmp_path):
    """Its work went elsewhere: what it sends is stale; the refusal names the loss."""
    core = make_core(tmp_path, Clock())
    admit(core, 0)
    admit(core, 1)
    core.health.lose_engine(0, "silent for more than 30 s")
    with capture_logs() as logs:
        refusal = core.membership.refuse_sender(b"engine-0", heartbeat(0))
    assert refusal is not None and refusal.say_hello_again
    assert "engine 0 was declared lost (silent for more than 30 s)" in refusal.reason
    assert [(e["event"], e["engine_id"], e["pid"]) for e in logs] == [("lost_engine_heard", 0, 100)]
