"""The pure scheduler core driven by hand, with the ``group`` baseline policy.

No sockets, no wall clock: a fake clock is injected and engines are described by
hand-built ``EngineCapabilities``. Rollouts are built by the real intake code from
explicit prompt token ids, so request ids, group ids and seeds are the production ones.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from seer.controlplane.intake import Limits, build_rollout
from seer.config import SchedulerConfig
from seer.controlplane.scheduler import Abort, Dispatch, Scheduler
from seer.controlplane.state import EngineState, RequestState, Rollout, derive_sample_seed
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import (
    ChunkTask,
    EngineCapabilities,
    EngineLoad,
    Prompt,
    RolloutRequest,
    SamplingParams,
    unpack_token_ids,
)
from tests.unit.chunks import finished

VOCAB = ByteTokenizer.vocab_size
MAX_MODEL_LEN = 4096
LIMITS = Limits(max_group_size=64, max_prompts=10_000, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB)


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


def caps(max_model_len: int = MAX_MODEL_LEN) -> EngineCapabilities:
    return EngineCapabilities(
        backend="sim",
        model="test-model",
        dtype="float32",
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        kv_capacity_tokens=100_000,
        block_size=16,
    )


def prompt_ids(index: int) -> list[int]:
    return [10 + index % 200, 20, 30 + index % 100, 40]


def make_rollout(
    rollout_id: str, num_prompts: int, group_size: int, *, max_tokens: int = 16, now: float = 0.0, **sampling
) -> Rollout:
    req = RolloutRequest(
        call_id=f"call-{rollout_id}",
        rollout_id=rollout_id,
        prompts=[Prompt(prompt_token_ids=prompt_ids(i)) for i in range(num_prompts)],
        group_size=group_size,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
    )
    return build_rollout(req, ByteTokenizer(), LIMITS, "group", now)


def make_scheduler(engine_ids=(0, 1), clock: FakeClock | None = None, max_model_len: int = MAX_MODEL_LEN) -> Scheduler:
    sched = Scheduler(SchedulerConfig(), clock or FakeClock())
    for engine_id in engine_ids:
        sched.engine_joined(engine_id, caps(max_model_len))
    return sched


def finish(sched: Scheduler, d: Dispatch, n: int | None = None, reason: str = "length"):
    """Report ``d``'s chunk as finished with ``n`` tokens (default: its whole budget)."""
    n = d.task.sampling.max_tokens if n is None else n
    tokens = [50 + (k % 100) for k in range(n)]
    logprobs = [-0.25 * (k % 4) for k in range(n)]
    return sched.chunk_finished(finished(d.engine_id, d.task.task_id, tokens, logprobs, reason))


def all_requests(rollout: Rollout):
    return [r for g in rollout.groups for r in g.requests]


# ---------------------------------------------------------------------------- dispatch


def test_whole_groups_round_robin_over_live_engines_with_full_budget():
    """Each group goes whole to one engine, groups dealt round-robin (engines by id) in prompt order, full max_tokens."""
    sched = make_scheduler(engine_ids=(5, 2))  # joined out of order: the policy sees them sorted by id
    rollout = make_rollout("r", num_prompts=5, group_size=3, max_tokens=16)
    sched.submit(rollout)

    dispatches = sched.schedule()

    assert len(dispatches) == 15
    assert [d.request.request_id for d in dispatches] == [f"r/{g}/{j}" for g in range(5) for j in range(3)]
    expected_engine = {0: 2, 1: 5, 2: 2, 3: 5, 4: 2}
    for d in dispatches:
        assert d.engine_id == expected_engine[d.request.group.group_index]
        assert d.request.engine_id == d.engine_id
        assert d.request.state is RequestState.RUNNING
        assert d.task.sampling.max_tokens == 16
        assert d.task.task_id in sched.engines[d.engine_id].inflight
    assert sched.num_waiting() == 0
    assert sched.schedule() == []  # nothing left to dispatch


def test_every_request_finishes_exactly_once_and_task_ids_are_never_reused():
    """Driving a rollout to completion finishes each sample once; a second report of a task is ignored."""
    clock = FakeClock()
    sched = make_scheduler(engine_ids=(0, 1, 2), clock=clock)
    rollout = make_rollout("r", num_prompts=4, group_size=3, max_tokens=8)
    sched.submit(rollout)
    dispatches = sched.schedule()
    assert len(dispatches) == 12

    finished = []
    for d in dispatches:
        clock.advance(1.0)
        done = finish(sched, d, reason="length")
        assert done is not None and done.sample_finished and not done.requeued
        finished.append(done.request.request_id)
        assert finish(sched, d, reason="length") is None  # the same task again: stale

    assert sorted(finished) == sorted(r.request_id for r in all_requests(rollout))
    assert len(set(finished)) == 12
    task_ids = [d.task.task_id for d in dispatches]
    assert len(set(task_ids)) == len(task_ids) == 12
    assert rollout.done and rollout.num_samples_done == 12
    assert all(r.state is RequestState.FINISHED for r in all_requests(rollout))

    # A later rollout never gets an old task id.
    second = make_rollout("r2", num_prompts=2, group_size=2)
    sched.submit(second)
    later = sched.schedule()
    assert len(later) == 4
    assert min(d.task.task_id for d in later) > max(task_ids)


def test_group_and_rollout_finished_reported_exactly_at_their_last_sample():
    """group_finished is set exactly on a group's last sample, rollout_finished exactly on the last group's."""
    sched = make_scheduler(engine_ids=(0, 1))
    rollout = make_rollout("r", num_prompts=3, group_size=2)
    sched.submit(rollout)
    by_id = {d.request.request_id: d for d in sched.schedule()}
    assert len(by_id) == 6

    order = ["r/1/0", "r/0/0", "r/2/1", "r/1/1", "r/0/1", "r/2/0"]
    # group 1 completes at step 3, group 0 at step 4, group 2 (the last) at step 5
    results = [finish(sched, by_id[rid], reason="stop", n=3) for rid in order]

    assert all(c is not None and c.sample_finished for c in results)
    group_done = [c.group_finished.group_id if c.group_finished else None for c in results]
    assert group_done == [None, None, None, "r/1", "r/0", "r/2"]
    assert [c.rollout_finished is rollout for c in results] == [False] * 5 + [True]
    assert results[3].group_finished is rollout.groups[1]
    assert rollout.num_groups_done == 3


# ---------------------------------------------------------------------------- finish reasons


def test_length_with_no_budget_left_finishes_with_length():
    """A chunk finished with "length" that used the whole budget finishes the sample with "length"."""
    clock = FakeClock(10.0)
    sched = make_scheduler(engine_ids=(0,), clock=clock)
    rollout = make_rollout("r", num_prompts=1, group_size=1, max_tokens=6)
    sched.submit(rollout)
    (d,) = sched.schedule()
    clock.advance(2.5)

    done = finish(sched, d, n=6, reason="length")

    assert done is not None and done.sample_finished and not done.requeued
    req = done.request
    assert req.state is RequestState.FINISHED
    assert req.finish_reason == "length"
    assert req.remaining_tokens == 0
    assert req.generated_token_ids == [50 + k for k in range(6)]
    assert len(req.logprobs) == 6
    assert req.first_scheduled_s == 10.0 and req.finished_s == 12.5  # both read from the injected clock
    assert req.engine_history == [0]
    assert rollout.num_output_tokens == 6 and rollout.per_engine_output_tokens == {0: 6}


def test_stop_finishes_with_stop_before_the_budget():
    """A chunk finished with "stop" finishes the sample with "stop" even with budget left."""
    sched = make_scheduler(engine_ids=(0,))
    rollout = make_rollout("r", num_prompts=1, group_size=1, max_tokens=50)
    sched.submit(rollout)
    (d,) = sched.schedule()

    done = sched.chunk_finished(finished(0, d.task.task_id, [7, 8, 9], [-0.5, -1.0, -1.5], "stop"))

    assert done is not None and done.sample_finished and not done.requeued
    assert done.request.finish_reason == "stop"
    assert done.request.generated_token_ids == [7, 8, 9]
    assert done.request.logprobs == [-0.5, -1.0, -1.5]
    assert done.rollout_finished is rollout


def test_length_at_the_model_context_limit_finishes_with_length():
    """A "length" chunk that fills the engine's max_model_len finishes the sample even with max_tokens left."""
    sched = make_scheduler(engine_ids=(0,), max_model_len=24)
    rollout = make_rollout("r", num_prompts=1, group_size=1, max_tokens=16)  # prompt of 4 tokens
    sched.submit(rollout)
    (d,) = sched.schedule()

    done = finish(sched, d, n=10, reason="length")  # 4 + 10 < 24: not at the limit yet
    assert done is not None and done.requeued and not done.sample_finished
    (d2,) = sched.schedule()
    done2 = finish(sched, d2, n=6, reason="length")  # 4 + 16 = 20 < 24 but max_tokens exhausted
    assert done2 is not None and done2.sample_finished and done2.request.finish_reason == "length"

    sched2 = make_scheduler(engine_ids=(0,), max_model_len=12)
    r2 = make_rollout("s", num_prompts=1, group_size=1, max_tokens=16)
    sched2.submit(r2)
    (e,) = sched2.schedule()
    done3 = finish(sched2, e, n=8, reason="length")  # 4 + 8 = 12 == max_model_len, 8 tokens of budget left
    assert done3 is not None and done3.sample_finished
    assert done3.request.finish_reason == "length" and done3.request.remaining_tokens == 8


def test_short_length_chunk_is_requeued_and_continues_from_its_tokens():
    """A "length" chunk short of the budget requeues the sample; its next chunk carries prompt+output and the rest."""
    sched = make_scheduler(engine_ids=(0,))
    rollout = make_rollout("r", num_prompts=1, group_size=1, max_tokens=10)
    sched.submit(rollout)
    (d,) = sched.schedule()

    done = sched.chunk_finished(finished(0, d.task.task_id, [60, 61, 62], [-1.0, -1.0, -1.0], "length"))
    assert done is not None and done.requeued and not done.sample_finished
    assert done.request.state is RequestState.WAITING
    assert sched.num_waiting() == 1

    (d2,) = sched.schedule()
    assert d2.task.task_id != d.task.task_id
    assert unpack_token_ids(d2.task.prompt_token_ids) == prompt_ids(0) + [60, 61, 62]
    assert d2.task.sampling.max_tokens == 7
    assert d2.request.num_chunks == 2 and rollout.num_chunks == 2


def test_stale_or_unknown_task_id_returns_none():
    """chunk_finished for an unknown task, or from the wrong engine, returns None and changes nothing."""
    sched = make_scheduler(engine_ids=(0, 1))
    rollout = make_rollout("r", num_prompts=1, group_size=1)
    sched.submit(rollout)
    (d,) = sched.schedule()
    assert d.engine_id == 0

    assert sched.chunk_finished(finished(0, 9999, [1], [0.0], "stop")) is None
    assert sched.chunk_finished(finished(1, d.task.task_id, [1], [0.0], "stop")) is None  # wrong engine
    assert sched.chunk_finished(finished(42, d.task.task_id, [1], [0.0], "stop")) is None  # unknown engine
    assert d.request.state is RequestState.RUNNING
    assert d.request.generated_token_ids == []
    assert rollout.num_output_tokens == 0
    assert d.task.task_id in sched.engines[0].inflight

    done = sched.chunk_finished(finished(0, d.task.task_id, [1], [0.0], "stop"))
    assert done is not None and done.sample_finished
    assert sched.chunk_finished(finished(0, d.task.task_id, [1], [0.0], "stop")) is None  # already applied


# ---------------------------------------------------------------------------- cancel


def test_cancel_aborts_inflight_per_engine_and_drops_waiting_requests():
    """cancel() returns one Abort per engine listing exactly the in-flight task ids and drops waiting requests."""
    sched = make_scheduler(engine_ids=(0, 1))
    rollout = make_rollout("r", num_prompts=4, group_size=2, max_tokens=10)
    other = make_rollout("o", num_prompts=1, group_size=2)
    sched.submit(rollout)
    dispatches = sched.schedule()
    assert len(dispatches) == 8
    by_id = {d.request.request_id: d for d in dispatches}

    finish(sched, by_id["r/0/0"], reason="stop", n=2)  # finished: not aborted
    requeued = finish(sched, by_id["r/1/0"], reason="length", n=3)  # back in the queue: waiting
    assert requeued is not None and requeued.requeued
    assert sched.num_waiting() == 1
    sched.submit(other)  # another rollout, waiting, must survive the cancel

    aborts = sched.cancel("r")

    expected: dict[int, list[int]] = {}
    for rid, d in by_id.items():
        if rid not in ("r/0/0", "r/1/0"):
            expected.setdefault(d.engine_id, []).append(d.task.task_id)
    assert len(aborts) == 2
    assert [a.engine_id for a in aborts] == [0, 1]
    assert all(isinstance(a, Abort) for a in aborts)
    assert {a.engine_id: sorted(a.task_ids) for a in aborts} == {e: sorted(t) for e, t in expected.items()}
    assert sum(len(a.task_ids) for a in aborts) == 6
    assert all(not e.inflight for e in sched.engines.values())
    assert "r" not in sched.rollouts and rollout.cancelled

    after = sched.schedule()
    assert len(after) == 2
    assert {d.request.group.rollout.rollout_id for d in after} == {"o"}  # nothing of the cancelled rollout
    assert sched.num_waiting() == 0
    assert sched.chunk_finished(finished(by_id["r/2/0"].engine_id, by_id["r/2/0"].task.task_id, [1], [0.0], "stop")) is None
    assert sched.cancel("r") == []
    assert sched.cancel("never-submitted") == []


def test_cancel_before_dispatch_leaves_nothing_to_schedule():
    """A rollout cancelled while all its requests wait produces no aborts and no later dispatches."""
    sched = Scheduler(SchedulerConfig(), FakeClock())
    rollout = make_rollout("r", num_prompts=3, group_size=2)
    sched.submit(rollout)
    assert sched.num_waiting() == 6

    assert sched.cancel("r") == []

    assert sched.num_waiting() == 0
    sched.engine_joined(0, caps())
    assert sched.schedule() == []


# ---------------------------------------------------------------------------- engine loss


def test_engine_lost_requeues_its_inflight_requests_onto_live_engines():
    """engine_lost returns that engine's in-flight requests to the queue; the next schedule() sends them to live engines."""
    sched = make_scheduler(engine_ids=(0, 1, 2))
    rollout = make_rollout("r", num_prompts=6, group_size=2, max_tokens=12)
    sched.submit(rollout)
    dispatches = sched.schedule()
    assert len(dispatches) == 12
    on_1 = [d for d in dispatches if d.engine_id == 1]
    assert len(on_1) == 4  # groups 1 and 4
    finish(sched, on_1[0], reason="stop", n=2)  # one of them already finished
    still_running = {d.request.request_id for d in on_1[1:]}

    report = sched.engine_lost(1)

    assert {r.request_id for r in report.requeued} == still_running
    assert len(report.requeued) == 3
    assert report.stranded_rollouts == []
    assert sched.engines[1].state is EngineState.LOST and not sched.engines[1].inflight
    assert all(r.state is RequestState.WAITING for r in report.requeued)
    assert [e.engine_id for e in sched.live_engines()] == [0, 2]

    again = sched.schedule()
    assert {d.request.request_id for d in again} == still_running
    assert len(again) == 3
    old_task_ids = {d.task.task_id for d in dispatches}
    for d in again:
        assert d.engine_id in (0, 2)
        assert d.task.task_id not in old_task_ids
        assert d.task.sampling.max_tokens == 12
        assert d.request.engine_history == [1, d.engine_id]
    for group_id in {d.request.group.group_id for d in again}:
        assert len({d.engine_id for d in again if d.request.group.group_id == group_id}) == 1
    # the lost engine's old tasks are stale now
    assert finish(sched, on_1[1]) is None
    assert sched.engine_lost(1).requeued == []  # losing it twice is a no-op


def test_losing_the_last_engine_reports_stranded_rollouts():
    """When no live engine remains, engine_lost lists every unfinished rollout as stranded (not finished ones)."""
    sched = make_scheduler(engine_ids=(0, 1))
    done_rollout = make_rollout("done", num_prompts=1, group_size=1)
    sched.submit(done_rollout)
    (d,) = sched.schedule()
    finish(sched, d, reason="stop", n=1)
    assert done_rollout.done
    running = make_rollout("running", num_prompts=3, group_size=2)
    sched.submit(running)
    assert len(sched.schedule()) == 6

    first = sched.engine_lost(0)
    assert first.stranded_rollouts == []
    last = sched.engine_lost(1)

    assert last.stranded_rollouts == [running]
    assert len(first.requeued) + len(last.requeued) == 6
    assert sched.live_engines() == []
    assert sched.schedule() == []
    assert sched.num_waiting() == 6

    sched.engine_joined(7, caps())  # a new engine picks the work up
    resumed = sched.schedule()
    assert len(resumed) == 6 and {x.engine_id for x in resumed} == {7}


def test_second_rollout_submitted_while_first_runs_is_scheduled():
    """A rollout submitted while another is in flight is dispatched by the next schedule(), whole groups, full budget."""
    sched = make_scheduler(engine_ids=(0, 1))
    first = make_rollout("a", num_prompts=2, group_size=2, max_tokens=8)
    sched.submit(first)
    assert len(sched.schedule()) == 4

    second = make_rollout("b", num_prompts=3, group_size=3, max_tokens=5)
    sched.submit(second)
    dispatches = sched.schedule()

    assert len(dispatches) == 9
    assert {d.request.group.rollout.rollout_id for d in dispatches} == {"b"}
    assert all(d.task.sampling.max_tokens == 5 for d in dispatches)
    for group in second.groups:
        assert len({d.engine_id for d in dispatches if d.request.group is group}) == 1
    assert len(first.groups) == 2 and not first.done  # the first is still running, untouched
    for d in dispatches:
        finish(sched, d, reason="stop", n=1)
    assert second.done and not first.done


# ---------------------------------------------------------------------------- payload


def test_dispatched_chunk_task_carries_prompt_ids_and_sampling_values():
    """ChunkTask carries request/group ids, the packed prompt token ids and every sampling value."""
    sched = make_scheduler(engine_ids=(0,))
    rollout = make_rollout(
        "r", num_prompts=2, group_size=1, max_tokens=33, temperature=0.7, top_p=0.9, top_k=40, min_tokens=2,
        stop=["\n\n", "END"], stop_token_ids=[2, 5], ignore_eos=True,
    )
    sched.submit(rollout)
    dispatches = sched.schedule()
    assert len(dispatches) == 2

    for index, d in enumerate(dispatches):
        task = d.task
        assert isinstance(task, ChunkTask)
        assert task.request_id == f"r/{index}/0" and task.group_id == f"r/{index}"
        assert unpack_token_ids(task.prompt_token_ids) == prompt_ids(index)
        s = task.sampling
        assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_tokens) == (33, 0.7, 0.9, 40, 2)
        assert s.stop == ["\n\n", "END"] and s.stop_token_ids == [2, 5] and s.ignore_eos is True
        assert s.seed is None


def test_a_rollout_without_speculative_decoding_sends_chunks_that_must_not_draft():
    """RolloutRequest.speculative reaches every ChunkTask as draft (default True)."""
    sched = make_scheduler(engine_ids=(0,))
    plain = make_rollout("sd", num_prompts=1, group_size=2)
    req = RolloutRequest(call_id="c", rollout_id="nosd", prompts=[Prompt(prompt_token_ids=prompt_ids(1))],
                         group_size=2, sampling=SamplingParams(max_tokens=16), speculative=False)
    sched.submit(plain)
    sched.submit(build_rollout(req, ByteTokenizer(), LIMITS, "group", 0.0))
    drafts = {d.task.request_id: d.task.draft for d in sched.schedule()}
    assert drafts == {"sd/0/0": True, "sd/0/1": True, "nosd/0/0": False, "nosd/0/1": False}


def test_per_sample_seeds_differ_within_a_group_and_are_deterministic():
    """Samples of one group get distinct seeds, derive_sample_seed(seed, group, sample), equal across runs."""

    def seeds_of_a_run() -> dict[str, int | None]:
        sched = make_scheduler(engine_ids=(0, 1))
        sched.submit(make_rollout("r", num_prompts=3, group_size=4, seed=1234))
        return {d.task.request_id: d.task.sampling.seed for d in sched.schedule()}

    first, second = seeds_of_a_run(), seeds_of_a_run()
    assert len(first) == 12
    assert first == second
    for g in range(3):
        group_seeds = [first[f"r/{g}/{j}"] for j in range(4)]
        assert len(set(group_seeds)) == 4
        assert group_seeds == [derive_sample_seed(1234, g, j) for j in range(4)]
    assert len(set(first.values())) == 12
    assert all(isinstance(s, int) and 0 <= s < 2**62 for s in first.values())
    assert derive_sample_seed(None, 0, 0) is None
    assert derive_sample_seed(1234, 0, 1) != derive_sample_seed(1235, 0, 1)


def test_preemptions_since_start_uses_the_engine_load_delta():
    """preemptions_since_start sums per-engine growth since submit; new engines count from 0; drops count 0."""
    sched = make_scheduler(engine_ids=(0, 1, 2))
    sched.engine_load(0, EngineLoad(num_preemptions=5))
    sched.engine_load(1, EngineLoad(num_preemptions=2))
    sched.engine_load(2, EngineLoad(num_preemptions=9))
    rollout = make_rollout("r", num_prompts=2, group_size=2)
    sched.submit(rollout)
    assert rollout.preemptions_at_start == {0: 5, 1: 2, 2: 9}
    assert sched.preemptions_since_start(rollout) == 0

    sched.engine_load(0, EngineLoad(num_preemptions=8))  # +3
    sched.engine_load(1, EngineLoad(num_preemptions=2))  # +0
    sched.engine_load(2, EngineLoad(num_preemptions=4))  # went down (restart): counts 0, not -5
    sched.engine_joined(3, caps())
    sched.engine_load(3, EngineLoad(num_preemptions=4))  # joined after submit: +4
    sched.engine_load(99, EngineLoad(num_preemptions=100))  # unknown engine: ignored

    assert sched.preemptions_since_start(rollout) == 7


# ---------------------------------------------------------------------------- fixed bugs


def test_chunk_failed_from_the_wrong_engine_is_ignored():
    """chunk_failed naming a task of another engine returns None and leaves the request in flight."""
    sched = make_scheduler(engine_ids=(0, 1))
    sched.submit(make_rollout("r", num_prompts=1, group_size=1))
    (d,) = sched.schedule()
    assert d.engine_id == 0

    result = sched.chunk_failed(1, d.task.task_id)

    assert result is None
    assert d.request.state is RequestState.RUNNING
    assert sched.num_waiting() == 0


def test_chunk_failed_requeues_the_request():
    """chunk_failed from the task's own engine puts the request back; the next schedule() redispatches it."""
    sched = make_scheduler(engine_ids=(0,))
    sched.submit(make_rollout("r", num_prompts=1, group_size=1, max_tokens=9))
    (d,) = sched.schedule()

    req = sched.chunk_failed(0, d.task.task_id)

    assert req is d.request and req.state is RequestState.WAITING
    assert not sched.engines[0].inflight
    assert sched.chunk_failed(0, d.task.task_id) is None
    (d2,) = sched.schedule()
    assert d2.request is req and d2.task.task_id != d.task.task_id and d2.task.sampling.max_tokens == 9


# ---------------------------------------------------------------------------- property


class SchedulerMachine(RuleBasedStateMachine):
    """Random submits, finishes, failures, engine losses/joins and cancels against the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.sched = Scheduler(SchedulerConfig(), self.clock)
        self.next_engine_id = 0
        self.next_rollout = 0
        self.rollouts: list[Rollout] = []
        self.cancelled: set[str] = set()
        self.inflight: dict[int, Dispatch] = {}  # our own record of every in-flight task
        self.dispatched_task_ids: set[int] = set()
        self.finished_request_ids: set[str] = set()
        self.finished_count = 0
        self.join_new()

    # -- helpers
    def live_ids(self) -> list[int]:
        return [e.engine_id for e in self.sched.live_engines()]

    def lost_ids(self) -> list[int]:
        return sorted(i for i, e in self.sched.engines.items() if e.state is EngineState.LOST)

    def active_rollouts(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.rollout_id not in self.cancelled and not r.done]

    # -- rules
    @rule()
    def join_new(self) -> None:
        self.sched.engine_joined(self.next_engine_id, caps(max_model_len=64))
        self.next_engine_id += 1

    @precondition(lambda self: bool(self.lost_ids()))
    @rule(data=st.data())
    def rejoin_lost(self, data) -> None:
        engine_id = data.draw(st.sampled_from(self.lost_ids()))
        self.sched.engine_joined(engine_id, caps(max_model_len=64))

    @rule(b=st.integers(1, 5), g=st.integers(1, 4), max_tokens=st.integers(1, 6))
    def submit(self, b: int, g: int, max_tokens: int) -> None:
        rollout = make_rollout(f"r{self.next_rollout}", b, g, max_tokens=max_tokens, now=self.clock())
        self.next_rollout += 1
        self.sched.submit(rollout)
        self.rollouts.append(rollout)

    @rule()
    def schedule(self) -> None:
        for d in self.sched.schedule():
            assert d.task.task_id not in self.dispatched_task_ids, "task id dispatched twice"
            self.dispatched_task_ids.add(d.task.task_id)
            assert d.engine_id in self.live_ids()
            assert d.request.group.rollout.rollout_id not in self.cancelled
            assert 1 <= d.task.sampling.max_tokens <= d.request.remaining_tokens
            self.inflight[d.task.task_id] = d

    @precondition(lambda self: bool(self.inflight))
    @rule(data=st.data())
    def finish_task(self, data) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.inflight)))
        d = self.inflight.pop(task_id)
        n = data.draw(st.integers(0, d.task.sampling.max_tokens))
        reason = data.draw(st.sampled_from(["stop", "length", "abort"]))
        self.clock.advance(0.1)
        done = self.sched.chunk_finished(finished(d.engine_id, task_id, [3] * n, [-1.0] * n, reason))
        assert done is not None and done.request is d.request
        assert done.sample_finished != done.requeued
        if done.sample_finished:
            assert d.request.request_id not in self.finished_request_ids, "sample finished twice"
            self.finished_request_ids.add(d.request.request_id)
            group = d.request.group
            assert (done.group_finished is group) == all(r.state is RequestState.FINISHED for r in group.requests)
            rollout = group.rollout
            assert (done.rollout_finished is rollout) == rollout.done
            if done.rollout_finished is not None:
                self.sched.forget(rollout.rollout_id)
                assert rollout.rollout_id not in self.sched.rollouts

    @precondition(lambda self: bool(self.inflight))
    @rule(data=st.data())
    def fail_task(self, data) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.inflight)))
        d = self.inflight.pop(task_id)
        assert self.sched.chunk_failed(d.engine_id, task_id) is d.request

    @precondition(lambda self: bool(self.dispatched_task_ids - set(self.inflight)))
    @rule(data=st.data())
    def stale_finish(self, data) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.dispatched_task_ids - set(self.inflight))))
        engine_id = data.draw(st.sampled_from(sorted(self.sched.engines)))
        before = self.sched.num_waiting()
        assert self.sched.chunk_finished(finished(engine_id, task_id, [3], [-1.0], "stop")) is None
        assert self.sched.num_waiting() == before

    @precondition(lambda self: bool(self.live_ids()))
    @rule(data=st.data())
    def lose_engine(self, data) -> None:
        engine_id = data.draw(st.sampled_from(self.live_ids()))
        expected = {t for t, d in self.inflight.items() if d.engine_id == engine_id}
        report = self.sched.engine_lost(engine_id)
        assert {self.inflight[t].request.request_id for t in expected} == {r.request_id for r in report.requeued}
        for t in expected:
            del self.inflight[t]
        if self.live_ids():
            assert report.stranded_rollouts == []
        else:
            assert {r.rollout_id for r in report.stranded_rollouts} == {r.rollout_id for r in self.active_rollouts()}

    @precondition(lambda self: bool(self.active_rollouts()))
    @rule(data=st.data())
    def cancel(self, data) -> None:
        rollout = data.draw(st.sampled_from(self.active_rollouts()))
        expected = {t: d.engine_id for t, d in self.inflight.items() if d.request.group.rollout is rollout}
        aborts = self.sched.cancel(rollout.rollout_id)
        got = {t: a.engine_id for a in aborts for t in a.task_ids}
        assert got == expected
        assert len(aborts) == len(set(expected.values()))
        for t in expected:
            del self.inflight[t]
        self.cancelled.add(rollout.rollout_id)

    # -- invariants
    @invariant()
    def each_request_in_exactly_one_place(self) -> None:
        # The waiting requests: the group policy's queue, and the scheduler's requests not yet
        # given to it (``_unqueued``) or assigned beyond an engine's max chunks (``_held``).
        buffer = self.sched.policy("group")._buffer
        others = ({id(r) for r in self.sched._unqueued}
                  | {id(a.request) for held in self.sched._held.values() for a in held})
        holders: dict[str, list[int]] = {}
        for engine in self.sched.engines.values():
            if engine.state is EngineState.LOST:
                assert not engine.inflight, "a lost engine still holds work"
            for task_id, request in engine.inflight.items():
                holders.setdefault(request.request_id, []).append(engine.engine_id)
                assert task_id in self.inflight and self.inflight[task_id].request is request
        assert sum(len(v) for v in holders.values()) == len(self.inflight)
        num_waiting = 0
        for rollout in self.rollouts:
            for request in (r for g in rollout.groups for r in g.requests):
                waiting = request in buffer or id(request) in others
                on = holders.get(request.request_id, [])
                finished = request.state is RequestState.FINISHED
                if rollout.rollout_id in self.cancelled:
                    assert not waiting and not on
                    continue
                assert len(on) <= 1, f"{request.request_id} in flight on engines {on}"
                assert int(waiting) + len(on) + int(finished) == 1, request.request_id
                assert (request.state is RequestState.WAITING) == waiting
                assert (request.state is RequestState.RUNNING) == bool(on)
                if on:
                    assert request.engine_id == on[0] and self.sched.engines[on[0]].state is EngineState.READY
                num_waiting += waiting
        assert self.sched.num_waiting() == len(buffer) + len(others) == num_waiting

    @invariant()
    def finished_count_never_decreases(self) -> None:
        count = sum(r.num_samples_done for r in self.rollouts)
        assert count >= self.finished_count
        assert count == len(self.finished_request_ids)
        self.finished_count = count


def test_scheduler_invariants_hold_under_random_event_sequences():
    """Random event sequences keep each request in exactly one place, task ids unique and finished counts monotone."""
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=100,
            deadline=None,
            stateful_step_count=30,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )

