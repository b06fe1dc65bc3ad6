"""Speculative decoding in the simulator: acceptance profiles and the per-segment planner.

Owns the *assumptions* the simulated engines make about drafting — how acceptance depends
on how many siblings are ahead, what multi-path drafts add, what verifying costs — and
the planner (``SimSpecPlanner``) that every simulated engine asks, at the start of each
segment, for its rows' draft lengths and expected tokens per step. The decision itself
is the production one (``seer.specdecode.choose_draft_lengths``); what is simulated is
the acceptance and the step time.

Acceptance. A profile gives the mean tokens per step (accepted drafts + 1) measured at
draft length ``ref_gamma`` as a function of k, the number of siblings whose text reaches
past the row's current position (finished, or further along); between the published
points it is interpolated linearly in log2(1 + k) and it is held flat beyond the last.
That mean is turned into a per-token acceptance α (the α whose truncated-geometric mean
E(α, ref_gamma) equals it), and a row drafting γ then yields E(α, γ) tokens per step. Real
suffix-draft acceptance is burstier than geometric; this is the cost model's shape, not a
measurement. Self-only drafting (vanilla SD) uses k = 0 always.

Multi-path. A drafting row may draft ``paths`` paths of its γ; the tree verifier then
checks paths × γ tokens (an upper bound: the paths share prefixes) at the profile's
multi-path acceptance. After the draft lengths are chosen, a row goes multi-path when its
extra expected tokens cost less than the step's current seconds per token — in practice
only in small batches (the tail), where the fixed step cost dominates.

Progress is the *expected* tokens per step, not a sampled accepted length: the engine
model commits segments of many steps at once, over which the sum of accepted lengths
concentrates (for a row at α = 0.5, γ = 8, the relative spread of the mean over 64 steps
is about 9 %, over a whole response of thousands of steps under 2 %).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from seer.sim.engine_model import CostModel, SpecRowInfo
from seer.specdecode import DraftTimeModel, SpecRow, StepTimeModel, choose_draft_lengths, expected_tokens


@dataclass(frozen=True)
class AcceptanceProfile:
    """Mean tokens per step at ``ref_gamma`` by siblings ahead: ((k, tokens), ...)."""

    name: str
    linear: tuple[tuple[int, float], ...]
    multipath: tuple[tuple[int, float], ...]
    ref_gamma: int = 8
    paths: int = 4
    source: str = ""

    def tokens_per_step(self, siblings_ahead: int, multipath: bool = False) -> float:
        points = self.multipath if multipath else self.linear
        x = math.log2(1 + siblings_ahead)
        if x <= math.log2(1 + points[0][0]):
            return points[0][1]
        for (k0, e0), (k1, e1) in zip(points, points[1:]):
            x0, x1 = math.log2(1 + k0), math.log2(1 + k1)
            if x <= x1:
                return e0 + (e1 - e0) * (x - x0) / (x1 - x0)
        return points[-1][1]


def alpha_for_tokens(tokens_per_step: float, gamma: int) -> float:
    """The per-token acceptance α with E(α, γ) = ``tokens_per_step`` (bisection)."""
    if not 1.0 <= tokens_per_step <= gamma + 1:
        raise ValueError(f"tokens per step must be in [1, {gamma + 1}], got {tokens_per_step}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, gamma) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# docs/speculative-decoding.md, acceptance study, temperature 0.6, γ = 8 columns.
STUDY_SAME = AcceptanceProfile(
    "study-same", linear=((0, 1.69), (1, 1.74), (3, 1.82), (7, 1.88)),
    multipath=((0, 1.86), (1, 1.94), (3, 2.04), (7, 2.11)),
    source="our offline study, T=0.6, gamma 8, siblings at the same position (SmolLM2-135M)")
STUDY_ALL = AcceptanceProfile(
    "study-all", linear=((0, 1.69), (1, 1.84), (3, 1.96), (7, 2.07)),
    multipath=((0, 1.86), (1, 2.06), (3, 2.23), (7, 2.35)),
    source="our offline study, T=0.6, gamma 8, siblings complete (SmolLM2-135M)")
# The paper (Qwen2-VL-72B): 1.70 self, 2.04 with 1 sibling, 2.53 with 15, 2.85 with 15 and
# 4 paths. Its multi-path gain at fewer siblings is not published: scaled by the same
# 2.85 / 2.53 (an assumption). Its draft length is not stated here: read at γ = 8.
PAPER = AcceptanceProfile(
    "paper", linear=((0, 1.70), (1, 2.04), (15, 2.53)),
    multipath=((0, 1.70 * 2.85 / 2.53), (1, 2.04 * 2.85 / 2.53), (15, 2.85)),
    source="the Seer paper's Qwen2-VL-72B acceptance")
PROFILES = {p.name: p for p in (STUDY_SAME, STUDY_ALL, PAPER)}


@dataclass(frozen=True)
class SimSpecConfig:
    """How the simulated engines speculate."""

    mode: Literal["fixed", "adaptive"] = "adaptive"
    gamma: int = 4  # "fixed": every row drafts this many tokens, at any batch size
    gamma_max: int = 8  # "adaptive": the cap of choose_draft_lengths
    lam: float = 2.0  # "adaptive": weight of probes (sample 0 of each group)
    grouped: bool = True  # drafts from the group's siblings too (False: the row's own text only)
    multipath: bool = False  # full-length rows may draft ``profile.paths`` paths
    profile: str = "study-same"
    # Drafting on the critical path: arctic-inference's C++ suffix tree drafted in
    # ~5 µs per call here (docs/speculative-decoding.md, "Cost of drafting").
    draft_time: DraftTimeModel = field(default_factory=lambda: DraftTimeModel(per_seq_s=5e-6))
    replan_steps: int = 64  # longest segment between two plans (acceptance moves with siblings)

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown acceptance profile {self.profile!r}; choose one of {sorted(PROFILES)}")
        if self.mode not in ("fixed", "adaptive"):
            raise ValueError(f"mode must be 'fixed' or 'adaptive', got {self.mode!r}")
        if self.gamma < 0 or self.gamma_max < 1 or self.replan_steps < 1:
            raise ValueError("gamma must be >= 0, gamma_max and replan_steps >= 1")


class SimSpecPlanner:
    """One per simulation, shared by its engines: knows where every request is (to count
    the siblings ahead of a row) and plans each engine's segment."""

    def __init__(self, config: SimSpecConfig, probes: set[str]) -> None:
        self.config = config
        self.profile = PROFILES[config.profile]
        self.replan_steps = config.replan_steps
        self._probes = probes  # request keys of the high-priority rows
        # request -> (tokens generated at ``at_s``, tokens per second since, at_s)
        self._positions: dict[str, tuple[float, float, float]] = {}
        self._complete: dict[str, set[str]] = {}  # group -> its finished requests
        self._members: dict[str, set[str]] = {}  # group -> requests seen so far
        self._alpha: dict[tuple[int, bool], float] = {}
        self.num_multipath_row_plans = self.num_row_plans = 0

    def chunk_finished(self, request_key: str, group_key: str, num_generated: int, complete: bool) -> None:
        """A chunk ended: the request stands at ``num_generated`` until its next chunk."""
        self._positions[request_key] = (float(num_generated), 0.0, 0.0)
        self._members.setdefault(group_key, set()).add(request_key)
        if complete:
            self._complete.setdefault(group_key, set()).add(request_key)

    def alpha(self, siblings_ahead: int, multipath: bool = False) -> float:
        key = (siblings_ahead, multipath)
        if key not in self._alpha:
            tokens = self.profile.tokens_per_step(siblings_ahead, multipath)
            self._alpha[key] = alpha_for_tokens(tokens, self.profile.ref_gamma)
        return self._alpha[key]

    def _siblings_ahead(self, rows: Sequence[SpecRowInfo], now: float) -> list[int]:
        if not self.config.grouped:
            return [0] * len(rows)
        # group -> (request, position now) of its unfinished members
        where: dict[str, list[tuple[str, float]]] = {}
        out = []
        for row in rows:
            group = row.prefix_key or row.request_key
            if group not in where:
                complete = self._complete.get(group, ())
                where[group] = [(key, pos + speed * (now - at))
                                for key in self._members.get(group, ()) if key not in complete
                                for pos, speed, at in (self._positions[key],)]
            done = len(self._complete.get(group, ()))
            out.append(done + sum(1 for key, p in where[group]
                                  if p > row.position and key != row.request_key))
        return out

    def _multipath(self, step_time: StepTimeModel, num_seqs: int, ahead: list[int], gammas: list[int],
                   rates: list[float], num_drafts: int) -> tuple[list[float], int]:
        """Switch rows to multi-path drafts where that buys tokens for less than the
        step's current seconds per token: row i's extra tokens E_mp − E cost
        (paths − 1)·γ_i more verified tokens."""
        config = self.config
        seconds = (step_time.predict(num_seqs, num_seqs + num_drafts)
                   + config.draft_time.seconds(num_seqs, num_drafts))
        per_token = seconds / sum(rates)
        per_draft_s = step_time.predict(num_seqs, num_seqs + 1) - step_time.predict(num_seqs, num_seqs)
        per_draft_s += config.draft_time.per_draft_s
        rates = list(rates)
        for i, gamma in enumerate(gammas):
            if gamma == 0:
                continue
            gain = expected_tokens(self.alpha(ahead[i], True), gamma) - rates[i]
            extra = (self.profile.paths - 1) * gamma
            if gain > 0 and extra * per_draft_s < gain * per_token:
                rates[i] += gain
                num_drafts += extra
                self.num_multipath_row_plans += 1
        return rates, num_drafts

    def plan(self, engine_id: int, now: float, rows: Sequence[SpecRowInfo], cost: CostModel,
             context_tokens: float) -> tuple[list[float], int, float]:
        config = self.config
        num_seqs = len(rows)
        ahead = self._siblings_ahead(rows, now)
        alphas = [self.alpha(k) for k in ahead]
        # The engine's true step time, as a profiled StepTimeModel would give it.
        step_time = StepTimeModel(cost.a + cost.c * context_tokens, 0.0, cost.b)
        if config.mode == "fixed":
            gammas = [config.gamma] * num_seqs
        else:
            spec_rows = [SpecRow(a, row.request_key in self._probes) for a, row in zip(alphas, rows)]
            gammas = choose_draft_lengths(spec_rows, step_time, config.gamma_max, config.lam,
                                          config.draft_time)
        rates = [expected_tokens(a, g) for a, g in zip(alphas, gammas)]
        num_drafts = sum(gammas)
        if config.multipath:
            rates, num_drafts = self._multipath(step_time, num_seqs, ahead, gammas, rates, num_drafts)
        self.num_row_plans += num_seqs
        draft_s = config.draft_time.seconds(num_seqs, num_drafts)
        step_s = cost.verify_step_s(num_seqs, num_drafts, context_tokens) + draft_s
        for row, rate in zip(rows, rates):
            self._positions[row.request_key] = (row.position, rate / step_s, now)
            if row.prefix_key is not None:
                self._members.setdefault(row.prefix_key, set()).add(row.request_key)
        return rates, num_drafts, draft_s
