"""The ``context`` policy's length model: how much a waiting sample may still generate.

Owns the finished lengths of each group of a rollout and the two estimates derived from
them: the *ranking* estimate (a high quantile of remaining length) and the *reservation*
estimate (the mean and spread of what the next chunk will use). Pure arithmetic: no I/O,
no clock.

Model. Log output lengths are normal with a group effect: ``log L = m_g + e``,
``m_g ~ N(m0, sb^2)`` across the groups of a rollout, ``e ~ N(0, sw^2)`` within a group.
A group's ``m_g`` is the normal posterior given *all* its finished samples (so one short
probe moves a group less than eight short samples do — the estimate uses the group's
whole finished distribution, not only its maximum), and a sample's remaining length is
read from its predictive distribution *conditioned on what it has already generated*,
``L | L > generated``: a sample that has outlived its group's typical length is
recognised as a long one, and its estimate grows with it.

The population parameters start as priors: ``m0 = log(max_tokens) - 1.5`` (the paper's
shapes have means of 19-40 % of the budget), ``sb = 0.6``, ``sw = 0.8``. They are fitted
online (``RolloutLengths.refit``) once enough probes have finished, without the bias that
sank earlier fits (the samples that finish first are the short ones):

* ``m0`` and the total spread ``sqrt(sb^2 + sw^2)`` from the *probes*: one sample per
  group, all started first, so an unbiased sample of the rollout's lengths, fitted as a
  normal with the running ones censored, all read up to a common horizon (``refit``).
* ``sw`` from the groups, each read up to its own horizon (``within``), and ``sb`` as
  what is left of the total.

Measured (docs/notes/context-scheduling.md, "Fitting the length model"): -0.6 to +2.9 % on the paper
shapes over three seeds, and up to 1.26x ``divided`` (was 1.09x) where tails are light
(log sigma 0.6), where the fixed ``sw`` was up to three times the true one.

Between two finishes of a group, and between two fits, its waiting samples' estimates do
not change (the policy re-indexes a group's waiting samples when one of its samples
finishes, and every waiting sample after a fit).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from statistics import NormalDist

_NORMAL = NormalDist()
RANK_QUANTILE = 0.99  # ranking: the latest-start rule against a long outcome
# Admission reserves a chunk's expected use plus RESERVE_Z standard deviations of an engine's
# total, shared out per chunk (``ContextPolicy._reserve``). With the cohort calibration
# (``UseCalibration``, one per stage of a sample) 1.0 preempted on none of 90 runs (81 sweep
# points and 9 shape runs, 3 seeds) and was denser than 1.5 (docs/benchmarks.md,
# "Reserving by the engine's total").
RESERVE_Z = 1.0
# The calibration of expected use (``UseCalibration``): sums decayed by CALIBRATION_DECAY per
# chunk, the scale re-read every CALIBRATION_EVERY returned chunks, never below
# CALIBRATION_MIN_SCALE. The fixed priors' mean is right within 2x on the paper's shapes
# (Qwen2-VL-72B uses ~0.6x of it).
CALIBRATION_EVERY = 16
CALIBRATION_DECAY = 0.995
CALIBRATION_MIN_SCALE = 0.5
CALIBRATION_STAGES = 3  # calibrated apart: a sample's first chunk, its second, the rest (``ContextPolicy._stage``)
PRIOR_OFFSET = 1.5  # m0 = log(max_tokens) - PRIOR_OFFSET
PRIOR_SB = 0.6
PRIOR_SW = 0.8
FIT_MIN_PROBES = 16  # finished probes before the fit replaces the fixed priors
FIT_MIN_GROUPS = 8  # groups with information before the within-group spread is read from them
FIT_GROWTH = 1.25  # refit once the finished probes grew by this factor
FIT_MIN_SB = 0.05  # the between-group spread never fitted below this
FIT_LATE = 0.1  # the share of probes the fit's horizon may leave behind


@dataclass
class _Sums:
    n: int = 0
    s: float = 0.0

    def add(self, y: float) -> None:
        self.n += 1
        self.s += y


def _above(c: float, mean: float, sd: float) -> tuple[float, float]:
    """(E[y], E[y^2]) of ``y ~ N(mean, sd^2)`` given ``y > c``."""
    a = (c - mean) / sd
    tail = _upper(a)
    ratio = math.exp(-0.5 * a * a) / math.sqrt(2 * math.pi) / tail if tail > 1e-300 else a  # inverse Mills ratio
    return mean + sd * ratio, mean * mean + sd * sd + sd * (c + mean) * ratio


def _expected_sums(exact: list[float], censored: list[float], mean: float, sd: float) -> tuple[float, float]:
    """EM's expectation step: (sum of y, sum of y^2) over the exact values and the censored
    ones' conditional moments above their points, under ``N(mean, sd^2)``."""
    s1, s2 = sum(exact), sum(y * y for y in exact)
    for c in censored:
        e1, e2 = _above(c, mean, sd)
        s1 += e1
        s2 += e2
    return s1, s2


def censored_normal_fit(exact: list[float], censored: list[float], iterations: int = 60) -> tuple[float, float]:
    """(mean, sd) of a normal from values seen exactly and values known only to lie above
    a point (EM: each censored value replaced by its conditional moments above its point)."""
    n = len(exact) + len(censored)
    mean = (sum(exact) + sum(censored)) / n
    sd = math.sqrt(max(0.0025, (sum(y * y for y in exact) + sum(c * c for c in censored)) / n - mean * mean))
    for _ in range(iterations):
        s1, s2 = _expected_sums(exact, censored, mean, sd)
        new_mean = s1 / n
        new_sd = math.sqrt(max(0.0025, s2 / n - new_mean * new_mean))
        done = abs(new_mean - mean) < 1e-6 and abs(new_sd - sd) < 1e-6
        mean, sd = new_mean, new_sd
        if done:
            break
    return mean, sd


def within_group_fit(groups: list[tuple[list[float], list[float]]], sd: float, iterations: int = 40) -> float:
    """The common within-group sd of groups of normal values, each group with its own mean
    (fixed effects), from each group's exact values and values known only to lie above a
    point: EM from ``sd``, each group's mean refined by a few inner steps."""
    for _ in range(iterations):
        squares = dof = 0.0
        for exact, censored in groups:
            n = len(exact) + len(censored)
            mean = (sum(exact) + sum(censored)) / n
            for _ in range(3 if censored else 0):
                mean = _expected_sums(exact, censored, mean, sd)[0] / n
            s1, s2 = _expected_sums(exact, censored, mean, sd)
            squares += s2 - 2 * mean * s1 + n * mean * mean
            dof += n - 1
        new = math.sqrt(max(0.0025, squares / dof)) if dof else sd
        if abs(new - sd) < 1e-4:
            return new
        sd = new
    return sd


def _logged(entry: tuple[int, bool, bool]) -> tuple[float, bool, bool]:
    return math.log(entry[0]), entry[1], entry[2]


@dataclass
class RolloutLengths:
    """The finished log lengths of each group of one rollout, and the population's
    parameters, fitted from how far every sample got (``refit``)."""

    max_tokens: int
    num_groups: int = 0  # of the rollout
    group_size: int = 0
    groups: dict[int, _Sums] = field(default_factory=dict)  # group index -> its finished logs
    # group index -> sample index -> (its length, or what it had generated when its last
    # chunk returned; finished; exact: finished and not cut by the budget). Logs are taken
    # when fitting: this is written for every returned chunk.
    samples: dict[int, dict[int, tuple[int, bool, bool]]] = field(default_factory=dict)
    m0: float = 0.0
    sb: float = PRIOR_SB
    sw: float = PRIOR_SW
    _fitted_at: int = 0  # exact probe lengths at the last fit
    _horizon: float = -math.inf  # the last fit's horizon
    _probes_moved: bool = False  # a probe reported since ``refit`` last looked
    _probes_exact: int = 0  # probes whose exact length is known

    def __post_init__(self) -> None:
        self.m0 = math.log(max(2, self.max_tokens)) - PRIOR_OFFSET

    def observe(self, group_index: int, num_tokens: int) -> None:
        """A sample of group ``group_index`` finished with ``num_tokens`` tokens."""
        self.groups.setdefault(group_index, _Sums()).add(math.log(max(1, num_tokens)))

    def progress(self, group_index: int, sample_index: int, generated: int, finished: bool) -> None:
        """How far sample ``sample_index`` (0: the probe) of group ``group_index`` got when
        its chunk returned; ``finished``: that is its length."""
        if generated > 0:
            exact = finished and generated < self.max_tokens
            group = self.samples.get(group_index)  # (not ``setdefault``: it would build a dict per chunk)
            if group is None:
                group = self.samples[group_index] = {}
            group[sample_index] = (generated, finished, exact)
            if sample_index == 0:
                self._probes_moved = True
                self._probes_exact += exact

    def refit(self) -> bool:
        """Fit ``m0`` and the total spread to the probes, ``sw`` to the groups (``within``),
        and ``sb`` as what is left of the total. True if the parameters changed.

        The probes, one per group and all started first, are an unbiased sample of the
        rollout's lengths. They are read up to a common *horizon*: the point that all but
        FIT_LATE of them have passed or finished below. A probe that finished beyond it
        counts as censored there, like one still running past it. Without it, the short
        probes of a chunk under way count as exact while their long peers still read
        their last chunk's end, and the fit reads short (measured: total spread 0.62 for
        a true 1.0). Looks only when a probe has reported since it last looked."""
        if not self._probes_moved or self._probes_exact < FIT_MIN_PROBES:
            return False
        self._probes_moved = False
        probes = [_logged(s[0]) for s in self.samples.values() if 0 in s]
        n = max(self.num_groups, len(probes))
        resolved = sorted(math.inf if done else y for y, done, _ in probes)
        late = math.floor(FIT_LATE * n) - (n - len(resolved))  # probes not reported yet count as late
        if late < 0:
            return False
        horizon = resolved[late]
        exact = [y for y, _, sure in probes if sure and y <= horizon]
        if len(exact) < FIT_MIN_PROBES or (horizon <= self._horizon and len(exact) < FIT_GROWTH * self._fitted_at):
            return False
        self._fitted_at, self._horizon = len(exact), horizon
        censored = [min(y, horizon) for y, _, sure in probes if not (sure and y <= horizon)]
        mean, total = censored_normal_fit(exact, censored)
        within = self.within()
        sw = min(total, within) if within is not None else total * PRIOR_SW / math.hypot(PRIOR_SB, PRIOR_SW)
        self.m0, self.sw = mean, sw
        self.sb = math.sqrt(max(FIT_MIN_SB ** 2, total * total - sw * sw))
        return True

    def within(self) -> float | None:
        """The within-group spread, from every group whose samples have all reported, each
        read up to its own horizon (the least that its running samples have generated): a
        sample that finished beyond it counts as censored there. Groups whose samples all
        finished read it short: the groups that complete first are those whose samples are
        all short (measured: 0.40 for a true 0.54). None while fewer than FIT_MIN_GROUPS
        groups have a sample seen below their horizon."""
        data: list[tuple[list[float], list[float]]] = []
        for group in self.samples.values():
            if len(group) < self.group_size:
                continue
            samples = [_logged(entry) for entry in group.values()]
            horizon = min((y for y, done, _ in samples if not done), default=math.inf)
            exact = [y for y, _, sure in samples if sure and y <= horizon]
            if exact:
                data.append((exact, [min(y, horizon) for y, _, sure in samples if not (sure and y <= horizon)]))
        return within_group_fit(data, PRIOR_SW) if len(data) >= FIT_MIN_GROUPS else None

    def group_posterior(self, group_index: int, pseudo: float | None = None) -> tuple[float, float]:
        """(mean, sd) of a new sample's log length in this group: the group effect's
        posterior from its finished samples (or ``pseudo``, a log length from an earlier
        rollout, when it has none), widened by the within-group spread."""
        g = self.groups.get(group_index)
        n, s = (g.n, g.s) if g is not None else (0, 0.0)
        if not n and pseudo is not None:
            n, s = 1, pseudo
        sb2, sw2 = self.sb ** 2, self.sw ** 2
        precision = 1.0 / sb2 + n / sw2
        mean = (self.m0 / sb2 + s / sw2) / precision
        return mean, math.sqrt(1.0 / precision + sw2)


def remaining_quantile(mean: float, sd: float, generated: int, max_tokens: int, quantile: float) -> int:
    """The ``quantile`` point of ``L - generated`` given ``L > generated`` for ``log L ~
    N(mean, sd^2)``, within the budget: at least 1, at most ``max_tokens - generated``."""
    survival = 1.0 if generated <= 0 else 1.0 - _NORMAL.cdf((math.log(generated) - mean) / sd)
    u = min(max(1.0 - (1.0 - quantile) * survival, 1e-12), 1.0 - 1e-12)
    length = math.exp(min(mean + sd * _NORMAL.inv_cdf(u), 50.0))
    return max(1, min(max_tokens, math.ceil(length)) - generated)


def _upper(z: float) -> float:
    """P(Z > z) for a standard normal, accurate far into the tail (not 1 - cdf)."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def chunk_use(mean: float, sd: float, generated: int, budget: int, max_tokens: int) -> tuple[float, float]:
    """(mean, standard deviation) of the tokens the next chunk of ``budget`` tokens will
    generate, ``U = min(L, b) - generated`` with ``b = min(generated + budget, max_tokens)``,
    given ``L > generated`` for ``log L ~ N(mean, sd^2)``. Closed form: the lognormal's
    partial moments over (generated, b) plus the mass beyond b, which uses the whole budget.
    Upper tails come from ``erfc``, so a sample far past its group's typical length (the
    survival ~1e-12) still gets a precise answer."""
    b = min(generated + budget, max_tokens)
    if b <= generated:
        return 1.0, 0.0
    z_b = (math.log(b) - mean) / sd
    z_g = -math.inf if generated <= 0 else (math.log(generated) - mean) / sd
    survival = _upper(z_g)
    if survival < 1e-300:  # past every representable length: it ends at once
        return 1.0, 0.0

    def partial(k: int) -> float:  # E[L^k; generated < L < b]
        return math.exp(min(k * mean + k * k * sd * sd / 2, 700.0)) * max(0.0, _upper(z_g - k * sd) - _upper(z_b - k * sd))

    beyond = _upper(z_b)
    inside, span = max(0.0, survival - beyond), b - generated
    m1, m2 = partial(1), partial(2)
    first = (m1 - generated * inside + span * beyond) / survival
    second = (m2 - 2 * generated * m1 + generated * generated * inside + span * span * beyond) / survival
    first = min(float(span), max(1.0, first))
    return first, math.sqrt(max(0.0, second - first * first))


class UseCalibration:
    """The scale on the length model's expected chunk use: what chunks really generated over
    what the model expected (its fixed priors' typical length is off for this workload).

    Chunks return shortest first, so a plain ratio over the returned chunks reads low until
    the long ones of the same wave return (measured: 0.70 early in a run, 1.10 later, and
    the run preempted on the low reading). So the scale falls only on *complete cohorts*:
    a chunk's use counts there once every chunk admitted before it has returned. Returned
    chunks alone may raise it at once: reading high from a short-first sample is evidence
    enough. Keys are whatever identifies a chunk in flight (the policy's requests: one
    chunk each at a time)."""

    def __init__(self) -> None:
        self.scale = 1.0
        self._in_flight: dict[Hashable, list[float]] = {}  # key -> [expected, used (-1 in flight, -2 dropped)]
        self._order: deque[list[float]] = deque()  # every record in admission order, until its cohort is complete
        self._returned = [0.0, 0.0]  # decayed (used, expected) of every returned chunk
        self._complete = [0.0, 0.0]  # the same over complete cohorts only
        self._num_returned = 0

    def admitted(self, key: Hashable, expected: float) -> None:
        stale = self._in_flight.get(key)
        if stale is not None:  # its last chunk never reported back: it must not hold a cohort open for good
            stale[1] = -2.0
        record = [expected, -1.0]
        self._in_flight[key] = record
        self._order.append(record)

    def dropped(self, key: Hashable) -> None:
        """The chunk will never return with a length (its rollout was cancelled)."""
        record = self._in_flight.pop(key, None)
        if record is not None:
            record[1] = -2.0
            self._advance()

    def returned(self, key: Hashable, used: int) -> None:
        record = self._in_flight.pop(key, None)
        if record is None:
            return
        record[1] = float(used)
        _add(self._returned, used, record[0])
        self._advance()
        self._num_returned += 1
        if self._num_returned % CALIBRATION_EVERY == 0:
            fast = _ratio(self._returned)
            slow = _ratio(self._complete) if self._complete[1] else 1.0
            scale = max(CALIBRATION_MIN_SCALE, fast, slow)
            if abs(scale - self.scale) > 0.02:
                self.scale = scale

    def _advance(self) -> None:
        order = self._order
        while order and order[0][1] != -1.0:
            expected, used = order.popleft()
            if used >= 0:
                _add(self._complete, used, expected)


def _add(sums: list[float], used: float, expected: float) -> None:
    sums[0] = CALIBRATION_DECAY * sums[0] + used
    sums[1] = CALIBRATION_DECAY * sums[1] + expected


def _ratio(sums: list[float]) -> float:
    return sums[0] / sums[1] if sums[1] else 0.0
