"""``Scheduler.schedule(limit)``: the server places a burst a slice at a time (the event
loop runs between slices), and the slices place the same work as one call would."""

from __future__ import annotations

import pytest

from seer.config import SchedulerConfig
from seer.controlplane.intake import build_rollout
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import Prompt, RolloutRequest, SamplingParams
from tests.unit.test_scheduler import LIMITS, FakeClock, caps, finish, prompt_ids

POLICIES = ["context", "divided", "request", "group", "sticky"]


def scheduler(policy: str, num_prompts: int = 60, group_size: int = 8) -> Scheduler:
    sched = Scheduler(SchedulerConfig(policy=policy), FakeClock())
    for engine_id in (0, 1, 2):
        sched.engine_joined(engine_id, caps())
    req = RolloutRequest(call_id="c", rollout_id="r", group_size=group_size, sampling=SamplingParams(max_tokens=64),
                         prompts=[Prompt(prompt_token_ids=prompt_ids(i)) for i in range(num_prompts)])
    sched.submit(build_rollout(req, ByteTokenizer(), LIMITS, policy, 0.0))
    return sched


def placed(dispatches) -> list[tuple[str, int, int]]:
    return [(d.request.request_id, d.engine_id, d.task.sampling.max_tokens) for d in dispatches]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_burst_placed_in_slices_is_placed_as_in_one_call(policy):
    whole = scheduler(policy)
    at_once = placed(whole.schedule())
    assert not whole.cut_short
    assert len(at_once) == 480  # every sample fits: all of them are placed

    sliced, slices = scheduler(policy), []
    while True:
        slices.append(placed(sliced.schedule(limit=50)))
        if not sliced.cut_short:
            break
    # A whole-group policy ends the group it is in (8 samples), the others stop at the limit.
    assert all(len(s) <= 50 + (7 if policy == "group" else 0) for s in slices)
    assert len(slices) >= 480 // 57
    assert [p for s in slices for p in s] == at_once
    assert whole.num_waiting() == sliced.num_waiting() == 0


def test_held_assignments_count_against_the_limit():
    """Assignments held for room on a full engine go a slice at a time too."""
    sched = Scheduler(SchedulerConfig(policy="request", max_chunks_per_engine=4), FakeClock())
    sched.engine_joined(0, caps())
    req = RolloutRequest(call_id="c", rollout_id="r", group_size=4, sampling=SamplingParams(max_tokens=8),
                         prompts=[Prompt(prompt_token_ids=prompt_ids(i)) for i in range(5)])
    sched.submit(build_rollout(req, ByteTokenizer(), LIMITS, "request", 0.0))
    first = sched.schedule()
    assert len(first) == 4  # the engine is full: 16 assignments wait, held for it
    assert sched.num_waiting() == 16
    for d in first:  # its four chunks end: room for four again
        finish(sched, d)
    assert len(sched.schedule(limit=3)) == 3 and sched.cut_short
    assert len(sched.schedule(limit=3)) == 1 and not sched.cut_short
