"""What one engine iteration costs: the step-cost model and its online fit.

Owns ``CostModel`` — seconds per engine step ``a + b·B + c·S + p·P`` for a batch of B
running sequences holding S tokens of KV that prefilled P tokens, plus the price of
loading KV from the host pool instead of recomputing it — with the two built-in models
(this CPU, measured; a GPU instance, assumed), and ``StepCostFit``, the online fit of that
model to the step records the engines report. The simulator's engines run on a
``CostModel``; the scheduler's policies take their decisions from the fitted one (KV
overcommit, placement, chunk edges: controlplane/policies). Pure arithmetic: no numpy, no
clock, no I/O.

The fit is bounded and robust, because one engine's bad data must not swing every
decision: a record outside physical bounds (a step of more than ``MAX_STEP_S``, a negative
count, a NaN) is refused and counted; the rest are fitted by least squares that pulls each
coefficient towards the prior with the weight of ``PRIOR_WEIGHT`` records (a feature that
never varies — no prefill in a pure decode phase — keeps its prior), re-weighted with Huber
weights, which a step many times its neighbours' (an engine that stalled) loses entirely, over the last ``WINDOW`` records only (an engine that restarts or slows down is
followed); finally each coefficient is clamped to within ``MAX_RATIO`` of the prior's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

MAX_STEP_S = 60.0  # a longer "step" is an engine that stalled or sat idle: refused
MAX_BATCH = 1 << 16
MAX_TOKENS = 1 << 34
WINDOW = 512  # records fitted (the most recent)
REFIT_EVERY = 64  # new records between refits
PRIOR_WEIGHT = 4.0  # the prior counts as this many records' worth of information
MAX_RATIO = 20.0  # a fitted coefficient stays within [prior / MAX_RATIO, prior * MAX_RATIO]
HUBER_K = 1.345  # Huber's constant, in robust standard deviations of the residuals
REJECT_K = 5.0  # residuals beyond this many robust standard deviations get no weight
IRLS_ROUNDS = 4


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine iteration: ``a + b*B + c*sum(context of running)`` per decode
    step for a batch of B sequences, plus ``p`` per prefilled token and
    ``pool_s_per_token`` per token of KV loaded from the global KV pool."""

    a: float  # fixed cost of a decode step (weights read, launch, sampling)
    b: float  # per running sequence per step (its share of the GEMMs)
    c: float  # per context token of the running sequences per step (attention)
    p: float  # per prefilled (recomputed) token
    pool_s_per_token: float  # per token of KV pulled from the pool instead of recomputed

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.a + self.b * batch + self.c * context_tokens

    def step_s(self, batch: float, context_tokens: float, prefill_tokens: float = 0.0) -> float:
        """One step of ``batch`` sequences holding ``context_tokens`` of KV that prefilled
        ``prefill_tokens``."""
        return self.a + self.b * batch + self.c * context_tokens + self.p * prefill_tokens

    def token_s(self, batch: float, context_tokens: float) -> float:
        """Engine seconds per generated token at this batch: a step shared by its sequences."""
        batch = max(1.0, batch)
        return self.decode_step_s(batch, context_tokens) / batch  # type: ignore[arg-type]

    def verify_step_s(self, batch: int, num_drafts: int, context_tokens: float) -> float:
        """A step that verifies ``num_drafts`` drafted tokens on top of the batch's one
        token each: drafts cost what any scheduled token costs (``b``), and reading the
        KV is shared by a sequence's queries (``c`` stays per context token). An
        assumption: the linear model ignores the memory-bound plateau real GPUs have at
        small token counts, so it charges drafts more than a GPU would."""
        return self.a + self.b * (batch + num_drafts) + self.c * context_tokens

    @classmethod
    def cpu_smollm2(cls) -> CostModel:
        """Calibrated to this machine: one float32 vLLM engine, SmolLM2-135M, one core.

        Measured facts used:
          (1) 64 sequences x 128 tokens, 64-token prompts: 102 s wall (80 tok/s);
          (2) a single sequence decodes at ~10 tok/s (step ~0.1 s at context ~128);
          (3) re-prefilling 3,000 tokens cold took 4.65 s.
        Derivation:
          p = 4.65 s / 3000 = 1.55e-3 s per prefilled token.
          (1) is one prefill of 64 x 64 = 4096 tokens (6.35 s) plus 128 decode steps at
          B = 64 with contexts growing 64 -> 192, i.e. sum over steps of the batch's
          context = 1,044,480 token-steps:  128*(a + 64*b) + 1,044,480*c = 95.85 s.
          (2):  a + b + 128*c = 0.1 s.
          Two equations, three unknowns: the split between b and c is not measured, so
          c/b is set to SmolLM2's FLOP ratio: attention per context token per layer
          (2 * 2 * 9 heads * 64 = 2,304 FLOPs, x 30 layers = 69k) over the dense FLOPs
          per token (2 * 134.5M = 269M): c/b = 2.57e-4.
          Solving: b = 9.97e-3, c = 2.56e-6, a = 0.0897; rounded to a = 0.09, b = 0.01,
          c = 2.6e-6. Check: this model runs (1) in 102.5 s and (2) at 9.97 tok/s.
          (The "~1.0 s per step at B = 64" rule of thumb is the whole run's 102 s / 128
          steps = 0.8 s including prefill; the pure decode step here is ~0.75 s.)
        pool_s_per_token: SmolLM2's float32 KV is 30 layers x 2 x 3 heads x 64 x 4 B =
          46 KB per token; at the measured ~6 GB/s memory copy into shared memory that
          is ~7.7 us, rounded to 8e-6 s (an estimate; no pool exists yet to measure).
        """
        return cls(a=0.09, b=0.01, c=2.6e-6, p=1.55e-3, pool_s_per_token=8e-6)

    @classmethod
    def gpu_h800_like(cls) -> CostModel:
        """A large model on a GPU instance — ASSUMED numbers, not measurements.

        Chosen to give paper-like behaviour for a ~70B dense GQA model on one 8-GPU
        H800-class instance: a decode step of ~25 ms at small batch (a), +0.05 ms per
        running sequence (b: +12.8 ms at B = 256), +10 ns per context token of the batch
        (c: ~327 KB of bf16 KV per token read at ~30 TB/s of HBM), prefill at ~20k
        tokens/s (p), KV pulled from a pool over RDMA at ~2 us per token. Such an
        instance holds ~1M tokens of KV. Nothing here was measured; profile the real
        deployment before quoting absolute times.
        """
        return cls(a=0.025, b=5e-5, c=1e-8, p=5e-5, pool_s_per_token=2e-6)


PRIORS = {"cpu": CostModel.cpu_smollm2, "gpu": CostModel.gpu_h800_like}


def _valid(step_s: float, batch: float, kv_tokens: float, prefill_tokens: float) -> bool:
    return (0.0 < step_s <= MAX_STEP_S and 1 <= batch <= MAX_BATCH and 0 <= kv_tokens <= MAX_TOKENS
            and 0 <= prefill_tokens <= MAX_TOKENS)  # NaN fails every comparison


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(rhs)
    m = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out


class StepCostFit:
    """The fleet's step cost, fitted online from step records ``(seconds, batch, KV tokens,
    prefilled tokens)``, starting from (and pulled towards) ``prior``. ``model`` is the
    current fit; it changes only every ``REFIT_EVERY`` accepted records."""

    def __init__(self, prior: CostModel) -> None:
        self.prior = prior
        self._records: deque[tuple[float, float, float, float, float]] = deque(maxlen=WINDOW)
        self._model = prior
        self._pending = 0
        self.num_records = 0  # accepted, ever
        self.num_refused = 0  # outside the physical bounds, ever
        self.num_fits = 0

    def add(self, records: Iterable[tuple[float, float, float, float]], weight: float = 1.0) -> int:
        """Take step records; returns how many were accepted. ``weight``: how many identical
        steps each record stands for (the simulator reports a segment of steps as one)."""
        accepted = 0
        for step_s, batch, kv_tokens, prefill_tokens in records:
            if not (_valid(step_s, batch, kv_tokens, prefill_tokens) and 0 < weight < 1e9):
                self.num_refused += 1
                continue
            self._records.append((step_s, float(batch), float(kv_tokens), float(prefill_tokens), float(weight)))
            accepted += 1
        self.num_records += accepted
        self._pending += accepted
        return accepted

    @property
    def model(self) -> CostModel:
        if self._pending >= REFIT_EVERY or (self._pending and self.num_fits == 0 and len(self._records) >= 8):
            self._refit()
        return self._model

    def _refit(self) -> None:
        self._pending = 0
        self.num_fits += 1
        prior = self.prior
        records = list(self._records)
        # Features scaled to comparable magnitudes (the solve is on the scaled coefficients).
        scale = [1.0, max(1.0, _mean(r[1] for r in records)), max(1.0, _mean(r[2] for r in records)),
                 max(1.0, _mean(r[3] for r in records))]
        theta0 = [prior.a, prior.b * scale[1], prior.c * scale[2], prior.p * scale[3]]
        rows = [((1.0, r[1] / scale[1], r[2] / scale[2], r[3] / scale[3]), r[0], r[4]) for r in records]
        total_weight = sum(w for _, _, w in rows)
        # The prior's pull on coefficient j: PRIOR_WEIGHT records' worth of what the window says
        # about it, the spread of its feature (the intercept's: one per record).
        ridge = [PRIOR_WEIGHT] + [PRIOR_WEIGHT * max(1e-6, _weighted_variance([(x[j], w) for x, _, w in rows], total_weight))
                                  for j in range(1, 4)]
        robust = [1.0] * len(rows)
        theta = theta0
        for _ in range(IRLS_ROUNDS + 1):
            matrix = [[ridge[i] if i == j else 0.0 for j in range(4)] for i in range(4)]
            rhs = [ridge[i] * theta0[i] for i in range(4)]
            for (x, y, w), h in zip(rows, robust):
                wh = w * h
                for i in range(4):
                    xi = wh * x[i]
                    rhs[i] += xi * y
                    row = matrix[i]
                    for j in range(4):
                        row[j] += xi * x[j]
            solved = _solve(matrix, rhs)
            if solved is None:
                break
            theta = solved
            residuals = [y - sum(t * xi for t, xi in zip(theta, x)) for x, y, _ in rows]
            spread = 1.4826 * _median([abs(r) for r in residuals])
            if spread <= 0:
                break
            k = HUBER_K * spread
            cut = REJECT_K * spread  # gross outliers (a stall) count for nothing
            robust = [1.0 if abs(r) <= k else 0.0 if abs(r) > cut else k / abs(r) for r in residuals]
        coefs = [theta[0], theta[1] / scale[1], theta[2] / scale[2], theta[3] / scale[3]]
        bounded = [min(max(v, p0 / MAX_RATIO), p0 * MAX_RATIO) if p0 > 0 else max(0.0, v)
                   for v, p0 in zip(coefs, (prior.a, prior.b, prior.c, prior.p))]
        self._model = CostModel(a=bounded[0], b=bounded[1], c=bounded[2], p=bounded[3],
                                pool_s_per_token=prior.pool_s_per_token)

    def summary(self) -> dict[str, float]:
        """The current fit and its evidence, for status, metrics and the trace."""
        m = self.model
        return {"a_s": m.a, "b_s_per_seq": m.b, "c_s_per_kv_token": m.c, "p_s_per_prefill_token": m.p,
                "num_records": self.num_records, "num_refused": self.num_refused}


def _weighted_variance(pairs: list[tuple[float, float]], total_weight: float) -> float:
    mean = sum(v * w for v, w in pairs) / total_weight
    return sum(w * (v - mean) ** 2 for v, w in pairs) / total_weight


def _mean(values: Iterable[float]) -> float:
    total = n = 0
    for v in values:
        total += v
        n += 1
    return total / n if n else 0.0


def _median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    if not n:
        return 0.0
    mid = n // 2
    return values[mid] if n % 2 else 0.5 * (values[mid - 1] + values[mid])
