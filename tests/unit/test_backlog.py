"""Accepted rollouts wait for the admission window (controlplane/backlog.py): a burst is
taken into the scheduler at the pace its samples finish, clients take turns, and a rollout
waiting in the backlog holds no engine, is not timed out, and can be cancelled or failed."""

from __future__ import annotations

import pytest

import seer.controlplane.backlog as backlog
from seer.controlplane.backlog import ADMIT_LOW_WATER, Backlog, Parked, may_admit
from seer.controlplane.intake import Checked
from seer.controlplane.intake import run_steps
from seer.controlplane.outbox import ToClient
from seer.protocol import ErrorReply, Prompt, RolloutAccepted, RolloutRequest, SamplingParams
from tests.unit.chunks import finished
from tests.unit.core_parts import CLIENT, Clock, admit, dispatch, make_core

WINDOW_PER_ENGINE = 4  # samples per ready engine, for these tests


def request(rollout_id: str, group_size: int = 2, num_prompts: int = 1) -> RolloutRequest:
    return RolloutRequest(call_id=f"call-{rollout_id}", rollout_id=rollout_id, group_size=group_size,
                          prompts=[Prompt(prompt_token_ids=[5, 6, 7 + i]) for i in range(num_prompts)],
                          sampling=SamplingParams(max_tokens=4))


def parked(rollout_id: str, identity: bytes = b"a") -> Parked:
    return Parked(identity, request(rollout_id), "group", Checked(["0"], [[5, 6, 7]]))


@pytest.fixture
def core(tmp_path, monkeypatch):
    """One ready engine, a window of 4 samples (2 rollouts of G=2), the ``group`` policy."""
    monkeypatch.setattr(backlog, "ADMIT_SAMPLES_PER_ENGINE", WINDOW_PER_ENGINE)
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    core.clock_ = clock
    return core


def take_in(core, rollout_id: str, identity: bytes = CLIENT, **kw) -> list:
    """A request arrives (``intake`` then the server's admission), as the server runs them."""
    sent, last = run_steps(core.clients.intake(identity, request(rollout_id, **kw)))
    return [s for out in sent for s in out] + last


def admit_parked(core, engines_expected: bool = False) -> list:
    sent, last = run_steps(core.clients.admit_steps(engines_expected))
    return [s for out in sent for s in out] + last


def finish_all(core) -> list:
    """Dispatch what is waiting and finish every chunk in flight (one chunk per sample)."""
    out = []
    for d in dispatch(core, core.clock_):
        out += core.chunk_finished(finished(d.engine_id, d.task.task_id, [9, 9], [-0.1, -0.1], "stop"),
                                   core.clock_.now)
    return out


def test_backlog_clients_take_turns_and_a_removed_rollout_is_skipped():
    b = Backlog()
    for rollout_id in ("a1", "a2", "a3"):
        b.park(parked(rollout_id, b"a"))
    b.park(parked("b1", b"b"))
    assert len(b) == 4 and b.num_samples == 8 and "a2" in b
    assert b.remove("a2").req.rollout_id == "a2" and "a2" not in b and b.num_samples == 6
    b.park(parked("a2", b"a"))  # the same id again, queued behind a3
    assert [b.pop().req.rollout_id for _ in range(4)] == ["a1", "b1", "a3", "a2"]
    assert b.pop() is None and len(b) == 0 and b.num_samples == 0


def test_admission_waits_for_the_low_water_mark_then_fills_the_window():
    assert may_admit(0, 8, admitting=False)
    assert not may_admit(7, 8, admitting=False) and may_admit(7, 8, admitting=True)
    assert may_admit(int(ADMIT_LOW_WATER * 8) - 1, 8, admitting=False)
    assert not may_admit(8, 8, admitting=True)


def test_a_burst_waits_in_the_backlog_and_enters_as_samples_finish(core):
    """Five rollouts of 2 samples against a window of 4: each is accepted at once, two enter
    the scheduler, three wait (reserved ids, pending); as samples finish the rest enter,
    and every rollout completes once."""
    sent = []
    for k in range(5):
        out = take_in(core, f"r{k}")
        assert [type(s.msg) for s in out] == [RolloutAccepted]
        sent += out
    assert set(core.scheduler.rollouts) == {"r0", "r1"} and core.clients.open_samples == 4
    assert core.clients.backlog.ids() == ["r2", "r3", "r4"] and {"r2", "r3", "r4"} <= core.clients.pending
    assert take_in(core, "r3")[0].msg.code == "duplicate_rollout"
    completed = []
    for _ in range(10):
        completed += [s.msg.rollout_id for s in finish_all(core) if type(s.msg).__name__ == "RolloutCompleted"]
        admit_parked(core)
        if not core.clients.backlog and not core.scheduler.rollouts:
            break
        assert core.clients.open_samples <= 4
    assert sorted(completed) == [f"r{k}" for k in range(5)]
    assert core.clients.open_samples == 0 and not core.clients.open and not core.clients.pending


def test_clients_take_turns_at_admission(core):
    """A second client's rollout, queued behind the first client's, is admitted at the next turn."""
    for k in range(4):
        take_in(core, f"a{k}", b"a")
    take_in(core, "b0", b"b")
    finish_all(core)
    admit_parked(core)
    assert set(core.scheduler.rollouts) == {"a2", "b0"}


def test_a_parked_rollout_is_not_timed_out_until_admitted(core):
    """Its client sends no heartbeat: the rollout waiting in the backlog is not lost, one
    admitted is, counted from its admission."""
    limit = core.config.server.client_timeout_s
    for k in range(3):
        take_in(core, f"r{k}")
    core.clock_.now = limit + 1
    assert sorted(core.clients.timed_out(core.clock_.now)) == ["r0", "r1"]
    core.clients.cancel("r0", "client_lost")
    core.clients.cancel("r1", "client_lost")
    admit_parked(core)
    assert "r2" in core.scheduler.rollouts and core.clients.timed_out(core.clock_.now) == []
    assert core.clients.timed_out(2 * limit + 2) == ["r2"]


def test_a_parked_rollout_can_be_cancelled_or_failed(core):
    for k in range(4):
        take_in(core, f"r{k}")
    assert core.clients.cancel("r2", "cancelled") == []  # nothing ran: nothing to abort
    (reply,) = core.clients.fail("r3", "shutting_down", "bye")
    assert isinstance(reply, ToClient) and reply.msg.code == "shutting_down"
    assert not core.clients.backlog and "r2" not in core.clients.sessions and not {"r2", "r3"} & core.clients.pending


def test_an_admitted_rollout_cancelled_or_failed_leaves_the_window_and_the_next_enters(core):
    """Cancelled or failed mid-run (its chunks out), an admitted rollout's unfinished samples
    leave the window before it is taken apart (``MemoryRelease.dismantle``), so the rollouts
    parked behind it enter; with the window left full the backlog would wait for good."""
    for k in range(4):
        take_in(core, f"r{k}")
    assert dispatch(core, core.clock_) and core.clients.open_samples == 4
    assert core.clients.cancel("r0", "cancelled") and core.clients.fail("r1", "internal_error", "boom")
    assert core.clients.open_samples == 0 and core.memory.dismantled_samples == 4
    admit_parked(core)
    assert set(core.scheduler.rollouts) == {"r2", "r3"} and core.clients.open_samples == 4


def test_parked_rollouts_fail_with_no_engines_once_none_can_come(core):
    for k in range(3):
        take_in(core, f"r{k}")
    core.health.lose_engine(0, "test")
    assert admit_parked(core, engines_expected=True) == [] and len(core.clients.backlog) == 1
    (reply,) = admit_parked(core, engines_expected=False)
    assert isinstance(reply.msg, ErrorReply) and reply.msg.code == "no_engines" and not core.clients.backlog


def test_a_parked_rollout_blocks_a_weights_update_and_keeps_its_memory_live(core, tmp_path):
    """Waiting rollouts are open sessions (an update is refused) and are live for the memory
    release (their samples are not counted as ended)."""
    for k in range(3):
        take_in(core, f"r{k}")
    from seer.protocol import UpdateWeightsRequest

    (refusal,) = core.update_weights(CLIENT, UpdateWeightsRequest(call_id="w", path=str(tmp_path)))
    assert isinstance(refusal.msg, ErrorReply)
    core.memory.ends.started("r2", 2)
    core.release_memory()
    assert "r2" in core.memory.ends


def test_a_rollout_the_scheduler_refuses_at_admission_is_answered_and_frees_the_window(core, monkeypatch):
    """An error while its requests are enqueued: the client gets an internal_error, and
    neither its session nor its samples stay behind."""
    def refuse(rollout, batch):  # noqa: ANN001
        raise ValueError("no")
        yield

    monkeypatch.setattr(core.scheduler, "submit_steps", refuse)
    out = take_in(core, "r0")
    assert [type(s.msg) for s in out] == [RolloutAccepted, ErrorReply] and out[1].msg.code == "internal_error"
    assert core.clients.open_samples == 0 and not core.clients.sessions and not core.clients.pending
