"""No single request stalls or leaks in the control plane: intake fails fast and pauses
between batches, simulation-only policies are refused up front, and the loop's own
stalls are never held against an engine (issue 14, defects 1 and 3)."""

from __future__ import annotations

import pytest

import seer.controlplane.intake as intake
from seer.config import SchedulerConfig
from seer.controlplane.intake import Limits, RequestRejected, build_rollout, intake_steps
from seer.controlplane.outbox import ToClient
from seer.controlplane.registry import Registry
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import ErrorReply, Prompt, RolloutAccepted, RolloutRequest, SamplingParams
from tests.unit.test_outbox import Plane, hello

LIMITS = Limits(max_group_size=64, max_prompts=100_000, max_model_len=512, vocab_size=ByteTokenizer.vocab_size)


def big_request(num_prompts: int, group_size: int, bad_last: bool = False, rollout_id: str = "big",
                policy: str | None = None) -> RolloutRequest:
    prompts = [Prompt(prompt_token_ids=[5, 6, 7]) for _ in range(num_prompts)]
    if bad_last:
        prompts[-1] = Prompt(prompt_token_ids=[5, 6, 99_999])
    return RolloutRequest(call_id="call", rollout_id=rollout_id, prompts=prompts, group_size=group_size,
                          sampling=SamplingParams(max_tokens=1), policy=policy)


def test_a_bad_last_prompt_is_refused_before_any_request_is_built(monkeypatch):
    """30,000 prompts x G=64 whose last prompt has an out-of-vocabulary id: refused with
    bad_token_ids naming prompt 29999, and not one Request was allocated first."""
    built = []
    real = intake.Request
    monkeypatch.setattr(intake, "Request", lambda *a, **k: built.append(1) or real(*a, **k))
    with pytest.raises(RequestRejected) as info:
        build_rollout(big_request(30_000, 64, bad_last=True), ByteTokenizer(), LIMITS, "group", 0.0)
    assert info.value.code == "bad_token_ids" and "prompt 29999" in str(info.value)
    assert built == []


def test_intake_pauses_between_batches_and_builds_everything():
    """intake_steps yields about once per batch of prompts checked and of samples built,
    and returns the whole rollout."""
    steps = intake_steps(big_request(1000, 4), ByteTokenizer(), LIMITS, "group", 0.0, batch=100)
    pauses = 0
    while True:
        try:
            next(steps)
            pauses += 1
        except StopIteration as done:
            rollout = done.value
            break
    assert pauses >= 10 + 40 - 1
    assert rollout.num_samples == 4000 and len(rollout.groups) == 1000


def test_samples_without_a_seed_share_one_sampling_object():
    """Without a seed no per-sample copy of the sampling parameters is made."""
    rollout = build_rollout(big_request(10, 8), ByteTokenizer(), LIMITS, "group", 0.0)
    assert len({id(r.sampling) for g in rollout.groups for r in g.requests}) == 1


@pytest.mark.parametrize("policy", ["oracle", "oracle-order"])
def test_an_oracle_without_true_lengths_is_refused_up_front_and_leaves_no_rollout(tmp_path, policy):
    """An oracle policy without true_lengths is refused with needs_true_lengths, naming what
    to send or use instead; no rollout and no session stay behind."""
    plane = Plane(tmp_path)
    plane.membership.on_hello(b"engine-0", hello(0, 10), plane.weights)
    (send,) = plane.clients.on_request(b"client", big_request(2, 2, policy=policy))
    assert isinstance(send, ToClient) and isinstance(send.msg, ErrorReply)
    assert send.msg.code == "needs_true_lengths"
    assert "true_lengths" in send.msg.message and "context" in send.msg.message
    assert not plane.scheduler.rollouts and not plane.clients.sessions and not plane.clients.pending
    assert plane.scheduler.num_waiting() == 0


def test_a_policy_that_refuses_a_request_leaves_nothing_in_the_scheduler():
    """Scheduler.submit with a rollout its policy cannot order (oracle without true
    lengths) raises and registers nothing."""
    sched = Scheduler(SchedulerConfig(), lambda: 0.0)
    rollout = build_rollout(big_request(3, 2), ByteTokenizer(), LIMITS, "group", 0.0)
    rollout.policy = "oracle"
    with pytest.raises(ValueError):
        sched.submit(rollout)
    assert not sched.rollouts and sched.num_waiting() == 0


def test_the_client_is_told_accepted_before_any_request_can_be_scheduled(tmp_path):
    """The first pause after building hands out RolloutAccepted while only the first batch
    of requests is enqueued; the rest follow at later pauses."""
    plane = Plane(tmp_path)
    plane.membership.on_hello(b"engine-0", hello(0, 10), plane.weights)
    steps = plane.clients.intake(b"client", big_request(50, 4), batch=20)
    sent = []
    while True:
        try:
            out = next(steps)
        except StopIteration as done:
            sent += done.value
            break
        if out:
            assert isinstance(out[0].msg, RolloutAccepted)
            assert plane.scheduler.num_waiting() == 20
        sent += out
    assert [type(s.msg) for s in sent] == [RolloutAccepted]
    assert plane.scheduler.num_waiting() == 200


def test_a_rollout_id_being_taken_in_is_reserved(tmp_path):
    """While a rollout is being taken in, a second request with its id is a duplicate."""
    plane = Plane(tmp_path)
    plane.membership.on_hello(b"engine-0", hello(0, 10), plane.weights)
    steps = plane.clients.intake(b"client", big_request(50, 4), batch=20)
    next(steps)
    (send,) = plane.clients.on_request(b"other", big_request(1, 1))
    assert send.msg.code == "duplicate_rollout"


def test_a_rollout_cancelled_while_taken_in_stops_being_enqueued(tmp_path):
    """Cancelling a rollout between intake batches leaves no request of it waiting."""
    plane = Plane(tmp_path)
    plane.membership.on_hello(b"engine-0", hello(0, 10), plane.weights)
    steps = plane.clients.intake(b"client", big_request(50, 4), batch=20)
    while not plane.scheduler.rollouts:
        next(steps)
    plane.clients.cancel("big", "cancelled")
    for _ in steps:
        pass
    assert plane.scheduler.num_waiting() == 0 and not plane.scheduler.rollouts


def test_an_engine_is_not_silent_because_the_control_plane_loop_stalled():
    """An engine heard just before a 40 s stall of the control plane's own loop is not
    judged silent right after it (timeout 30 s); one silent before the stall still is."""
    registry = Registry(heartbeat_timeout_s=30.0)
    caps = hello(0, 10).capabilities
    registry.admit(0, caps, now_s=100.0)
    registry.admit(1, caps, now_s=60.0)
    registry.loop_stalled(40.0, now_s=140.5)
    assert registry.silent(140.5) == [1]
