"""The `context` policy's length model, its reservation and the reservation's calibration."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer.config import SchedulerConfig
from seer.controlplane.policies import make_policy
from seer.controlplane.policies.lengths import (CALIBRATION_EVERY, CALIBRATION_MIN_SCALE, RESERVE_Z, RolloutLengths,
                                                UseCalibration, chunk_use, remaining_quantile)
from seer.controlplane.state import RequestState
from tests.unit.test_chunked_policies import caps, rollout, scheduler


def test_a_group_posterior_uses_every_finished_sample_not_only_the_longest():
    """Two groups with the same longest sample differ when their other finished samples do."""
    model = RolloutLengths(max_tokens=100_000)
    for n in (1000, 100, 100, 100):
        model.observe(0, n)
    for n in (1000, 900, 900, 900):
        model.observe(1, n)
    assert model.group_posterior(0)[0] < model.group_posterior(1)[0]
    # more evidence narrows the predictive spread
    assert model.group_posterior(1)[1] < model.group_posterior(2)[1]


@settings(max_examples=200, deadline=None, database=None)
@given(mean=st.floats(3, 10), sd=st.floats(0.1, 2), generated=st.integers(0, 50_000),
       q=st.floats(0.05, 0.995), max_tokens=st.integers(50_001, 200_000))
def test_remaining_quantile_stays_within_the_budget_and_grows_with_the_quantile(mean, sd, generated, q, max_tokens):
    """The estimate is in [1, max_tokens - generated], and a higher quantile never gives less."""
    low = remaining_quantile(mean, sd, generated, max_tokens, q)
    high = remaining_quantile(mean, sd, generated, max_tokens, min(0.999, q + 0.004))
    assert 1 <= low <= high <= max_tokens - generated


def test_a_sample_that_outlived_its_group_is_estimated_longer():
    """The total length a sample is expected to reach grows with what it has generated
    (it is read from L | L > generated)."""
    mean, sd = math.log(1000), 0.8
    totals = [g + remaining_quantile(mean, sd, g, 1_000_000, 0.5) for g in (0, 1000, 5000, 20000)]
    assert totals == sorted(totals) and totals[-1] > 20000


@pytest.mark.parametrize("mean, sd, generated, budget, max_tokens", [
    (math.log(1000), 0.8, 0, 8192, 65536),  # most samples end inside the chunk
    (math.log(1000), 0.8, 5000, 8192, 65536),  # a sample that outlived its group
    (math.log(20000), 1.0, 8192, 8192, 65536),  # most use the whole budget
    (math.log(20000), 1.0, 60000, 8192, 65536),  # the chunk is cut by max_tokens
])
def test_chunk_use_matches_sampled_lengths(mean, sd, generated, budget, max_tokens):
    """The closed-form mean and spread of a chunk's use equal those of sampled lengths
    (L | L > generated, cut at the chunk's end and at max_tokens)."""
    rng = random.Random(7)
    uses: list[float] = []
    while len(uses) < 40_000:
        length = math.exp(rng.gauss(mean, sd))
        if length > generated:
            uses.append(min(length, generated + budget, max_tokens) - generated)
    m = sum(uses) / len(uses)
    s = math.sqrt(sum((u - m) ** 2 for u in uses) / len(uses))
    got_mean, got_sd = chunk_use(mean, sd, generated, budget, max_tokens)
    assert got_mean == pytest.approx(m, rel=0.03) and got_sd == pytest.approx(s, rel=0.03)


@settings(max_examples=200, deadline=None, database=None)
@given(mean=st.floats(3, 10), sd=st.floats(0.1, 2), generated=st.integers(0, 50_000),
       budget=st.integers(1, 20_000), max_tokens=st.integers(50_001, 200_000))
def test_chunk_use_stays_within_the_chunk(mean, sd, generated, budget, max_tokens):
    """The expected use is in [1, budget] and the spread is finite and never negative; a
    longer budget never lowers the expected use."""
    m, s = chunk_use(mean, sd, generated, budget, max_tokens)
    assert 1 <= m <= budget and 0 <= s < math.inf
    assert chunk_use(mean, sd, generated, budget + 1000, max_tokens)[0] >= m * (1 - 1e-9)


def _reservation(context_tokens: int, kv_tokens: int) -> tuple[int, float, float]:
    """(reserved tokens beyond the context, expected use, its sd) of a fresh sample's first
    chunk of 4,096 tokens with a prompt of ``context_tokens``, on engines of ``kv_tokens``."""
    sched = scheduler("context", engines=1, kv_tokens=kv_tokens, chunk_size_tokens=4096)
    r = rollout("context", [[0, 0]], max_tokens=32_768, prompt_len=context_tokens)
    sched.submit(r)
    policy = sched.policy("context")
    sched.schedule()  # the engines' capacity is read, and the needs computed with it
    request = r.groups[0].requests[1]
    mean, sd = policy._use(request, 4096)
    return policy._reserve(request, 4096) - context_tokens, mean, sd


def test_a_chunk_reserves_its_mean_plus_a_margin_that_shrinks_with_its_share_of_the_engine():
    """Many small chunks fit on an engine, and their total varies little around its mean:
    each reserves close to its expected use. A chunk as large as the engine reserves
    RESERVE_Z standard deviations above it."""
    small, mean, sd = _reservation(16, 10_000_000)
    assert mean < small < mean + 0.2 * sd
    large, mean, sd = _reservation(16, 8_000)
    assert large == min(4096, math.ceil(mean + RESERVE_Z * sd))


def test_needs_computed_before_any_engine_joined_are_renewed_when_one_does():
    """A rollout submitted before the engines: its waiting requests' reservations depend on
    the engines' capacity, so they are computed again once it is known."""
    sched = scheduler("context", engines=0, chunk_size_tokens=4096)
    r = rollout("context", [[0] * 4], max_tokens=32_768)
    sched.submit(r)
    policy = sched.policy("context")
    before = dict(policy._need_of)
    sched.engine_joined(0, caps(10_000_000))
    sched.schedule()
    held = policy._reservations._by_engine[0].own  # the dispatched chunks' own reservations (prompt apart)
    assert held and all(held[q] + len(q.prompt_token_ids) // 16 * 16 < before[q] for q in held)
    assert policy._needs_capacity == 10_000_000


def test_chunks_that_use_more_than_expected_raise_the_scale_at_once():
    """Returned chunks that used twice what the model expected scale every later
    expectation up by the next reading, while older chunks are still in flight."""
    cal = UseCalibration()
    cal.admitted("old", 100.0)  # in flight throughout
    for i in range(CALIBRATION_EVERY):
        cal.admitted(i, 100.0)
        cal.returned(i, 200)
    assert cal.scale == pytest.approx(2.0)


def test_short_chunks_returning_first_do_not_lower_the_scale_until_their_cohort_is_complete():
    """Chunks return shortest first: short ones back while a long one admitted before them is
    still running say nothing yet about the mean. Once it returns, the cohort is complete
    and its ratio counts; the scale never falls below its floor."""
    cal = UseCalibration()
    cal.admitted("long", 100.0)
    for i in range(4 * CALIBRATION_EVERY):
        cal.admitted(i, 100.0)
        cal.returned(i, 10)
    assert cal.scale == 1.0
    cal.returned("long", 100)
    for i in range(CALIBRATION_EVERY - 1):  # the next reading
        cal.admitted(("next", i), 100.0)
        cal.returned(("next", i), 10)
    assert cal.scale == CALIBRATION_MIN_SCALE


def test_a_dropped_chunk_does_not_hold_its_cohort_open():
    cal = UseCalibration()
    cal.admitted("cancelled", 100.0)
    for i in range(CALIBRATION_EVERY - 1):
        cal.admitted(i, 100.0)
        cal.returned(i, 60)
    cal.dropped("cancelled")
    cal.admitted("last", 100.0)
    cal.returned("last", 60)
    assert cal.scale == pytest.approx(0.6)


def test_a_chunk_admitted_again_without_returning_does_not_hold_its_cohort_open():
    """A key admitted while its last chunk never reported back: the old record no longer
    blocks the cohort (else every later record would queue behind it for good)."""
    cal = UseCalibration()
    cal.admitted("lost", 100.0)
    cal.admitted("lost", 100.0)
    cal.returned("lost", 60)
    for i in range(CALIBRATION_EVERY - 1):
        cal.admitted(i, 100.0)
        cal.returned(i, 60)
    assert cal.scale == pytest.approx(0.6) and not cal._order


def test_the_policy_scales_its_reservations_by_the_calibration():
    """Once returned chunks read 1.5x the model's expectation, a chunk reserves half its
    expected use more (the margin stays: before any engine is read, it is the whole RESERVE_Z sd)."""
    sched = scheduler("context", engines=1, kv_tokens=10_000_000, chunk_size_tokens=32_768)
    policy = sched.policy("context")
    r = rollout("context", [[0, 0]], max_tokens=32_768)
    sched.submit(r)
    request = r.groups[0].requests[1]
    mean, sd = policy._use(request, 32_768)
    before = policy._reserve(request, 32_768) - request.context_tokens
    policy.calibrations[0].scale = 1.5  # the request has generated nothing: its first chunk's stage
    after = policy._reserve(request, 32_768) - request.context_tokens
    assert before == math.ceil(mean + RESERVE_Z * sd) and after - before == pytest.approx(0.5 * mean, abs=1)


def test_first_chunks_that_used_less_do_not_shrink_a_later_chunks_reservation():
    """Calibration is kept per stage of a sample (its first chunk, its second, the rest):
    first chunks that used 0.6x what the model expected scale down the next first chunk's
    reservation, not that of a sample on its third chunk (the model's error differs by
    stage; one shared scale once cut third chunks' reservations by a third and preempted)."""
    chunk = 1024
    sched = scheduler("context", engines=1, kv_tokens=10_000_000, chunk_size_tokens=chunk)
    policy = sched.policy("context")
    r = rollout("context", [[0] * 8 for _ in range(8)], max_tokens=32_768)
    sched.submit(r)
    fresh, late = r.groups[0].requests[1], r.groups[0].requests[2]
    late.generated_token_ids = [7] * (2 * chunk)
    before = (policy._reserve(fresh, chunk), policy._reserve(late, chunk))
    firsts = [q for g in r.groups[1:] for q in g.requests]
    for q in firsts:
        policy._admitted(q, chunk)
    for q in firsts:  # each used 0.6x its expectation, and every cohort is complete
        q.generated_token_ids = [7] * round(0.6 * policy._use(q, chunk)[0])
        policy._calibrate([q])
    assert [c.scale for c in policy.calibrations] == [pytest.approx(0.6, abs=0.01), 1.0, 1.0]
    assert policy._reserve(fresh, chunk) < before[0] and policy._reserve(late, chunk) == before[1]
