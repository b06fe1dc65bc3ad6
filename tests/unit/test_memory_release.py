"""Memory of ended rollouts goes back (issue 38, point 5): nothing of the control plane's
own keeps a cancelled rollout alive (the engines' in-flight change logs used to, through
request -> group -> rollout), and after large ones a release (full collection +
malloc_trim) is due. The numbers: docs/operations.md, "Memory"."""

from __future__ import annotations

import gc
import weakref

from seer.config import SchedulerConfig
from seer.controlplane.intake import Limits, build_rollout
from seer.controlplane.memory import RolloutEnds, release
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import Group, Rollout
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import (ChunkFinished, EngineCapabilities, Prompt, RolloutRequest, SamplingParams, pack_logprobs,
                           pack_token_ids)

CAPS = EngineCapabilities(backend="sim", model="sim", dtype="none", max_model_len=512, vocab_size=259,
                          kv_capacity_tokens=1_000_000, block_size=16)


def _rollout(rollout_id: str, num_samples: int) -> Rollout:
    rollout = Rollout(rollout_id=rollout_id, policy="group", accepted_s=0.0)
    rollout.groups.append(Group(group_id=f"{rollout_id}/0", rollout=rollout, group_index=0, prompt_id="0",
                                requests=[None] * num_samples))  # type: ignore[list-item]
    return rollout


def test_a_release_is_due_once_enough_samples_have_ended():
    """Rollouts are known from their intake; they end when they are neither taken in nor in
    the scheduler; a release is due when the ended samples reach the live ones, at most
    ``min_samples``, and the count starts again after it."""
    ends = RolloutEnds(min_samples=10_000)
    ends.started("a", 6000)
    ends.started("b", 8000)
    assert ends.update({"a", "b"}) == (0, False)
    assert ends.update({"b"}) == (1, False)  # 6,000 ended while 8,000 are live
    ends.started("c", 20_000)
    assert ends.update({"b", "c"}) == (0, False)  # 28,000 live: the threshold stays at 10,000
    assert ends.update({"c"}) == (1, True)  # 14,000 ended
    assert ends.update({"c"}) == (0, False)
    assert ends.update(set()) == (1, True)


def test_with_few_samples_live_a_release_comes_once_as_many_have_ended():
    """Four 800-sample rollouts in flight, each replaced as it ends (the soak): a release
    is due every 4 ended rollouts (3,200 samples, as many as are live), not every 13 (the
    10,000 cap): each full collection frees about as much as it walks, and stands the loop
    still for less."""
    ends = RolloutEnds(min_samples=10_000, idle_min_samples=1000)
    live = set()
    for i in range(4):
        ends.started(f"r{i}", 800)
        live.add(f"r{i}")
    due_after = []
    for i in range(4, 20):
        live.discard(f"r{i - 4}")
        ends.started(f"r{i}", 800)
        live.add(f"r{i}")
        if ends.update(live)[1]:
            due_after.append(i - 3)  # rollouts ended so far
    assert due_after == [4, 8, 12, 16]


def test_once_no_rollout_is_left_fewer_ended_samples_are_enough():
    """An idle daemon keeps no ended rollouts for the next large one to free: with nothing
    left running, ``IDLE_MIN_SAMPLES`` ended samples make a release due (fewer do not)."""
    ends = RolloutEnds(min_samples=10_000, idle_min_samples=1000)
    ends.started("small", 400)
    assert ends.update(set()) == (1, False)  # 400 ended: too few to walk the heap for
    ends.started("a", 2000)
    ends.started("b", 5000)
    assert ends.update({"b"}) == (1, False)  # 2,400 ended, 5,000 still run
    assert ends.update(set()) == (1, True)  # 7,400 ended and nothing left
    assert ends.update(set()) == (0, False)


def test_a_rollout_that_starts_and_ends_between_two_looks_is_counted():
    """Taken in, refused or cancelled before anyone looked: still counted when next looked."""
    ends = RolloutEnds(min_samples=10_000)
    ends.started("quick", 50_000)
    assert ends.update(set()) == (1, True)


def test_a_cancelled_rollout_is_freed_once_the_inflight_logs_are_dropped():
    """After a cancel, the engines' in-flight change logs still hold the requests that left
    them, and through any one of them the whole rollout; ``drop_inflight_history`` lets the
    collector free it."""
    s = Scheduler(SchedulerConfig(chunk_size_tokens=16), lambda: 0.0)
    for engine_id in range(2):
        s.engine_joined(engine_id, CAPS)
    req = RolloutRequest(call_id="c", rollout_id="r", group_size=4, sampling=SamplingParams(max_tokens=16),
                         prompts=[Prompt(prompt=f"p{i}") for i in range(50)])
    rollout = build_rollout(req, ByteTokenizer(), Limits(64, 1000, 512, 259), "group", 0.0)
    s.submit(rollout)
    assert s.schedule()
    alive = weakref.ref(rollout)
    s.cancel("r")
    del rollout, req
    gc.collect()
    assert alive() is not None, "nothing held the cancelled rollout: the test would prove nothing"
    s.registry.drop_inflight_history()
    gc.collect()
    assert alive() is None


def test_release_collects_cyclic_garbage_and_reports_the_rss():
    """``release`` runs a full collection (a rollout is a cycle: the collector alone frees
    it) and reports the RSS before and after."""
    rollout = _rollout("x", 3)
    ref = weakref.ref(rollout)
    del rollout
    done = release()
    assert ref() is None
    assert done.rss_before_bytes > 0 and done.rss_after_bytes > 0 and done.seconds >= 0


def _chunked_rollout_freed(policy: str, cancel_at_round: int | None) -> bool:
    """Run a chunked policy's rollout for some rounds (cancelled then) or to its end
    (delivered: ``forget``), then: is anything of the scheduler's still holding it?"""
    from tests.unit.test_chunked_policies import rollout as make_rollout
    from tests.unit.test_chunked_policies import run_chunk
    from tests.unit.test_chunked_policies import scheduler as make_scheduler

    s = make_scheduler(policy)
    lengths = [[(7 * g + 13 * i) % 60 + 5 for i in range(8)] for g in range(40)]

    def run() -> weakref.ref:
        r = make_rollout(policy, lengths)
        s.submit(r)
        rounds = 0
        while not r.done:
            rounds += 1
            for d in s.schedule():
                run_chunk(s, d, lengths[d.request.group.group_index][d.request.sample_index])
            if rounds == cancel_at_round:
                s.cancel("r")
                return weakref.ref(r)
        s.forget("r")
        return weakref.ref(r)

    alive = run()
    s.registry.drop_inflight_history()
    gc.collect()
    return alive() is None


def test_a_chunked_policy_lets_go_of_a_cancelled_or_delivered_rollout():
    """Under context, divided and oracle, a rollout cancelled mid-run or run to its end
    leaves nothing in the policy's queues, admission reservations, work ledger or per-group
    tables (they held it until a later rollout's queue ran dry: ``rollout_ended``)."""
    for policy in ("context", "divided", "oracle"):
        assert _chunked_rollout_freed(policy, cancel_at_round=2), f"{policy}: a cancelled rollout is still held"
        assert _chunked_rollout_freed(policy, cancel_at_round=None), f"{policy}: a delivered rollout is still held"


def test_a_delivered_or_cancelled_rollout_taken_apart_is_freed_without_the_collector():
    """``MemoryRelease.dismantle`` (what ``ClientSessions`` does once a rollout is delivered
    and forgotten, or cancelled or failed) cuts its graph's links down: reference counting
    alone frees every request, group and the rollout, so the release's full collection only
    walks what is live. Without it, the same rollout waits for the collector. A cancelled
    one is taken apart with chunks still out: they come back as unknown tasks."""
    from seer.controlplane.memory import MemoryRelease
    from tests.unit.test_chunked_policies import rollout as make_rollout
    from tests.unit.test_chunked_policies import run_chunk
    from tests.unit.test_chunked_policies import scheduler as make_scheduler

    lengths = [[(7 * g + 13 * i) % 60 + 5 for i in range(8)] for g in range(40)]

    def run(take_apart: bool, cancel: bool) -> tuple[weakref.ref, int]:
        s = make_scheduler("context")
        memory = MemoryRelease(s.registry, lambda _s: None)
        r = make_rollout("context", lengths)
        s.submit(r)
        out: list = []
        while not r.done:
            out = s.schedule()
            if cancel:
                s.cancel("r")
                break
            for d in out:
                run_chunk(s, d, lengths[d.request.group.group_index][d.request.sample_index])
        else:
            s.forget("r")
        s.registry.drop_inflight_history()
        if take_apart:
            memory.dismantle(r)
            assert r.done or cancel  # a delivered one still reads as delivered
        if cancel:  # its aborted chunks come back: unknown tasks now
            assert out and all(s.chunk_finished(ChunkFinished(
                engine_id=d.engine_id, task_id=d.task.task_id, token_ids=pack_token_ids([1]),
                logprobs=pack_logprobs([0.0]), finish_reason="abort", num_prompt_tokens=0, num_cached_tokens=0,
                elapsed_ms=0.0)) is None for d in out)
            del out
        return weakref.ref(r), memory.dismantled_samples

    gc.collect()
    gc.disable()
    try:
        for cancel in (False, True):
            kept, _ = run(take_apart=False, cancel=cancel)
            assert kept() is not None, "the rollout was freed without the collector: the test would prove nothing"
            freed, dismantled = run(take_apart=True, cancel=cancel)
            assert dismantled == 320
            assert freed() is None, f"something still holds the taken-apart rollout in a cycle (cancelled: {cancel})"
    finally:
        gc.enable()
        gc.collect()
