"""The ``context`` policy's length model: how much a waiting sample may still generate.

Owns the finished lengths of each group of a rollout and the two estimates derived from
them: the *ranking* estimate (a high quantile of remaining length) and the *reservation*
estimate (a low one). Pure arithmetic: no I/O, no clock.

Model. Log output lengths are normal with a group effect: ``log L = m_g + e``,
``m_g ~ N(m0, sb^2)`` across the groups of a rollout, ``e ~ N(0, sw^2)`` within a group.
A group's ``m_g`` is the normal posterior given *all* its finished samples (so one short
probe moves a group less than eight short samples do — the estimate uses the group's
whole finished distribution, not only its maximum), and a sample's remaining length is
read from its predictive distribution *conditioned on what it has already generated*,
``L | L > generated``: a sample that has outlived its group's typical length is
recognised as a long one, and its estimate grows with it.

The population parameters are fixed priors, not fitted: ``m0 = log(max_tokens) - 1.5``
(the paper's shapes have means of 19-40 % of the budget), ``sb = 0.6``, ``sw = 0.8`` —
within-group spread deliberately wide, so a group's samples are never assumed more alike
than they are. Fitting them online was measured and lost: the samples that finish first
are the short ones, so every early fit (even Kaplan-Meier over finished and continuing
samples — first chunks still running carry no length information) put the typical
length far too low and the spread too narrow (docs/benchmarks.md).

Between two finishes of a group its waiting samples' estimates do not change (the
policy re-indexes a group's waiting samples when one of its samples finishes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

_NORMAL = NormalDist()
RANK_QUANTILE = 0.99  # ranking: the latest-start rule against a long outcome
RESERVE_QUANTILE = 0.4  # admission: KV a chunk is expected to need (0.3 and 0.35 preempted; measured)
PRIOR_OFFSET = 1.5  # m0 = log(max_tokens) - PRIOR_OFFSET
PRIOR_SB = 0.6
PRIOR_SW = 0.8


@dataclass
class _Sums:
    n: int = 0
    s: float = 0.0

    def add(self, y: float) -> None:
        self.n += 1
        self.s += y


@dataclass
class RolloutLengths:
    """The finished log lengths of each group of one rollout."""

    max_tokens: int
    groups: dict[int, _Sums] = field(default_factory=dict)  # group index -> its finished logs

    @property
    def m0(self) -> float:
        return math.log(max(2, self.max_tokens)) - PRIOR_OFFSET

    def observe(self, group_index: int, num_tokens: int) -> None:
        """A sample of group ``group_index`` finished with ``num_tokens`` tokens."""
        self.groups.setdefault(group_index, _Sums()).add(math.log(max(1, num_tokens)))

    def group_posterior(self, group_index: int, pseudo: float | None = None) -> tuple[float, float]:
        """(mean, sd) of a new sample's log length in this group: the group effect's
        posterior from its finished samples (or ``pseudo``, a log length from an earlier
        rollout, when it has none), widened by the within-group spread."""
        g = self.groups.get(group_index)
        n, s = (g.n, g.s) if g is not None else (0, 0.0)
        if not n and pseudo is not None:
            n, s = 1, pseudo
        precision = 1.0 / PRIOR_SB ** 2 + n / PRIOR_SW ** 2
        mean = (self.m0 / PRIOR_SB ** 2 + s / PRIOR_SW ** 2) / precision
        return mean, math.sqrt(1.0 / precision + PRIOR_SW ** 2)


def remaining_quantile(mean: float, sd: float, generated: int, max_tokens: int, quantile: float) -> int:
    """The ``quantile`` point of ``L - generated`` given ``L > generated`` for ``log L ~
    N(mean, sd^2)``, within the budget: at least 1, at most ``max_tokens - generated``."""
    survival = 1.0 if generated <= 0 else 1.0 - _NORMAL.cdf((math.log(generated) - mean) / sd)
    u = min(max(1.0 - (1.0 - quantile) * survival, 1e-12), 1.0 - 1e-12)
    length = math.exp(min(mean + sd * _NORMAL.inv_cdf(u), 50.0))
    return max(1, min(max_tokens, math.ceil(length)) - generated)
