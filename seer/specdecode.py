"""The speculative-decoding cost model: how many drafts each sequence of a batch gets.

Owns the pure decision logic of Seer's adaptive speculative decoding (spec, "Mechanism
3"): the expected tokens of a draft of length γ, the per-token time T_SD, an online
model of the engine's step time, an online per-group acceptance estimate, the length
model's draft weights, and the per-step choice of draft lengths. No torch, no vLLM, no
clock: engines (the vLLM proposer) and the simulator call it alike, every step, so
everything here is O(batch).

Definitions (β[j] = probability that the first j drafts are all accepted = α^j, the
reading of the paper's ambiguous β the spec asks for):

* expected tokens of one sequence drafting γ tokens (accepted drafts + the bonus or
  recovered token): E(α, γ) = Σ_{j=0..γ} β[j] = (1 − α^(γ+1)) / (1 − α), γ + 1 at α = 1.
* per-token time: T_SD = (D(B, γ) + T(B, γ)) / E(α, γ) = (1−α)(D + T) / (1 − α^(γ+1)),
  the spec's formula; T is the target step (``StepTimeModel``), D the drafting time
  (``DraftTimeModel``).

The step time is ``T = a + b·B + p·N + c·S + d·X`` (``StepTimeModel``): B sequences, N
scheduled tokens, S the sequences' context, X the context attended by tokens beyond each
sequence's first. One more draft for row i costs ``p + d·L_i`` (L_i its context): drafts
for long contexts cost more where attention is a large part of a step (a CPU).

``choose_draft_lengths`` — the exact rule. Rows i = 1..B, acceptance α_i, weight w_i
(λ for probes, the length model's weight for samples predicted to be in the tail, 1
otherwise), cost per draft c_i = p + d·L_i (+ the drafting time per draft). Adding the
(γ_i+1)-th draft to row i adds β_i[γ_i+1] = α_i^(γ_i+1) expected tokens: weighted
benefit w_i·α_i^(γ_i+1) for c_i seconds. Drafts are taken greedily by benefit per second
(largest first; ties: probes, then the earlier row), each row capped at γ_max. The step's
weighted seconds per token is (T(K) + D(K)) / W(K); for a fixed ratio ρ, the drafts worth
taking are exactly those with benefit/cost > 1/ρ, and within a row benefit/cost falls
with depth, so the best set of K drafts is a prefix of this order (Dinkelbach's
argument) and the ratio over K ≥ 1 is quasi-convex (D's fixed part is paid once, at
K = 1): the search stops at the first K that does not improve on K − 1, and the best
K ≥ 1 is compared with K = 0 (no speculation). So a step drafts exactly where the
predicted (weighted) tokens per second rise, and nothing where they would fall; there is
no batch-size threshold. With no probes and no weights this is the batch's expected
seconds per generated token. K is also capped by ``max_drafts``. The decision costs
O(K* log B) per step.
"""

from __future__ import annotations

import heapq
import math
import random
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
    critical path. ``seer_store_cpu`` is the measured cost of our store."""

    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    per_draft_s: float = 0.0

    def seconds(self, num_seqs: int, num_drafts: int) -> float:
        if num_drafts <= 0:
            return 0.0
        return self.fixed_s + self.per_seq_s * num_seqs + self.per_draft_s * num_drafts

    @classmethod
    def seer_store_cpu(cls) -> DraftTimeModel:
        """``DraftStore`` with its compiled index drafting γ = 8 linearly: ~11 µs per call
        on this machine (docs/speculative-decoding.md, "Cost of drafting"), counted as if
        on the critical path."""
        return cls(per_seq_s=11e-6)


# Feature order and typical sizes (a step of 16 sequences of 1k context verifying 16
# drafts): a coefficient's prior spread is at least what would explain the prior's whole
# step at these sizes, so a wrong or zero prior is unlearnt within tens of steps (the
# spread also caps how far forgetting lets uncertainty grow). Context features enter the
# fit in thousands of tokens.
_FEATURES = 5
_TYPICAL = (1.0, 16.0, 32.0, 16.0, 16.0)
_KILO = 1000.0


class StepTimeModel:
    """T: seconds of one engine step, learned online,

        T = fixed + per_seq·B + per_token·N + per_context·S + per_attended·X

    B sequences; N scheduled tokens (one per decoding sequence, plus its drafts, plus
    prefilled tokens); S = Σ context of the sequences (each step reads every sequence's
    KV once); X = Σ over tokens beyond a sequence's first of the context each attends to
    (a draft token of a sequence with context L adds L; a prefill of q tokens on c cached
    ones adds about q·c + q²/2). Without SD and prefill this is the control plane's
    ``a + b·B + c·S`` per decode step, and N − B is its prefilled P: the two fits share
    a, b, c and p, and speculative decoding adds X. A draft for a row of context L costs
    ``marginal(L) = per_token + per_attended·L``.

    Fitted by recursive least squares with exponential forgetting (contexts grow during a
    rollout, so old steps count less), on *relative* errors (each step weighted by
    1/predicted², so a 3 s tail step and a 0.1 s one count alike). The fit starts from
    prior coefficients (a profile) worth ``prior_weight`` pseudo-steps per coefficient, so
    it predicts sensibly before any data and a few steps do not swing it.

    Robust to what real step records contain (``observe`` is called with measured wall
    time between two engine steps): a non-finite, non-positive or longer-than-
    ``max_step_s`` step, or an impossible shape, is refused; an outlier (a pause, a
    weight load, another process on the core) moves the fit at most as much as a step
    ``outlier_k`` typical relative errors off (Huber clipping against a running scale);
    coefficients stay in [0, cap] and predictions in [1 µs, ``max_step_s``]. O(1) per
    call (5×5 algebra), meant to be called every engine step.
    """

    def __init__(self, fixed_s: float, per_seq_s: float, per_token_s: float, per_context_s: float = 0.0,
                 per_attended_s: float = 0.0, *, prior_weight: float = 10.0, forgetting: float = 0.999,
                 max_step_s: float = 60.0, outlier_k: float = 3.0) -> None:
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if not max_step_s > 0 or outlier_k <= 0:
            raise ValueError("max_step_s and outlier_k must be > 0")
        prior = (fixed_s, per_seq_s, per_token_s, per_context_s * _KILO, per_attended_s * _KILO)
        if not all(math.isfinite(c) and c >= 0 for c in prior):
            raise ValueError(f"step-time coefficients must be finite and >= 0, got {prior}")
        self._theta = [float(c) for c in prior]
        self.max_step_s = max_step_s
        self.outlier_k = outlier_k
        # A coefficient's prior spread: its own size, at least a whole typical step's worth.
        typical_s = max(sum(c * x for c, x in zip(self._theta, _TYPICAL)), 1e-6)
        self._p_max = [max(c, typical_s / x) ** 2 / prior_weight for c, x in zip(self._theta, _TYPICAL)]
        self._cap = [max_step_s / x for x in _TYPICAL]
        self._p = [[self._p_max[i] if i == j else 0.0 for j in range(_FEATURES)] for i in range(_FEATURES)]
        self._forgetting = forgetting
        self._scale = 0.1  # running mean of |relative error|, clipped (Huber's scale)
        self.num_observed = 0
        self.num_refused = 0

    @classmethod
    def from_profile(cls, points: Iterable[tuple[int, int, float]], **kwargs: float) -> StepTimeModel:
        """Ordinary least squares over an offline profile of (num_seqs, num_tokens,
        seconds) points, used as the prior (context terms 0). Needs points that vary in
        both num_seqs and num_tokens (e.g. B ∈ {1, 8, 64} × γ ∈ {0, 4, 8})."""
        rows = [(1.0, float(b), float(n), float(s)) for b, n, s in points]
        if len(rows) < 3:
            raise ValueError(f"a profile needs at least 3 points, got {len(rows)}")
        xtx = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
        xty = [sum(r[i] * r[3] for r in rows) for i in range(3)]
        theta = _solve3(xtx, xty)
        if theta is None:
            raise ValueError("the profile does not determine the step time: "
                             "vary both num_seqs and num_tokens")
        return cls(*(max(0.0, c) for c in theta), **kwargs)

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        """(fixed_s, per_seq_s, per_token_s, per_context_s, per_attended_s) of the fit."""
        a, b, p, c, d = self._theta
        return (a, b, p, c / _KILO, d / _KILO)

    @staticmethod
    def _x(num_seqs: float, num_tokens: float, context: float, attended: float) -> tuple[float, ...]:
        return (1.0, float(num_seqs), float(num_tokens), float(context) / _KILO, float(attended) / _KILO)

    def predict(self, num_seqs: int, num_tokens: int, context_tokens: float = 0.0,
                attended_tokens: float = 0.0) -> float:
        x = self._x(num_seqs, num_tokens, context_tokens, attended_tokens)
        return min(self.max_step_s, max(_MIN_STEP_S, sum(t * v for t, v in zip(self._theta, x))))

    def marginal(self, context_tokens: float = 0.0) -> float:
        """Seconds one more draft adds to a step for a row of this context."""
        return self._theta[2] + self._theta[4] * context_tokens / _KILO

    def observe(self, num_seqs: int, num_tokens: int, seconds: float, context_tokens: float = 0.0,
                attended_tokens: float = 0.0) -> bool:
        """Add one measured step (robust RLS update); False if it was refused."""
        values = (num_seqs, num_tokens, seconds, context_tokens, attended_tokens)
        if (not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
                or not 0.0 < seconds <= self.max_step_s or num_seqs <= 0 or num_tokens < num_seqs
                or context_tokens < 0 or attended_tokens < 0):
            self.num_refused += 1
            return False
        raw = self._x(num_seqs, num_tokens, context_tokens, attended_tokens)
        pred = self.predict(num_seqs, num_tokens, context_tokens, attended_tokens)
        x = [v / pred for v in raw]
        err = (seconds - sum(t * v for t, v in zip(self._theta, raw))) / pred
        # The scale follows the clipped errors, so it stays put while fewer than 1 step in
        # outlier_k is an outlier (a scale fed unclipped errors would grow with them).
        bound = self.outlier_k * self._scale
        err = max(-bound, min(bound, err))
        self._scale = max(0.01, 0.98 * self._scale + 0.02 * abs(err))
        lam = self._forgetting
        n = _FEATURES
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam * self._scale ** 2 + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        self._theta = [min(self._cap[i], max(0.0, self._theta[i] + gain[i] * err)) for i in range(n)]
        p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        # Anti-windup: forgetting inflates P in directions the steps do not excite (a
        # steady batch never varies num_seqs); cap each variance at the prior's by a
        # diagonal rescaling, which keeps P symmetric positive definite.
        shrink = [min(1.0, (self._p_max[i] / p[i][i]) ** 0.5) if p[i][i] > 0 else 1.0 for i in range(n)]
        self._p = [[p[i][j] * shrink[i] * shrink[j] for j in range(n)] for i in range(n)]
        self.num_observed += 1
        return True


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

    def alpha(self, group_id: str, prior_mean: float | None = None) -> float:
        """The posterior mean; its prior mean is the population's unless ``prior_mean``
        is given (a request's prior can be its group's estimate)."""
        m = self.population_alpha() if prior_mean is None else prior_mean
        counts = self._groups.get(group_id)
        if counts is None:
            return m
        s = self.prior_strength
        return (s * m + counts[0]) / (s + counts[0] + counts[1])

    def sample_alpha(self, group_id: str, rng: random.Random, prior_mean: float | None = None) -> float:
        """A draw from the posterior Beta(s·m + Σk, s·(1 − m) + R) (Thompson sampling):
        a key with little evidence is sometimes tried optimistically, one with much
        evidence gets about its mean. This is how drafting keeps learning where the mean
        says it does not pay, without a fixed exploration schedule."""
        m = self.population_alpha() if prior_mean is None else min(1.0, max(0.0, prior_mean))
        s = self.prior_strength
        counts = self._groups.get(group_id, (0, 0))
        a, b = s * m + counts[0], s * (1.0 - m) + counts[1]
        return rng.betavariate(a, b) if a > 0 and b > 0 else (1.0 if b <= 0 else 0.0)

    def evidence(self, group_id: str) -> int:
        """Accepted drafts plus rejections recorded for the group (0: unseen)."""
        counts = self._groups.get(group_id)
        return 0 if counts is None else counts[0] + counts[1]

    def forget(self, group_id: str) -> None:
        """Drop a finished group's counts (they stay in the population prior)."""
        self._groups.pop(group_id, None)

    def __len__(self) -> int:
        return len(self._groups)


class SpecRow(msgspec.Struct, frozen=True):
    """One running sequence as the draft-length choice sees it."""

    alpha: float  # its group's per-token acceptance estimate
    probe: bool = False  # high priority: its group's probe — weighted by λ
    weight: float = 1.0  # the length model's weight (``tail_weights``); a probe gets max(λ, weight)
    context_tokens: int = 0  # its context: what one of its drafts attends to


def tail_weights(remaining_tokens: Sequence[float], lam: float) -> list[float]:
    """The length model's draft weights: a sample predicted to run longest (the tail)
    weighs λ, one about to end weighs 1, linearly in between:
    w_i = 1 + (λ − 1) · remaining_i / max(remaining). The tokens of the samples that set
    the rollout's end are worth more than those of samples that end anyway; how much more
    is the paper's λ, no new constant."""
    if lam < 1.0:
        raise ValueError(f"lam must be >= 1, got {lam}")
    longest = max((r for r in remaining_tokens if r > 0), default=0.0)
    if longest <= 0:
        return [1.0] * len(remaining_tokens)
    return [1.0 + (lam - 1.0) * max(0.0, r) / longest for r in remaining_tokens]


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
    weights = [max(lam if row.probe else 1.0, row.weight) for row in rows]
    alphas = [min(1.0, max(0.0, row.alpha)) for row in rows]
    contexts = [max(0, row.context_tokens) for row in rows]
    costs = [max(1e-12, step_time.marginal(c) + draft_time.per_draft_s) for c in contexts]
    # Max-heap of the next draft's weighted benefit per second: (−benefit/cost, not probe, row).
    heap = [(-weights[i] * alphas[i] / costs[i], not rows[i].probe, i) for i in range(num_seqs) if alphas[i] > 0.0]
    heapq.heapify(heap)
    context = float(sum(contexts))
    attended = 0.0  # context attended by the drafts taken so far
    weighted_tokens = sum(weights)  # W(0): every row yields its one token
    no_sd_ratio = step_time.predict(num_seqs, num_seqs, context) / weighted_tokens
    order: list[int] = []  # the row that got the K-th draft
    best_ratio, best_k = float("inf"), 0
    while heap and (max_drafts is None or len(order) < max_drafts):
        neg_rate, not_probe, i = heapq.heappop(heap)
        gammas[i] += 1
        order.append(i)
        weighted_tokens += weights[i] * alphas[i] ** gammas[i]
        attended += contexts[i]
        if gammas[i] < gamma_max:
            heapq.heappush(heap, (neg_rate * alphas[i], not_probe, i))
        num_drafts = len(order)
        seconds = (step_time.predict(num_seqs, num_seqs + num_drafts, context, attended)
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
