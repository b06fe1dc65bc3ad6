"""The `context` policy's length model and its reservation calibration."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from seer.config import SchedulerConfig
from seer.controlplane.policies import make_policy
from seer.controlplane.policies.lengths import RESERVE_QUANTILE, RolloutLengths, remaining_quantile
from seer.controlplane.state import RequestState
from tests.unit.test_chunked_policies import rollout


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


def test_reservation_quantile_rises_while_chunks_outgrow_their_reservations_and_falls_back():
    """Calibration: chunks that generate more than they reserved raise the reservation
    quantile; chunks that generate less bring it back down, never below its base."""
    policy = make_policy("context", SchedulerConfig(policy="context", chunk_size_tokens=16))
    r = rollout("context", [[0] * 64])
    requests = r.groups[0].requests
    for q in requests:
        policy._admitted(q, 4)
        q.generated_token_ids = [7] * 16  # each chunk generated 16, reserved 4
        q.state = RequestState.WAITING
    policy._calibrate(requests)
    raised = policy.reserve_quantile
    assert raised > RESERVE_QUANTILE
    for _ in range(40):
        for q in requests:
            policy._admitted(q, 64)  # now every chunk reserves far more than it generates
            q.generated_token_ids = q.generated_token_ids + [7]
        policy._calibrate(requests)
    assert policy.reserve_quantile == RESERVE_QUANTILE < raised
