"""A chunk decided before its rollout was cancelled, or before its engine was lost, is not
sent: ``_deliver`` gives the loop back between slices of a large outbox, so a cancel can
land while the rest of a 2,048-chunk dispatch waits (controlplane/server.py, ``_stale``).
Sent anyway, the engine would run it after its AbortTasks, and the waiting outbox kept the
cancelled rollout alive past the memory release."""

from __future__ import annotations

from seer.controlplane.server import _stale
from tests.unit.core_parts import Clock, admit, dispatch, make_core, start_rollout


def test_a_dispatch_is_stale_once_its_rollout_is_cancelled_or_its_engine_lost(tmp_path):
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    admit(core, 1)
    start_rollout(core, "a", num_prompts=2, group_size=2)
    start_rollout(core, "b", num_prompts=2, group_size=2)
    sent = dispatch(core, clock)
    assert sent and not any(_stale(d) for d in sent)
    core.clients.cancel("a", "cancelled")
    assert all(_stale(d) for d in sent if d.request.group.rollout.rollout_id == "a")
    lost = sent[-1].engine_id
    core.health.lose_engine(lost, "test")
    for d in sent:
        if d.request.group.rollout.rollout_id == "b":
            assert _stale(d) == (d.engine_id == lost)
    assert not _stale("not a dispatch")
