"""The speculative-decoding cost model: how many drafts each sequence of a batch gets.

Owns the pure decision logic of Seer's adaptive speculative decoding (spec, "Mechanism
3"): the expected tokens of a draft of length γ, the per-token time T_SD, an online
model of the engine's step time T(B, tokens), an online per-group acceptance estimate,
and the per-step choice of draft lengths. No torch, no vLLM, no clock: engines (the vLLM
proposer) and the simulator call it alike, every step, so everything here is O(batch).

Definitions (β[j] = probability that the first j drafts are all accepted = α^j, the
reading of the paper's ambiguous β the spec asks for):

* expected tokens of one sequence drafting γ tokens (accepted drafts + the bonus or
  recovered token): E(α, γ) = Σ_{j=0..γ} β[j] = (1 − α^(γ+1)) / (1 − α), γ + 1 at α = 1.
* per-token time: T_SD = (D(B, γ) + T(B, γ)) / E(α, γ) = (1−α)(D + T) / (1 − α^(γ+1)),
  the spec's formula; T(B, γ) is the target step verifying B·(γ+1) tokens
  (``StepTimeModel.predict(B, B·(γ+1))``), D the drafting time (``DraftTimeModel``).

``choose_draft_lengths`` — the exact rule. Rows i = 1..B, acceptance α_i, weight
w_i = λ for probes (and whatever else the caller marks high-priority, e.g. the tail),
1 otherwise. Adding the (γ_i+1)-th draft to row i adds β_i[γ_i+1] = α_i^(γ_i+1) expected
tokens; its weighted marginal benefit is w_i·α_i^(γ_i+1). For a batch-wide budget of K
drafts, the allocation is greedy by that benefit (largest first; ties: probes, then the
earlier row), each row capped at γ_max. Because each row's benefits fall with γ_i, the
greedy maximises the weighted expected tokens W(K) = Σ_i w_i·E(α_i, γ_i) for every K,
and the sequence of taken benefits never rises, so W is concave in K. The budget is

    K* = argmin_K  (T(B, B + K) + D(B, K)) / W(K),     K = 0 .. B·γ_max,

the weighted T_SD of the whole step; with no probes (all w_i = 1) this is exactly the
batch's expected seconds per generated token. K is also capped by ``max_drafts`` (a
per-step token budget, if the engine has one). Over K ≥ 1, T + D is convex in K (linear
as the ``StepTimeModel`` fits it; D's fixed part is paid once, at K = 1) and W concave,
so the ratio is quasi-convex there: the search stops at the first K that does not
improve on K − 1, and the best K ≥ 1 is then compared with K = 0 (no speculation). At
large B, where T grows steeply with tokens, the first draft must buy more than T'·W/T
expected tokens (T' the cost of one more token); once that exceeds every row's w·α,
speculation switches off. Probes at equal α
never get fewer drafts than non-probes (their benefit is λ× larger at every depth).
The decision costs O(K* log B) per step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

# Keeps the predicted step time positive when an online fit is still poor.
_MIN_STEP_S = 1e-6


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per step of one sequence drafting ``gamma`` tokens with per-token
    acceptance ``alpha`` (accepted drafts + the bonus/recovered token)."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class DraftTimeModel:
    """D(B, K): seconds a step spends drafting K tokens for B sequences:
    ``fixed_s + per_seq_s·B + per_draft_s·K``, and 0 when nothing is drafted. Seer drafts
    by CPU suffix lookup (no draft model), so it is small; zero when it runs off the
    critical path. ``seer_store_cpu`` is the measured cost of our pure-Python store."""

    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    per_draft_s: float = 0.0

    def seconds(self, num_seqs: int, num_drafts: int) -> float:
        if num_drafts <= 0:
            return 0.0
        return self.fixed_s + self.per_seq_s * num_seqs + self.per_draft_s * num_drafts

    @classmethod
    def seer_store_cpu(cls) -> DraftTimeModel:
        """``DraftStore`` drafting γ = 8 linearly: 93.6 µs per call on this machine
        (docs/speculative-decoding.md, "Cost of drafting"), counted as if on the
        critical path."""
        return cls(per_seq_s=93.6e-6)


class StepTimeModel:
    """T(num_seqs, num_tokens): seconds of one target-model step, learned online.

    Linear in the features (1, num_seqs, num_tokens) — fixed cost, per-sequence cost,
    per-scheduled-token cost — fitted by recursive least squares with exponential
    forgetting (contexts grow during a rollout, so old steps count less). The fit starts
    from prior coefficients (a profile) whose weight is ``prior_weight`` pseudo-steps per
    coefficient, so it predicts sensibly before any data and a few noisy steps do not
    swing it. O(1) per call (3×3 algebra), meant to be called every engine step.
    """

    def __init__(self, fixed_s: float, per_seq_s: float, per_token_s: float, *,
                 prior_weight: float = 10.0, forgetting: float = 0.999) -> None:
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self._theta = [float(fixed_s), float(per_seq_s), float(per_token_s)]
        # Residuals are measured in units of ``noise_s`` (the prior's one-sequence step),
        # so a step's information is comparable to the prior's. The prior's spread per
        # coefficient is its own size (floored, so a zero prior coefficient can still be
        # learnt), divided among ``prior_weight`` pseudo-steps.
        self._noise_s = max(abs(fixed_s) + abs(per_seq_s) + abs(per_token_s), 1e-6)
        floor = 1e-3 * self._noise_s
        self._p_max = [max(abs(c), floor) ** 2 / prior_weight for c in self._theta]
        self._p = [[self._p_max[i] if i == j else 0.0 for j in range(3)] for i in range(3)]
        self._forgetting = forgetting
        self.num_observed = 0

    @classmethod
    def from_profile(cls, points: Iterable[tuple[int, int, float]], **kwargs: float) -> StepTimeModel:
        """Ordinary least squares over an offline profile of (num_seqs, num_tokens,
        seconds) points, used as the prior. Needs points that vary in both num_seqs and
        num_tokens (e.g. B ∈ {1, 8, 64} × γ ∈ {0, 4, 8})."""
        rows = [(1.0, float(b), float(n), float(s)) for b, n, s in points]
        if len(rows) < 3:
            raise ValueError(f"a profile needs at least 3 points, got {len(rows)}")
        xtx = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
        xty = [sum(r[i] * r[3] for r in rows) for i in range(3)]
        theta = _solve3(xtx, xty)
        if theta is None:
            raise ValueError("the profile does not determine the step time: "
                             "vary both num_seqs and num_tokens")
        return cls(*theta, **kwargs)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(fixed_s, per_seq_s, per_token_s) of the current fit."""
        return (self._theta[0], self._theta[1], self._theta[2])

    def predict(self, num_seqs: int, num_tokens: int) -> float:
        a, b, c = self._theta
        # A per-token cost fitted negative (too little spread in the data) would make
        # drafts look free; clamp it so more tokens never predict a faster step.
        return max(_MIN_STEP_S, a + b * num_seqs + max(c, 0.0) * num_tokens)

    def observe(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        """Add one measured step (RLS update with forgetting)."""
        if seconds <= 0 or num_seqs <= 0 or num_tokens < num_seqs:
            return  # an empty or mis-measured step carries no information about T
        x = (1.0, float(num_seqs), float(num_tokens))
        lam = self._forgetting
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = lam * self._noise_s ** 2 + sum(x[i] * px[i] for i in range(3))
        gain = [v / denom for v in px]
        err = seconds - sum(self._theta[i] * x[i] for i in range(3))
        self._theta = [self._theta[i] + gain[i] * err for i in range(3)]
        p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(3)] for i in range(3)]
        # Anti-windup: forgetting inflates P in directions the steps do not excite (a
        # steady batch never varies num_seqs); cap each variance at the prior's by a
        # diagonal rescaling, which keeps P symmetric positive definite.
        shrink = [min(1.0, (self._p_max[i] / p[i][i]) ** 0.5) if p[i][i] > 0 else 1.0 for i in range(3)]
        self._p = [[p[i][j] * shrink[i] * shrink[j] for j in range(3)] for i in range(3)]
        self.num_observed += 1


def _solve3(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Solve the 3×3 system a·x = y by Cramer's rule; None if singular."""
    def det(m: list[list[float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
                - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
    d = det(a)
    scale = max(abs(v) for row in a for v in row) ** 3
    if abs(d) <= 1e-12 * scale:
        return None
    out = []
    for k in range(3):
        m = [[y[i] if j == k else a[i][j] for j in range(3)] for i in range(3)]
        out.append(det(m) / d)
    return out


class AcceptanceTracker:
    """Per-group estimate of the per-token acceptance α from proposed/accepted counts.

    The verifier accepts drafts left to right and stops at the first rejection, so a
    proposal of γ drafts with k accepted is a truncated geometric observation:
    P(k) = α^k (1 − α) for k < γ, P(γ) = α^γ. The likelihood of many proposals is
    α^(Σk) (1 − α)^R with R = the number of proposals that ended in a rejection
    (k < γ), so the maximum-likelihood α is Σk / (Σk + R) — not Σk / Σγ, which counts
    the drafts after the first rejection as rejected although they were never tested,
    and underestimates α. The Beta distribution is conjugate to this likelihood: with a
    Beta prior of mean m and strength s pseudo-tokens the posterior mean is
    (s·m + Σk) / (s + Σk + R). The prior mean of a group is the pooled estimate over all
    groups seen so far (itself starting at ``prior_alpha``), so an unseen group gets
    the population's α.
    """

    def __init__(self, prior_alpha: float = 0.5, prior_strength: float = 4.0) -> None:
        if not 0.0 <= prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {prior_alpha}")
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        self.prior_alpha = prior_alpha
        self.prior_strength = prior_strength
        self._groups: dict[str, list[int]] = {}  # group -> [Σ accepted, rejections]
        self._accepted = 0  # pooled over every group ever recorded (forgetting keeps them)
        self._rejections = 0

    def record(self, group_id: str, proposed: int, accepted: int) -> None:
        """One verified proposal: ``proposed`` drafts, of which the first ``accepted``
        were accepted."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted must be in [0, proposed={proposed}], got {accepted}")
        if proposed == 0:
            return
        rejected = 1 if accepted < proposed else 0
        counts = self._groups.setdefault(group_id, [0, 0])
        counts[0] += accepted
        counts[1] += rejected
        self._accepted += accepted
        self._rejections += rejected

    def population_alpha(self) -> float:
        """The pooled estimate over every group recorded: the prior of unseen groups."""
        s = self.prior_strength
        return (s * self.prior_alpha + self._accepted) / (s + self._accepted + self._rejections)

    def alpha(self, group_id: str) -> float:
        m = self.population_alpha()
        counts = self._groups.get(group_id)
        if counts is None:
            return m
        s = self.prior_strength
        return (s * m + counts[0]) / (s + counts[0] + counts[1])

    def forget(self, group_id: str) -> None:
        """Drop a finished group's counts (they stay in the population prior)."""
        self._groups.pop(group_id, None)

    def __len__(self) -> int:
        return len(self._groups)


class SpecRow(msgspec.Struct, frozen=True):
    """One running sequence as the draft-length choice sees it."""

    alpha: float  # its group's per-token acceptance estimate
    probe: bool = False  # high priority: a probe (or the long tail) — weighted by λ


def choose_draft_lengths(rows: Sequence[SpecRow], step_time: StepTimeModel, gamma_max: int,
                         lam: float = 2.0, draft_time: DraftTimeModel | None = None,
                         max_drafts: int | None = None) -> list[int]:
    """Draft length per row for this step (see the module docstring for the rule)."""
    if gamma_max < 0:
        raise ValueError(f"gamma_max must be >= 0, got {gamma_max}")
    if lam < 1.0:
        raise ValueError(f"lam must be >= 1 (probes are never worth less), got {lam}")
    num_seqs = len(rows)
    gammas = [0] * num_seqs
    if num_seqs == 0 or gamma_max == 0:
        return gammas
    draft_time = draft_time or DraftTimeModel()
    weights = [lam if row.probe else 1.0 for row in rows]
    alphas = [min(1.0, max(0.0, row.alpha)) for row in rows]
    # Max-heap of the next draft's weighted benefit per row: (−benefit, not probe, row).
    heap = [(-weights[i] * alphas[i], not rows[i].probe, i) for i in range(num_seqs) if alphas[i] > 0.0]
    heapq.heapify(heap)
    weighted_tokens = sum(weights)  # W(0): every row yields its one token
    no_sd_ratio = step_time.predict(num_seqs, num_seqs) / weighted_tokens
    # Over K >= 1 the step time is convex in K (D's fixed part is paid once, at K = 1)
    # and W concave, so the ratio is quasi-convex there: stop at the first K that does
    # not improve on K − 1. K = 0 is compared at the end.
    order: list[int] = []  # the row that got the K-th draft
    best_ratio, best_k = float("inf"), 0
    while heap and (max_drafts is None or len(order) < max_drafts):
        neg_benefit, not_probe, i = heapq.heappop(heap)
        gammas[i] += 1
        order.append(i)
        weighted_tokens -= neg_benefit
        if gammas[i] < gamma_max:
            heapq.heappush(heap, (neg_benefit * alphas[i], not_probe, i))
        num_drafts = len(order)
        seconds = (step_time.predict(num_seqs, num_seqs + num_drafts)
                   + draft_time.seconds(num_seqs, num_drafts))
        ratio = seconds / weighted_tokens
        if ratio >= best_ratio:
            break
        best_ratio, best_k = ratio, num_drafts
    if best_ratio >= no_sd_ratio:
        return [0] * num_seqs
    chosen = [0] * num_seqs
    for i in order[:best_k]:
        chosen[i] += 1
    return chosen


def t_sd(alpha: float, gamma: int, num_seqs: int, step_time: StepTimeModel,
         draft_time: DraftTimeModel | None = None) -> float:
    """Seconds per generated token of a batch of ``num_seqs`` sequences that all draft
    ``gamma`` tokens at acceptance ``alpha``: (1−α)(D(B,γ) + T(B,γ)) / (1 − α^(γ+1)),
    per sequence of the batch (the step's time is shared by its B sequences)."""
    draft_time = draft_time or DraftTimeModel()
    seconds = (step_time.predict(num_seqs, num_seqs * (gamma + 1))
               + draft_time.seconds(num_seqs, num_seqs * gamma))
    return seconds / (num_seqs * expected_tokens(alpha, gamma))
