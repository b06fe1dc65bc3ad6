"""The chunked policies (divided, context, oracle) on the pure scheduler core."""

from __future__ import annotations

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from seer.config import SchedulerConfig
from seer.controlplane.intake import Limits, build_rollout
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import Group, Request, RequestState, Rollout
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import EngineCapabilities, Prompt, RolloutRequest, SamplingParams, unpack_token_ids
from tests.unit.chunks import finished
from tests.unit.test_policy_properties import engine_reserved

BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def caps(kv_tokens: int = 100_000, max_model_len: int = 4096) -> EngineCapabilities:
    return EngineCapabilities(backend="sim", model="m", dtype="none", max_model_len=max_model_len, vocab_size=259,
                              kv_capacity_tokens=kv_tokens, block_size=BLOCK)


def scheduler(policy: str, engines: int = 2, kv_tokens: int = 100_000, **cfg) -> Scheduler:
    config = SchedulerConfig(policy=policy, **{"chunk_size_tokens": 16, "kv_admission_fraction": 1.0,
                                               "chunking": "always", **cfg})
    sched = Scheduler(config, Clock())
    for e in range(engines):
        sched.engine_joined(e, caps(kv_tokens))
    return sched


def rollout(policy: str, lengths: list[list[int]], max_tokens: int = 64, prompt_len: int = 16,
            rid: str = "r") -> Rollout:
    r = Rollout(rollout_id=rid, policy=policy, accepted_s=0.0)
    for gi, group_lengths in enumerate(lengths):
        g = Group(group_id=f"{rid}/{gi}", rollout=r, group_index=gi, prompt_id=str(gi))
        for si, true_len in enumerate(group_lengths):
            req = Request(request_id=f"{rid}/{gi}/{si}", group=g, sample_index=si,
                          prompt_token_ids=[5] * prompt_len, sampling=SamplingParams(max_tokens=max_tokens, seed=1))
            req.oracle_length = true_len
            g.requests.append(req)
        r.groups.append(g)
    return r


def run_chunk(sched: Scheduler, d, true_len: int) -> None:
    """Finish a dispatched chunk as an engine would, given the request's true length."""
    req = d.request
    left = true_len - req.num_generated_tokens
    n = min(d.task.sampling.max_tokens, left)
    sched.chunk_finished(finished(d.engine_id, d.task.task_id, [7] * n, [-0.5] * n, "stop" if n == left else "length"))


def drain(sched: Scheduler, r: Rollout, lengths: list[list[int]], log: list | None = None) -> None:
    for _ in range(10_000):
        dispatches = sched.schedule()
        if log is not None:
            log.append(dispatches)
        if not dispatches and r.done:
            return
        assert dispatches, "nothing dispatched while the rollout is unfinished"
        for d in dispatches:
            run_chunk(sched, d, lengths[d.request.group.group_index][d.request.sample_index])
    raise AssertionError("rollout did not finish")


def test_divided_runs_each_request_in_chunks_until_its_true_length():
    """Under `divided` every request is generated in chunks of at most chunk_size_tokens,
    returns to the queue between chunks, and ends with exactly its true length."""
    lengths = [[40, 5], [16, 33]]
    sched = scheduler("divided")
    r = rollout("divided", lengths)
    sched.submit(r)
    log: list = []
    drain(sched, r, lengths, log)
    budgets = [d.task.sampling.max_tokens for ds in log for d in ds]
    assert max(budgets) == 16 and len(budgets) == sum(-(-n // 16) for g in lengths for n in g)
    for g, gl in zip(r.groups, lengths):
        assert [q.num_generated_tokens for q in g.requests] == gl
        assert [q.finish_reason for q in g.requests] == ["stop", "stop"]
    first = next(d for ds in log for d in ds if d.request.request_id == "r/0/0")
    assert unpack_token_ids(first.task.prompt_token_ids) == [5] * 16


def test_a_request_that_reaches_its_budget_finishes_with_length():
    """A request longer than max_tokens ends after max_tokens with finish_reason length."""
    sched = scheduler("divided")
    r = rollout("divided", [[100]], max_tokens=40)
    sched.submit(r)
    drain(sched, r, [[100]])
    req = r.groups[0].requests[0]
    assert req.num_generated_tokens == 40 and req.finish_reason == "length" and req.num_chunks == 3


def test_admission_never_reserves_more_kv_than_an_engine_has():
    """With room for two requests' context + chunk per engine, at most two are in flight
    per engine, and the rest wait until chunks return."""
    # each request needs 16 prompt + 16 chunk = 32 tokens; capacity 64 -> 2 per engine
    sched = scheduler("divided", engines=2, kv_tokens=64)
    r = rollout("divided", [[8] * 4, [8] * 4])
    sched.submit(r)
    first = sched.schedule()
    assert len(first) == 4
    assert sorted(d.engine_id for d in first) == [0, 0, 1, 1]
    assert sched.schedule() == []
    run_chunk(sched, first[0], 8)
    again = sched.schedule()
    assert len(again) == 1 and again[0].engine_id == first[0].engine_id


def test_placement_prefers_the_engine_that_holds_the_context_while_balanced():
    """A request's next chunk goes back to the engine of its previous chunk (its KV is
    there) while load is balanced."""
    sched = scheduler("divided", engines=3)
    r = rollout("divided", [[48]])
    sched.submit(r)
    (d,) = sched.schedule()
    for _ in range(2):
        run_chunk(sched, d, 48)
        if r.done:
            break
        (nxt,) = sched.schedule()
        assert nxt.engine_id == d.engine_id
        d = nxt
    assert r.groups[0].requests[0].engine_history == [d.engine_id]


def test_placement_goes_to_the_least_loaded_engine_above_the_imbalance_threshold():
    """When in-flight counts differ by more than the threshold, a returning request moves
    to the least-loaded engine (a migration)."""
    sched = scheduler("divided", engines=2, imbalance_threshold=1)
    r = rollout("divided", [[64], [64], [64], [64]])
    sched.submit(r)
    ds = sched.schedule()
    assert sorted(d.engine_id for d in ds) == [0, 0, 1, 1]
    on_1 = [d for d in ds if d.engine_id == 1]
    on_0 = [d for d in ds if d.engine_id == 0]
    for d in on_1:  # engine 1's requests return; engine 0 still has 2 in flight
        run_chunk(sched, d, 64)
    assert sched.engines[0].num_inflight == 2 and sched.engines[1].num_inflight == 0
    moved = sched.schedule()
    assert [m.engine_id for m in moved] == [1, 1]  # stays on 1 (its cache and least loaded)
    run_chunk(sched, on_0[0], 64)  # now engine 0 has 1, engine 1 has 2: spread 1 -> affinity
    (back,) = sched.schedule()
    assert back.engine_id == 0


@pytest.mark.parametrize(("fraction", "expected"), [(0.5, 0), (1.0, 1)])
def test_on_small_engines_a_continuation_leaves_a_busy_engine_for_an_idle_one(fraction, expected):
    """Engine 0 ran the short samples and is idle; engine 1 still holds two long ones when
    a third returns. The spread (2) is far below the threshold of 32, but more than half
    the busiest engine's load, so the continuation moves to engine 0 (imbalance_fraction
    0.5); with the fraction at 1.0 only the fixed threshold counts and it stays home."""
    sched = scheduler("divided", engines=2, imbalance_fraction=fraction)
    lengths = [16, 64, 16, 64, 16, 64]
    r = rollout("divided", [[n] for n in lengths])
    sched.submit(r)
    ds = sched.schedule()
    assert [d.engine_id for d in ds] == [0, 1, 0, 1, 0, 1]
    for d in ds[0::2]:  # the short samples finish: engine 0 is idle
        run_chunk(sched, d, 16)
    run_chunk(sched, ds[1], 64)  # a long one's chunk returns; two are still on engine 1
    assert sched.engines[0].num_inflight == 0 and sched.engines[1].num_inflight == 2
    (nxt,) = sched.schedule()
    assert nxt.request is ds[1].request and nxt.engine_id == expected


def test_context_serves_probes_first_then_longest_estimate_first():
    """Probes' first chunks (sample 0, nothing generated) go first; then the group whose
    probe finished short has its samples served after the group with no short finish."""
    lengths = [[10, 10, 10], [50, 50, 50]]
    # room for exactly 2 fresh probes of different groups (16 + 16 tokens each; a sibling
    # would share its group's 16-token prompt and need 16 more) on one engine
    sched = scheduler("context", engines=1, kv_tokens=64, starvation_interval=0)
    r = rollout("context", lengths, max_tokens=4096)  # a budget far above both: estimates are not capped
    sched.submit(r)
    ds = sched.schedule()
    assert sorted(d.request.sample_index for d in ds) == [0, 0]  # both probes first
    for d in ds:
        run_chunk(sched, d, lengths[d.request.group.group_index][0])
    assert r.groups[0].requests[0].state is RequestState.FINISHED  # 10 tokens: within its first chunk
    assert r.groups[1].requests[0].num_generated_tokens == 16  # still running
    # group 0 finished one sample at 10 tokens, group 1 none: group 1's requests lead
    assert [d.request.group.group_index for d in sched.schedule()] == [1, 1]


def test_context_probe_keeps_priority_for_its_first_chunk_only():
    """A probe that returns from its first chunk is ranked like its siblings: with the
    budget capping every estimate, a fresh sibling (up to 64 tokens left) goes before
    the probe (up to 48 left). A probe that kept its priority on every chunk ran ahead
    of its group and lengthened the tail (docs/benchmarks.md)."""
    sched = scheduler("context", engines=1, kv_tokens=32, starvation_interval=0)  # one request at a time
    r = rollout("context", [[64, 64]], max_tokens=64)
    sched.submit(r)
    (d,) = sched.schedule()
    assert d.request.sample_index == 0
    run_chunk(sched, d, 64)
    (d2,) = sched.schedule()
    assert d2.request.sample_index == 1 and d2.request.num_generated_tokens == 0


def test_context_a_fresh_probe_goes_before_a_returned_one():
    """A probe that has generated nothing is served before one back from its first chunk."""
    sched = scheduler("context", engines=1, kv_tokens=32, starvation_interval=0)  # one request at a time
    r = rollout("context", [[64], [64]])
    sched.submit(r)
    (d,) = sched.schedule()
    assert d.request.group.group_index == 0
    run_chunk(sched, d, 64)  # group 0's probe has 16 tokens now, group 1's none
    (d2,) = sched.schedule()
    assert d2.request.group.group_index == 1


def test_oracle_serves_the_longest_true_remaining_length_first():
    """oracle orders by true remaining length, longest first."""
    sched = scheduler("oracle", engines=1, kv_tokens=32)
    r = rollout("oracle", [[5], [60], [30]])
    sched.submit(r)
    order = []
    while not r.done:
        ds = sched.schedule()
        for d in ds:
            order.append((d.request.group.group_index, d.request.num_generated_tokens))
            run_chunk(sched, d, [5, 60, 30][d.request.group.group_index])
    # remaining: g1 60 -> 44 -> 28; g2 30; g0 5: g1, g1, then g2 (30 > 28), then g1 ...
    assert order[:4] == [(1, 0), (1, 16), (2, 0), (1, 32)]
    assert order[-1][0] == 0


def test_full_kv_oracle_admits_against_the_whole_kv_where_oracle_keeps_the_margin():
    """oracle-full's reservations are exact, so it admits against every token of an engine's
    KV; oracle keeps kv_admission_fraction's margin. Four chunks of 32 tokens each on 128
    tokens at fraction 0.5: oracle takes two in the first round, oracle-full all four, and
    both finish every sample at its true length."""
    lengths = [[16], [16], [16], [16]]
    taken = {}
    for policy in ("oracle", "oracle-full"):
        sched = scheduler(policy, engines=1, kv_tokens=128, kv_admission_fraction=0.5)
        r = rollout(policy, lengths)
        sched.submit(r)
        log: list = []
        drain(sched, r, lengths, log)
        taken[policy] = len(log[0])
        assert [req.num_generated_tokens for g in r.groups for req in g.requests] == [16] * 4
    assert taken == {"oracle": 2, "oracle-full": 4}


def test_group_oracle_ranks_by_each_groups_true_lengths_and_sends_no_probe_first():
    """oracle-group knows every group's true length distribution from the start: the long
    group's samples go first, ahead of the short group's sample 0 (no probe priority)."""
    sched = scheduler("oracle-group", engines=1, kv_tokens=48, starvation_interval=0)
    r = rollout("oracle-group", [[5, 6], [60, 62]])
    sched.submit(r)
    first = [(d.request.group.group_index, d.request.sample_index) for d in sched.schedule()]
    assert first[0][0] == 1
    context = scheduler("context", engines=1, kv_tokens=48, starvation_interval=0)
    r = rollout("context", [[5, 6], [60, 62]])
    context.submit(r)
    first = [(d.request.group.group_index, d.request.sample_index) for d in context.schedule()]
    assert first[0] == (0, 0)  # context knows nothing yet: group 0's probe first


def test_group_oracle_without_true_lengths_says_it_runs_only_on_traces():
    from seer.controlplane.policies import make_policy

    policy = make_policy("oracle-group", SchedulerConfig(policy="oracle-group", chunk_size_tokens=16))
    r = rollout("oracle-group", [[5, 6]])
    r.groups[0].requests[1].oracle_length = None
    with pytest.raises(ValueError, match="needs true output lengths .* true_lengths from an earlier seeded run"):
        policy.enqueue(r.groups[0].requests[0])


def test_every_chunk_keeps_the_sample_seed_and_restates_min_tokens():
    """Every chunk carries the sample's own seed and where it starts in the response (the
    engine keys sampling by seed and position, so chunking cannot change the sample);
    min_tokens is restated for what is left of the request."""
    sched = scheduler("divided", engines=1)
    r = rollout("divided", [[40]])
    req = r.groups[0].requests[0]
    req.sampling = SamplingParams(max_tokens=64, seed=123, min_tokens=20)
    sched.submit(r)
    seeds, starts, mins = [], [], []
    while not r.done:
        (d,) = sched.schedule()
        seeds.append(d.task.sampling.seed)
        starts.append(d.task.num_generated_tokens)
        mins.append(d.task.sampling.min_tokens)
        run_chunk(sched, d, 40)
    assert seeds == [123, 123, 123]
    assert starts == [0, 16, 32]
    assert mins == [16, 4, 0]


def test_chunk_tasks_tell_the_drafter_where_they_start_and_which_are_probes():
    """ChunkTask.num_generated_tokens is the response length before the chunk; probe is
    set for sample 0 under the context policy only (the drafter weights probes by lambda)."""
    for policy, expect_probe in (("context", True), ("divided", False)):
        sched = scheduler(policy, engines=1)
        lengths = [[40, 40]]
        r = rollout(policy, lengths)
        sched.submit(r)
        seen: list[tuple[int, int, bool]] = []
        while not r.done:
            for d in sched.schedule():
                seen.append((d.request.sample_index, d.task.num_generated_tokens, d.task.probe))
                assert d.task.num_generated_tokens == d.request.num_generated_tokens
                run_chunk(sched, d, 40)
        starts = sorted((i, n) for i, n, _ in seen)
        assert starts == [(i, n) for i in (0, 1) for n in (0, 16, 32)]
        assert {(i, p) for i, _, p in seen} == {(0, expect_probe), (1, False)}


def test_stop_strings_are_accepted_by_every_policy():
    """Stop strings keep their meaning across chunk edges (controlplane/stops.py), so
    every policy accepts them."""
    limits = Limits(max_group_size=8, max_prompts=8, max_model_len=512, vocab_size=259)
    for policy in ("group", "request", "divided", "context", "oracle", "oracle-full", "oracle-order", "oracle-group"):
        oracle = policy.startswith("oracle")  # the oracles take recorded lengths of a seeded run
        req = RolloutRequest(call_id="c", rollout_id="r", prompts=[Prompt(prompt="hi")], group_size=1,
                             sampling=SamplingParams(stop=["\n\n"], seed=1 if oracle else None),
                             true_lengths=[[5]] if oracle else None)
        assert build_rollout(req, ByteTokenizer(), limits, policy, 0.0).num_samples == 1


@settings(max_examples=60, deadline=None, database=None)
@given(policy=st.sampled_from(["divided", "context", "oracle", "oracle-full", "oracle-group"]),
       lengths=st.lists(st.lists(st.integers(1, 70), min_size=1, max_size=4), min_size=1, max_size=6),
       engines=st.integers(1, 3), kv=st.sampled_from([48, 96, 400]), seed=st.integers(0, 1000))
def test_chunked_policies_finish_every_request_once_without_over_admitting(policy, lengths, engines, kv, seed):
    """For any workload, every request finishes exactly once with its true length (capped
    by max_tokens), no engine's reserved KV exceeds its capacity (except one lone chunk on
    an idle engine), and L̂ never decreases."""
    import random

    from seer.controlplane.policies.ordered import group_estimate

    rng = random.Random(seed)
    sched = scheduler(policy, engines=engines, kv_tokens=kv)
    r = rollout(policy, lengths)
    sched.submit(r)
    inflight: list = []
    last_estimate = {g.group_id: 0 for g in r.groups}
    for _ in range(20_000):
        inflight.extend(sched.schedule())
        for view in sched.engines.values():
            reserved = engine_reserved(view, lambda q: q.context_tokens + q.chunk_max_tokens)
            # over capacity only as the single chunk of an otherwise idle engine
            assert reserved <= view.capabilities.kv_capacity_tokens or view.num_inflight == 1
        if not inflight:
            break
        d = inflight.pop(rng.randrange(len(inflight)))
        run_chunk(sched, d, lengths[d.request.group.group_index][d.request.sample_index])
        for g in r.groups:
            est = group_estimate(g, g.requests[0])
            if any(q.state is RequestState.FINISHED for q in g.requests):
                assert est >= last_estimate[g.group_id]
                last_estimate[g.group_id] = est
    assert r.done
    for g, gl in zip(r.groups, lengths):
        assert [q.num_generated_tokens for q in g.requests] == [min(n, 64) for n in gl]
        assert all(q.state is RequestState.FINISHED for q in g.requests)


def test_context_moves_waiting_siblings_up_when_their_groups_estimate_grows():
    """When a sample finishes longer than its group's L̂, the group's waiting samples are
    re-ranked at once (a raised L̂ lowers their heap key, which lazy re-keying alone
    would never notice)."""
    from seer.controlplane.policies import make_policy
    from seer.controlplane.state import EngineView

    policy = make_policy("context", SchedulerConfig(policy="context", chunk_size_tokens=16, starvation_interval=0,
                                                    kv_admission_fraction=1.0))
    r = rollout("context", [[0, 0, 0], [0, 0, 0]])
    g0, g1 = r.groups
    for probe, n in ((g0.requests[0], 10), (g1.requests[0], 30)):  # probes done: L̂ = 10 and 30
        probe.generated_token_ids = [7] * n
        probe.state, probe.finish_reason = RequestState.FINISHED, "stop"
        probe.group.num_finished = 1
    running = g0.requests[1]
    running.state, running.chunk_max_tokens = RequestState.RUNNING, 16
    engine = EngineView(engine_id=0, capabilities=caps(kv_tokens=32), inflight={1: running})
    for q in (g0.requests[2], g1.requests[1], g1.requests[2]):
        policy.enqueue(q)
    assert policy.assign([engine]) == []  # engine full: nothing moves
    engine.inflight.clear()  # g0's sample finishes at 100 tokens: L̂(g0) = 100 > L̂(g1) = 30
    running.generated_token_ids = [7] * 100
    running.state, running.finish_reason = RequestState.FINISHED, "stop"
    g0.num_finished = 2
    (first,) = policy.assign([engine])[:1]
    assert first.request is g0.requests[2]


@pytest.mark.parametrize("policy", ["divided", "context"])
def test_a_lost_engines_reservations_are_forgotten(policy):
    """Once an engine is lost, admission keeps nothing of it (its last in-flight requests
    would otherwise keep whole rollouts alive in a long-lived daemon)."""
    sched = scheduler(policy, engines=2)
    sched.submit(rollout(policy, [[40] * 4, [40] * 4]))
    assert {d.engine_id for d in sched.schedule()} == {0, 1}
    sched.engine_lost(1)
    sched.schedule()
    assert set(sched.policy(policy)._reservations._by_engine) == {0}


def _live_entries(policy, heap: list, request) -> int:
    return sum(1 for entry in heap if entry[-1] is request and policy._current(request, entry[-2]))


@pytest.mark.parametrize("starvation_interval", [0, 1])
def test_rounds_where_nothing_fits_leave_one_queue_entry_per_waiting_request(starvation_interval):
    """A request skipped because it fits nowhere goes back into the index it was taken
    from only (the policy's order, backfill by need, or the starvation guard): however
    many rounds skip it, each waiting request keeps exactly one live entry per index,
    and the heaps do not grow."""
    # 95 tokens of KV, block 16: a 17-token prompt plus a 16-token chunk needs 33 tokens,
    # 48 once rounded to blocks, so after the first chunks the room is below every need
    # while not below the smallest unrounded need: every round skips by need.
    sched = scheduler("context", engines=1, kv_tokens=95, starvation_interval=starvation_interval)
    r = rollout("context", [[60] * 4 for _ in range(100)], max_tokens=64, prompt_len=17)
    sched.submit(r)
    first = sched.schedule()
    while more := sched.schedule():  # the admission margin, chosen once chunks were seen, may admit a few more
        first += more
    policy = sched._policies["context"]
    sizes = []
    for _ in range(5):
        assert sched.schedule() == []
        sizes.append((len(policy._queue), len(policy._needs), len(policy._starved)))
    assert first and sizes[0] == sizes[-1]
    waiting = [q for g in r.groups for q in g.requests if q.state is RequestState.WAITING]
    assert len(waiting) == 400 - len(first)
    for heap in (policy._queue.entries, policy._needs.entries, policy._starved.entries):
        assert all(_live_entries(policy, heap, q) == 1 for q in waiting)
