"""The engine model: cost model calibration, continuous batching, KV preemption, caching.

Costs are chosen as small binary fractions where times are compared exactly, so the
closed-form segment sums and step-by-step sums agree to the last bit.
"""

from __future__ import annotations

import random

import pytest

from seer.sim.engine_model import CostModel, FinishedChunk, SimEngineError, SimEngineModel

UNIT = CostModel(a=1.0, b=0.0, c=0.0, p=0.0, pool_s_per_token=0.0)


def run_by_steps(engine: SimEngineModel, now: float = 0.0) -> list[tuple[float, FinishedChunk]]:
    """Call ``step`` until the engine is idle; (finish time, chunk) for every finish."""
    out = []
    while not engine.idle:
        duration, finished = engine.step(now)
        now += duration
        out += [(now, f) for f in finished]
    return out


def run_by_segments(engine: SimEngineModel, now: float = 0.0) -> list[tuple[float, FinishedChunk]]:
    """Drive the engine with begin/commit segments until idle."""
    out = []
    while not engine.idle:
        end = engine.begin(now)
        assert end is not None
        finished = engine.commit()
        now = end
        out += [(now, f) for f in finished]
    return out


def random_workload(engine: SimEngineModel, seed: int, n: int = 30) -> None:
    rng = random.Random(seed)
    for i in range(n):
        engine.add(i, f"r{i}", rng.randint(1, 40), rng.randint(1, 60), rng.randint(1, 80))


def test_cpu_preset_reproduces_the_measured_engine_facts():
    """cpu_smollm2 gives the measured 64x128 run (~102 s), ~10 tok/s alone, 4.65 s per 3,000-token prefill."""
    cost = CostModel.cpu_smollm2()
    engine = SimEngineModel(0, cost, kv_capacity_tokens=46_592)
    for i in range(64):
        engine.add(i, f"r{i}", context_tokens=64, max_tokens=128, true_remaining_tokens=10_000)
    finished = run_by_segments(engine)
    assert len(finished) == 64
    assert all(f.num_tokens == 128 and f.finish_reason == "length" for _, f in finished)
    assert finished[-1][0] == pytest.approx(102.2, rel=0.03)
    assert 1.0 / cost.decode_step_s(1, 128) == pytest.approx(10.0, rel=0.05)
    assert cost.p * 3000 == pytest.approx(4.65, rel=0.01)


def test_continuous_batching_finishes_each_chunk_at_its_own_step():
    """Two sequences share steps; each finishes on its own step with stop (true end) or length (budget)."""
    engine = SimEngineModel(0, UNIT, kv_capacity_tokens=1000)
    engine.add(1, "a", context_tokens=4, max_tokens=10, true_remaining_tokens=3)
    engine.add(2, "b", context_tokens=4, max_tokens=5, true_remaining_tokens=50)

    finished = run_by_steps(engine)

    assert finished == [(3.0, FinishedChunk(1, 3, "stop")), (5.0, FinishedChunk(2, 5, "length"))]
    assert engine.num_output_tokens == 8 and engine.num_steps == 5 and engine.busy_s == 5.0
    assert engine.step(5.0) == (0.0, [])  # an idle engine does not step


def test_kv_overflow_preempts_the_latest_admitted_which_then_reprefills_its_whole_context():
    """When the next token does not fit, the latest admitted sequence is evicted and later re-prefilled."""
    cost = CostModel(a=1.0, b=0.0, c=0.0, p=0.5, pool_s_per_token=0.0)
    engine = SimEngineModel(0, cost, kv_capacity_tokens=20)
    engine.add(1, "a", context_tokens=5, max_tokens=20, true_remaining_tokens=8)
    engine.add(2, "b", context_tokens=5, max_tokens=20, true_remaining_tokens=8)

    finished = run_by_steps(engine)

    # t=6: prefill 10 tokens (5 s) + step 1; steps 2-5 fill the KV to 20 tokens (t=10); step 6
    # has no room for two more tokens, so b (admitted last) is preempted with 5 tokens done
    # and a runs alone to its 8th token (t=13). Then b re-prefills its 10-token context (5 s)
    # and decodes its 3 remaining tokens: t = 13 + 5 + 3 = 21.
    assert finished == [(13.0, FinishedChunk(1, 8, "stop")), (21.0, FinishedChunk(2, 8, "stop"))]
    assert engine.num_preemptions == 1
    assert engine.num_prefill_tokens == 5 + 5 + 10
    assert engine.load().num_preemptions == 1


@pytest.mark.parametrize("kv_capacity_tokens", [150, 250, 10_000])
def test_segments_give_exactly_the_schedule_of_single_steps(kv_capacity_tokens):
    """Committing runs of identical steps at once reproduces step-by-step finishes, preemptions, prefills."""
    cost = CostModel(a=1.0, b=0.25, c=0.125, p=0.5, pool_s_per_token=0.0)
    by_steps = SimEngineModel(0, cost, kv_capacity_tokens, max_num_seqs=8)
    by_segments = SimEngineModel(0, cost, kv_capacity_tokens, max_num_seqs=8)
    random_workload(by_steps, seed=3)
    random_workload(by_segments, seed=3)

    expected = run_by_steps(by_steps)
    got = run_by_segments(by_segments)

    assert got == expected and len(got) == 30
    assert (by_segments.num_preemptions, by_segments.num_prefill_tokens, by_segments.num_steps) == (
        by_steps.num_preemptions, by_steps.num_prefill_tokens, by_steps.num_steps)
    if kv_capacity_tokens < 1000:
        assert by_steps.num_preemptions > 0  # the small caches really exercise preemption
    assert by_segments.num_steps > len(got)  # segments spanned several steps


def test_work_added_mid_segment_is_admitted_at_the_next_step_boundary():
    """Cutting an open segment for new work gives the same schedule as adding it between single steps."""
    cost = CostModel(a=1.0, b=0.5, c=0.25, p=0.125, pool_s_per_token=0.0)
    stepped = SimEngineModel(0, cost, 10_000)
    segmented = SimEngineModel(0, cost, 10_000)
    for engine in (stepped, segmented):
        engine.add(1, "a", context_tokens=8, max_tokens=40, true_remaining_tokens=40)

    end = segmented.begin(0.0)
    assert end is not None
    cut_end = segmented.cut(7.3)  # work arrives at t=7.3, inside the segment
    assert 7.3 <= cut_end < end
    segmented.commit()
    segmented.add(2, "b", context_tokens=4, max_tokens=6, true_remaining_tokens=6)
    late = run_by_segments(segmented, cut_end)

    now, early = 0.0, []
    while now < 7.3:  # single steps until the one in progress at 7.3 completes
        duration, finished = stepped.step(now)
        now += duration
        early += finished
    assert now == cut_end and early == []
    stepped.add(2, "b", context_tokens=4, max_tokens=6, true_remaining_tokens=6)
    assert late == run_by_steps(stepped, now)


def test_a_continued_chunk_prefills_only_its_uncached_tail_and_a_migrated_one_loads_from_the_pool():
    """The same request back on its engine hits its cached KV; on another engine it pays the pool cost."""
    cost = CostModel(a=0.0, b=0.0, c=0.0, p=1.0, pool_s_per_token=0.25)
    home = SimEngineModel(0, cost, 1000)
    other = SimEngineModel(1, cost, 1000)
    home.add(1, "req", context_tokens=10, max_tokens=4, true_remaining_tokens=100)
    assert home.step(0.0) == (10.0, [])  # prefill of the 10-token prompt
    run_by_steps(home)  # three more steps, chunk done: context 14 cached here

    home.add(2, "req", context_tokens=16, max_tokens=1, true_remaining_tokens=100)  # 2 tokens it never saw
    assert home.step(0.0) == (2.0, [FinishedChunk(2, 1, "length")])
    other.add(3, "req", context_tokens=17, max_tokens=1, true_remaining_tokens=100, pooled_tokens=17)
    assert other.step(0.0) == (17 * 0.25, [FinishedChunk(3, 1, "length")])
    assert (home.num_prefill_tokens, other.num_prefill_tokens, other.num_pool_tokens) == (12, 0, 17)


def test_load_reports_running_waiting_and_kv_usage_at_a_point_in_a_segment():
    """load() counts running and waiting chunks; inside a segment its KV usage grows with the steps done."""
    engine = SimEngineModel(0, UNIT, kv_capacity_tokens=100, max_num_seqs=2)
    for i in range(3):
        engine.add(i, f"r{i}", context_tokens=10, max_tokens=20, true_remaining_tokens=20)
    end = engine.begin(0.0)
    assert end == 20.0  # both admitted run 20 identical steps in one segment

    assert engine.load().num_running == 2 and engine.load().num_waiting == 1
    assert engine.load().kv_usage == pytest.approx(0.20)
    assert engine.load(now=5.0).kv_usage == pytest.approx(0.30)  # 5 steps x 2 tokens more
    engine.commit()
    assert engine.load().num_running == 0 and engine.load().kv_usage == 0.0


def test_a_sequence_larger_than_the_whole_kv_cache_is_an_error_not_a_hang():
    """A chunk that could never fit raises SimEngineError naming the capacity."""
    engine = SimEngineModel(0, UNIT, kv_capacity_tokens=10)
    engine.add(1, "big", context_tokens=12, max_tokens=5, true_remaining_tokens=5)
    with pytest.raises(SimEngineError, match="10"):
        engine.step(0.0)

    growing = SimEngineModel(0, UNIT, kv_capacity_tokens=10)
    growing.add(1, "grows", context_tokens=5, max_tokens=50, true_remaining_tokens=50)
    with pytest.raises(SimEngineError, match="kv_capacity_tokens"):
        run_by_steps(growing)


def test_abort_removes_a_running_or_waiting_chunk_and_frees_its_kv():
    """An aborted chunk never finishes and its KV is released for the others."""
    engine = SimEngineModel(0, UNIT, kv_capacity_tokens=100, max_num_seqs=1)
    engine.add(1, "a", context_tokens=10, max_tokens=5, true_remaining_tokens=5)
    engine.add(2, "b", context_tokens=10, max_tokens=5, true_remaining_tokens=5)
    engine.add(3, "c", context_tokens=10, max_tokens=5, true_remaining_tokens=5)
    engine.step(0.0)

    assert engine.abort(1) and engine.abort(3) and not engine.abort(99)
    assert engine.load().kv_usage == 0.0 and engine.load().num_waiting == 1
    assert [f.task_id for _, f in run_by_steps(engine, 1.0)] == [2]


def test_siblings_share_their_prompt_prefix_in_kv_and_prefill():
    """Chunks naming the same prefix hold its KV once and prefill it once; a later sibling hits the cache."""
    cost = CostModel(a=0.0, b=0.0, c=0.0, p=1.0, pool_s_per_token=0.0)
    engine = SimEngineModel(0, cost, kv_capacity_tokens=100)
    for task_id in (1, 2):
        engine.add(task_id, f"s{task_id}", context_tokens=30, max_tokens=2, true_remaining_tokens=9,
                   prefix_key="group", prefix_tokens=30)

    assert engine.step(0.0) == (30.0, [])  # one prefill of the shared 30-token prompt
    assert engine.load().kv_usage == pytest.approx((30 + 2) / 100)  # prompt once + one token each
    run_by_steps(engine)
    engine.add(3, "s3", context_tokens=30, max_tokens=1, true_remaining_tokens=9,
               prefix_key="group", prefix_tokens=30)
    assert engine.step(0.0) == (0.0, [FinishedChunk(3, 1, "length")])  # the prompt is still cached
    assert engine.num_prefill_tokens == 30


def test_cut_and_load_inside_a_segment_agree_with_single_step_boundaries():
    """For arrival times across a segment, cut() picks the next step boundary and load(now) the steps done."""
    cost = CostModel(a=0.5, b=0.25, c=0.125, p=0.0625, pool_s_per_token=0.0)

    def fresh() -> SimEngineModel:
        engine = SimEngineModel(0, cost, 10_000)
        for i in range(3):
            engine.add(i, f"r{i}", context_tokens=16, max_tokens=30, true_remaining_tokens=30)
        return engine

    stepped, boundaries, now = fresh(), [], 0.0
    for _ in range(30):
        duration, _ = stepped.step(now)
        now += duration
        boundaries.append(now)
    for arrival in [0.01, boundaries[0], 3.3, boundaries[7], boundaries[7] + 1e-9, 50.0, boundaries[-1] - 0.01]:
        engine = fresh()
        assert engine.begin(0.0) == boundaries[-1]  # one segment of 30 identical steps
        done = sum(b <= arrival for b in boundaries)
        assert engine.load(now=arrival).kv_usage == pytest.approx((3 * 16 + 3 * done) / 10_000)
        assert engine.cut(arrival) == min(b for b in boundaries if b >= arrival)
