"""The speculative-decoding cost model: expected tokens, T_SD, the step-time fit, the
acceptance estimator and the per-step draft-length choice."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer.specdecode import (
    AcceptanceTracker,
    DraftTimeModel,
    SpecRow,
    StepTimeModel,
    choose_draft_lengths,
    expected_tokens,
    t_sd,
    tail_weights,
)

# A GPU-like step: 25 ms fixed, 0.05 ms per sequence, 0.02 ms per scheduled token.
GPU = StepTimeModel(0.025, 5e-5, 2e-5)
alphas = st.floats(min_value=0.0, max_value=0.99, allow_nan=False)


def test_expected_tokens_closed_form_matches_the_sum_of_beta() -> None:
    """E(α, γ) = Σ_{j≤γ} α^j, γ + 1 at α = 1, 1 at γ = 0."""
    for alpha in (0.0, 0.3, 0.7, 0.95):
        for gamma in range(10):
            assert expected_tokens(alpha, gamma) == pytest.approx(sum(alpha**j for j in range(gamma + 1)))
    assert expected_tokens(1.0, 7) == 8.0
    assert expected_tokens(0.5, 0) == 1.0
    with pytest.raises(ValueError):
        expected_tokens(1.2, 3)
    with pytest.raises(ValueError):
        expected_tokens(0.5, -1)


def test_t_sd_is_the_spec_formula() -> None:
    """t_sd = (1−α)(D + T) / (1 − α^(γ+1)), per sequence of the batch."""
    draft = DraftTimeModel(fixed_s=1e-3, per_seq_s=1e-4, per_draft_s=1e-5)
    alpha, gamma, batch = 0.6, 4, 8
    target = GPU.predict(batch, batch * (gamma + 1))
    drafting = 1e-3 + 1e-4 * batch + 1e-5 * batch * gamma
    want = (1 - alpha) * (drafting + target) / (1 - alpha ** (gamma + 1)) / batch
    assert t_sd(alpha, gamma, batch, GPU, draft) == pytest.approx(want)
    assert t_sd(alpha, 0, batch, GPU, draft) == pytest.approx(GPU.predict(batch, batch) / batch)


def test_no_speculation_when_the_step_grows_steeply_with_tokens() -> None:
    """At a large batch, where each extra token costs about as much as the whole step
    per token, no draft pays; at B = 1 the same model drafts the maximum."""
    compute_bound = StepTimeModel(0.005, 0.0, 1e-4)  # 256 tokens: 30.6 ms, 5 ms of it fixed
    assert choose_draft_lengths([SpecRow(0.6)] * 256, compute_bound, 8) == [0] * 256
    assert choose_draft_lengths([SpecRow(0.6)] * 256, GPU, 8, lam=2.0)[0] > 0  # memory-bound: it pays
    assert choose_draft_lengths([SpecRow(0.9)], compute_bound, 8) == [8]


def test_small_batch_high_acceptance_drafts() -> None:
    """The small-batch tail with high acceptance gets long drafts."""
    assert choose_draft_lengths([SpecRow(0.8)] * 4, GPU, 8) == [8] * 4
    assert choose_draft_lengths([SpecRow(0.0)] * 4, GPU, 8) == [0] * 4


def test_the_chosen_uniform_gamma_minimises_t_sd() -> None:
    """With equal rows and no probes the choice is the γ that minimises t_sd."""
    for batch in (1, 8, 64, 256):
        for alpha in (0.2, 0.5, 0.8):
            chosen = choose_draft_lengths([SpecRow(alpha)] * batch, GPU, 8)
            best = min(range(9), key=lambda g: t_sd(alpha, g, batch, GPU))
            # Equal rows may split a budget unevenly (K not a multiple of B); the
            # chosen step is never slower per token than the best uniform γ.
            per_token = ((GPU.predict(batch, batch + sum(chosen)))
                         / sum(expected_tokens(alpha, g) for g in chosen))
            assert per_token <= t_sd(alpha, best, batch, GPU) * (1 + 1e-9)
            assert max(chosen) - min(chosen) <= 1


@settings(max_examples=60, deadline=None)
@given(st.lists(alphas, min_size=1, max_size=40), st.integers(1, 8), st.sampled_from([1.0, 2.0, 4.0]),
       st.integers(0, 200))
def test_budget_and_cap_are_respected(row_alphas: list[float], gamma_max: int, lam: float, budget: int) -> None:
    """Every row gets 0..γ_max drafts and the total never exceeds max_drafts."""
    rows = [SpecRow(a, probe=i % 3 == 0) for i, a in enumerate(row_alphas)]
    out = choose_draft_lengths(rows, GPU, gamma_max, lam=lam, max_drafts=budget)
    assert len(out) == len(rows)
    assert all(0 <= g <= gamma_max for g in out)
    assert sum(out) <= budget


@settings(max_examples=60, deadline=None)
@given(st.lists(alphas, min_size=2, max_size=40), st.integers(0, 39), st.floats(0.0, 0.2))
def test_monotone_in_alpha(row_alphas: list[float], which: int, raise_by: float) -> None:
    """Raising one row's α never shortens its draft."""
    which %= len(row_alphas)
    rows = [SpecRow(a) for a in row_alphas]
    before = choose_draft_lengths(rows, GPU, 8)[which]
    rows[which] = SpecRow(min(0.99, row_alphas[which] + raise_by))
    assert choose_draft_lengths(rows, GPU, 8)[which] >= before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(alphas, st.booleans()), min_size=1, max_size=40), st.sampled_from([1.0, 2.0, 3.0]))
def test_probes_never_get_less_than_non_probes_at_equal_alpha(rows_in: list[tuple[float, bool]],
                                                              lam: float) -> None:
    """A probe gets at least as many drafts as any non-probe with the same (or lower) α."""
    rows = [SpecRow(a, p) for a, p in rows_in]
    out = choose_draft_lengths(rows, GPU, 8, lam=lam)
    for i, probe in enumerate(rows):
        for j, other in enumerate(rows):
            if probe.probe and not other.probe and probe.alpha >= other.alpha:
                assert out[i] >= out[j]


def test_lambda_shifts_drafts_to_probes() -> None:
    """With a tight budget, λ = 2 hands the drafts to probes first."""
    rows = [SpecRow(0.6, probe=True), SpecRow(0.7), SpecRow(0.6, probe=True), SpecRow(0.7)]
    out = choose_draft_lengths(rows, GPU, 8, lam=2.0, max_drafts=2)
    assert out == [1, 0, 1, 0]
    out = choose_draft_lengths(rows, GPU, 8, lam=1.0, max_drafts=2)
    assert out == [0, 1, 0, 1]


def test_a_fixed_drafting_cost_does_not_hide_a_paying_budget() -> None:
    """D's fixed part makes the first draft expensive but later ones cheap: the choice
    still finds the paying budget (the K = 0 comparison is made after the search)."""
    draft = DraftTimeModel(fixed_s=0.02)
    assert sum(choose_draft_lengths([SpecRow(0.9)] * 8, GPU, 8, draft_time=draft)) == 64
    huge = DraftTimeModel(fixed_s=10.0)
    assert choose_draft_lengths([SpecRow(0.9)] * 8, GPU, 8, draft_time=huge) == [0] * 8


def test_choice_minimises_the_weighted_ratio_by_brute_force() -> None:
    """On small random batches the greedy + quasi-convex search equals an exhaustive
    search over every allocation (γ_max = 3, up to 4 rows)."""
    rng = random.Random(5)
    model = StepTimeModel(0.01, 1e-4, 2e-3)  # steep enough that the optimum is interior
    for _ in range(40):
        rows = [SpecRow(round(rng.random(), 2), rng.random() < 0.4) for _ in range(rng.randint(1, 4))]
        weights = [2.0 if r.probe else 1.0 for r in rows]

        def ratio(gs: tuple[int, ...]) -> float:
            w = sum(wi * expected_tokens(r.alpha, g) for wi, r, g in zip(weights, rows, gs))
            return model.predict(len(rows), len(rows) + sum(gs)) / w

        grid = [()]
        for _ in rows:
            grid = [g + (k,) for g in grid for k in range(4)]
        best = min(ratio(g) for g in grid)
        chosen = tuple(choose_draft_lengths(rows, model, 3, lam=2.0))
        assert ratio(chosen) == pytest.approx(best, rel=1e-9)


def test_step_time_model_predicts_from_its_prior_and_learns_the_truth() -> None:
    """Before data it predicts the profile; fed noisy steps of another linear law over a
    spread of batches and draft lengths it converges to that law."""
    model = StepTimeModel(0.02, 1e-4, 1e-5)
    assert model.predict(10, 50) == pytest.approx(0.02 + 1e-3 + 5e-4)
    rng = random.Random(1)
    truth = (0.03, 2e-4, 4e-5)
    for _ in range(3000):
        batch = rng.randint(1, 256)
        tokens = batch * (1 + rng.randint(0, 8))
        seconds = (truth[0] + truth[1] * batch + truth[2] * tokens) * (1 + rng.gauss(0, 0.02))
        model.observe(batch, tokens, seconds)
    for batch, tokens in ((1, 1), (64, 64), (64, 576), (256, 2304)):
        want = truth[0] + truth[1] * batch + truth[2] * tokens
        assert model.predict(batch, tokens) == pytest.approx(want, rel=0.05)
    assert model.num_observed == 3000


def test_step_time_model_survives_a_steady_batch() -> None:
    """Thousands of identical steps (no excitation) neither blow the fit up nor forget
    how tokens cost: predictions elsewhere stay finite and near the prior's shape."""
    model = StepTimeModel(0.02, 1e-4, 1e-5, forgetting=0.99)
    for _ in range(20000):
        model.observe(32, 32, 0.02 + 32e-4 + 32e-5)
    assert model.predict(32, 32) == pytest.approx(0.02 + 32e-4 + 32e-5, rel=1e-3)
    assert all(math.isfinite(c) for c in model.coefficients)
    assert 0.0 < model.predict(32, 288) < 1.0


def test_step_time_from_profile_recovers_a_linear_profile() -> None:
    """OLS over a B × γ grid recovers the coefficients that generated it."""
    points = [(b, b * (g + 1), 0.025 + 5e-5 * b + 2e-5 * b * (g + 1)) for b in (1, 8, 64) for g in (0, 4, 8)]
    model = StepTimeModel.from_profile(points)
    assert model.coefficients == pytest.approx((0.025, 5e-5, 2e-5, 0.0, 0.0), rel=1e-6)
    with pytest.raises(ValueError):
        StepTimeModel.from_profile([(8, 8, 0.1), (8, 8, 0.1), (8, 8, 0.1)])


def truncated_geometric(rng: random.Random, alpha: float, gamma: int) -> int:
    """Accepted drafts of one proposal of ``gamma`` drafts at per-token acceptance α."""
    k = 0
    while k < gamma and rng.random() < alpha:
        k += 1
    return k


@pytest.mark.parametrize("alpha", [0.2, 0.55, 0.9])
def test_acceptance_estimator_converges_on_truncated_geometric_data(alpha: float) -> None:
    """Σk / (Σk + rejections) converges to the true α; accepted/proposed would not."""
    rng = random.Random(int(alpha * 100))
    tracker = AcceptanceTracker()
    proposed = accepted = 0
    for _ in range(20000):
        gamma = rng.randint(1, 8)
        k = truncated_geometric(rng, alpha, gamma)
        tracker.record("g", gamma, k)
        proposed += gamma
        accepted += k
    assert tracker.alpha("g") == pytest.approx(alpha, abs=0.01)
    assert accepted / proposed < alpha - 0.05  # the naive ratio is biased low


def test_acceptance_prior_for_unseen_groups_and_forget() -> None:
    """An unseen group gets the pooled estimate (prior_alpha before any data); a group's
    own data pulls it away; forget drops the group but keeps it in the pool."""
    tracker = AcceptanceTracker(prior_alpha=0.4, prior_strength=4.0)
    assert tracker.alpha("new") == pytest.approx(0.4)
    for _ in range(200):
        tracker.record("good", 8, 8)  # never rejected
    for _ in range(200):
        tracker.record("bad", 8, 0)
    assert tracker.alpha("good") > 0.95
    assert tracker.alpha("bad") < 0.05
    pooled = tracker.population_alpha()
    assert tracker.alpha("unseen") == pytest.approx(pooled)
    assert 0.8 < pooled < 0.95  # 1600 accepted against 200 rejections
    tracker.forget("good")
    assert tracker.alpha("good") == pytest.approx(pooled)
    assert len(tracker) == 1
    tracker.record("x", 0, 0)  # nothing proposed: no information
    assert len(tracker) == 1
    with pytest.raises(ValueError):
        tracker.record("x", 2, 3)


# ---- the step-time fit on real step records: context terms, robustness ---------------


def test_step_time_model_learns_the_context_terms() -> None:
    """Steps whose cost grows with the batch's context and with the context its extra
    tokens (drafts, prefill) attend to: the fit finds both, so one more draft for a
    long-context row costs more."""
    model = StepTimeModel(0.1, 1e-3, 1e-3, 0.0, 0.0)
    rng = random.Random(3)
    truth = (0.13, 3e-3, 2e-3, 1.2e-5, 2e-6)
    for _ in range(4000):
        batch = rng.randint(1, 64)
        contexts = [rng.randint(50, 3000) for _ in range(batch)]
        extra = [rng.choice([0, 0, rng.randint(1, 8)]) for _ in range(batch)]
        tokens = batch + sum(extra)
        context = sum(contexts)
        attended = sum(k * c for k, c in zip(extra, contexts))
        seconds = (truth[0] + truth[1] * batch + truth[2] * tokens + truth[3] * context
                   + truth[4] * attended) * (1 + rng.gauss(0, 0.03))
        model.observe(batch, tokens, seconds, context, attended)
    # B and S move together in such data (S ≈ B x the mean context), so b and c are not
    # separately identified; what the choice uses is: whole steps and a draft's cost.
    for batch, context, drafts, attended in ((1, 2000, 0, 0), (1, 2000, 8, 16000), (16, 16000, 0, 0),
                                              (48, 70000, 24, 36000)):
        want = truth[0] + truth[1] * batch + truth[2] * (batch + drafts) + truth[3] * context + truth[4] * attended
        assert model.predict(batch, batch + drafts, context, attended) == pytest.approx(want, rel=0.1)
    for length in (100, 1000, 3000):
        assert model.marginal(length) == pytest.approx(truth[2] + truth[4] * length, rel=0.2)


@settings(max_examples=60, deadline=None)
@given(records=st.lists(st.tuples(st.integers(-5, 300), st.integers(-5, 3000),
                                  st.floats(allow_nan=True, allow_infinity=True),
                                  st.floats(allow_nan=True, allow_infinity=True),
                                  st.floats(allow_nan=True, allow_infinity=True)), max_size=200))
def test_step_time_model_survives_nonsense_records(records) -> None:
    """Any sequence of records (NaN, infinities, negative or zero times, impossible shapes,
    absurd values) leaves finite, bounded, non-negative coefficients and predictions; a
    run of clean steps afterwards brings the fit back."""
    model = StepTimeModel(0.13, 3e-3, 2e-3, 1.2e-5, 1e-6)
    for batch, tokens, seconds, context, attended in records:
        model.observe(batch, tokens, seconds, context, attended)
    assert all(math.isfinite(c) and c >= 0 for c in model.coefficients)
    assert 0 < model.predict(32, 64, 3e4, 3e4) <= model.max_step_s
    rng = random.Random(0)
    for _ in range(3000):
        batch = rng.randint(1, 48)
        drafts = rng.randint(0, 3 * batch)
        context = batch * rng.uniform(200, 2000)
        attended = drafts * rng.uniform(200, 2000)
        model.observe(batch, batch + drafts,
                      0.13 + 3e-3 * batch + 2e-3 * (batch + drafts) + 1.2e-5 * context + 1e-6 * attended,
                      context, attended)
    assert model.predict(32, 64, 3e4, 3e4) == pytest.approx(0.13 + 0.096 + 0.128 + 0.36 + 0.03, rel=0.05)


def test_outlier_steps_barely_move_the_fit() -> None:
    """One step in ten is a 20x stall (a pause, a weight load): the fit of the others holds."""
    model = StepTimeModel(0.1, 1e-3, 1e-3)
    rng = random.Random(4)
    for k in range(4000):
        batch = rng.randint(1, 64)
        tokens = batch * rng.randint(1, 5)
        seconds = 0.13 + 3e-3 * batch + 2e-3 * tokens
        model.observe(batch, tokens, seconds * (20.0 if k % 10 == 0 else 1.0))
    assert model.predict(16, 48) == pytest.approx(0.13 + 0.048 + 0.096, rel=0.1)
    assert model.num_refused == 0


def test_refused_records_are_counted() -> None:
    """Impossible or unbounded records are refused, not fitted."""
    model = StepTimeModel(0.1, 1e-3, 1e-3)
    for record in ((0, 0, 0.1), (4, 2, 0.1), (4, 4, -1.0), (4, 4, float("nan")), (4, 4, 1e9), (4, 4, 0.1, -5.0)):
        assert not model.observe(*record)
    assert model.num_refused == 6 and model.num_observed == 0
    with pytest.raises(ValueError):
        StepTimeModel(-0.1, 0.0, 0.0)


# ---- cost-aware choice, length weights, Thompson draws --------------------------------


def test_drafts_go_where_they_are_cheap_when_contexts_differ() -> None:
    """Same acceptance, one row attends 100 tokens and one 4,000: where attention is a
    large part of a step the short-context row gets more drafts."""
    cpu = StepTimeModel(0.05, 1e-3, 1e-3, 0.0, 1e-5)  # a 4k-context draft costs 41 ms, a 100-token one 2 ms
    out = choose_draft_lengths([SpecRow(0.5, context_tokens=100), SpecRow(0.5, context_tokens=4000)], cpu, 8)
    assert out[0] > out[1]


def test_choice_with_weights_and_contexts_minimises_the_ratio_by_brute_force() -> None:
    """Per-row weights and draft costs: the greedy by benefit per second still equals an
    exhaustive search (γ_max = 3, up to 4 rows)."""
    rng = random.Random(6)
    model = StepTimeModel(0.02, 1e-4, 1e-3, 1e-5, 2e-6)
    for _ in range(40):
        rows = [SpecRow(round(rng.random(), 2), weight=rng.choice([1.0, 1.5, 2.0]),
                        context_tokens=rng.choice([0, 500, 3000])) for _ in range(rng.randint(1, 4))]
        context = sum(r.context_tokens for r in rows)

        def ratio(gs: tuple[int, ...]) -> float:
            w = sum(r.weight * expected_tokens(r.alpha, g) for r, g in zip(rows, gs))
            attended = sum(g * r.context_tokens for r, g in zip(rows, gs))
            return model.predict(len(rows), len(rows) + sum(gs), context, attended) / w

        grid = [()]
        for _ in rows:
            grid = [g + (k,) for g in grid for k in range(4)]
        best = min(ratio(g) for g in grid)
        assert ratio(tuple(choose_draft_lengths(rows, model, 3, lam=2.0))) == pytest.approx(best, rel=1e-9)


def test_tail_weights_follow_the_predicted_remaining_length() -> None:
    """The longest predicted remainder weighs λ, one about to end about 1, linearly."""
    assert tail_weights([0, 50, 100], 2.0) == [1.0, 1.5, 2.0]
    assert tail_weights([0, 0], 3.0) == [1.0, 1.0]
    assert tail_weights([10], 1.0) == [1.0]
    with pytest.raises(ValueError):
        tail_weights([1], 0.5)


def test_tail_rows_get_drafts_first_when_drafts_are_scarce() -> None:
    """With room for a few drafts only, the row predicted to be in the tail gets them."""
    model = StepTimeModel(0.01, 1e-4, 2e-3)
    weights = tail_weights([10, 1000], 2.0)
    rows = [SpecRow(0.5, weight=w) for w in weights]
    out = choose_draft_lengths(rows, model, 8)
    assert out[1] > out[0]


def test_thompson_draws_spread_without_evidence_and_concentrate_with_it() -> None:
    """Draws of an unseen key spread over [0, 1]; after much evidence they sit at the mean."""
    tracker = AcceptanceTracker(prior_alpha=0.5, prior_strength=4.0)
    rng = random.Random(1)
    fresh = [tracker.sample_alpha("new", rng) for _ in range(400)]
    assert min(fresh) < 0.15 and max(fresh) > 0.85
    for _ in range(500):
        tracker.record("seen", 4, 1)  # α = 1 / (1 + 1) = 0.5 by maximum likelihood ... times 500
    for _ in range(500):
        tracker.record("seen", 4, 0)
    draws = [tracker.sample_alpha("seen", rng) for _ in range(400)]
    assert max(draws) - min(draws) < 0.15
    assert tracker.sample_alpha("x", rng, prior_mean=1.0) == 1.0
