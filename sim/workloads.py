"""Workload traces for the simulator: groups of prompts with their true output lengths.

Owns the ``Trace`` value (what a rollout would generate, reduced to lengths), the
synthetic generator of heavy-tailed, group-correlated lengths, the presets shaped
like the Seer paper's three workloads, and the reader that turns a real rollout's
results (``seerctl rollout`` JSONL) into a trace. Pure data and arithmetic: no
scheduler, no engines, no randomness outside an explicitly seeded ``random.Random``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from collections.abc import Iterable
from pathlib import Path
from statistics import NormalDist
from typing import NamedTuple

# Total standard deviation of log(length) in synthetic traces. An assumption: the
# paper shows heavy tails but publishes no distribution; sigma = 1 puts the 90th
# percentile at ~3.6x the median before clipping.
DEFAULT_LOG_SIGMA = 1.0
# Share of log-length variance that lies between groups. An assumption: the paper
# reports strong within-group similarity; our small model measured ICC 0.18-0.30 on
# raw lengths under a hard 256-token cap (docs: measured-facts.md).
DEFAULT_ICC = 0.5


@dataclass(frozen=True)
class TraceGroup:
    prompt_tokens: int
    max_tokens: int  # the sampling budget of every sample in the group
    output_tokens: tuple[int, ...]  # true output length of each sample, 1..max_tokens


@dataclass(frozen=True)
class Trace:
    name: str
    groups: tuple[TraceGroup, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(g.output_tokens) for g in self.groups)

    @property
    def num_output_tokens(self) -> int:
        return sum(sum(g.output_tokens) for g in self.groups)

    @property
    def max_tokens(self) -> int:
        return max(g.max_tokens for g in self.groups)

    @property
    def mean_output_tokens(self) -> float:
        return self.num_output_tokens / max(1, self.num_requests)


@dataclass(frozen=True)
class WorkloadShape:
    """One column of the paper's workload table (prompt length is ours: not published)."""

    group_size: int
    num_requests: int
    max_tokens: int
    mean_tokens: int
    prompt_tokens: int  # assumed

    @property
    def num_groups(self) -> int:
        return self.num_requests // self.group_size


PAPER_WORKLOADS: dict[str, WorkloadShape] = {
    "moonlight": WorkloadShape(group_size=8, num_requests=3200, max_tokens=65536, mean_tokens=22386,
                               prompt_tokens=1024),
    # A vision-language model: images make prompts longer.
    "qwen2-vl-72b": WorkloadShape(group_size=16, num_requests=9600, max_tokens=40960, mean_tokens=7615,
                                  prompt_tokens=2048),
    "kimi-k2": WorkloadShape(group_size=8, num_requests=6400, max_tokens=98304, mean_tokens=38959,
                             prompt_tokens=2048),
}


def generate_trace(name: str, num_groups: int, group_size: int, max_tokens: int, mean_tokens: float,
                   prompt_tokens: int, icc: float, seed: int, *,
                   log_sigma: float = DEFAULT_LOG_SIGMA) -> Trace:
    """Synthetic heavy-tailed, group-correlated output lengths.

    Sample j of group i has length ``clip(round(exp(mu + u_i + e_ij)), 1, max_tokens)``
    with ``u_i ~ N(0, icc * log_sigma^2)`` shared by the group and ``e_ij ~ N(0, (1 -
    icc) * log_sigma^2)`` per sample: lognormal lengths whose log-variance is split
    between groups (``icc``, the intra-class correlation of log lengths: 0 = groups
    carry no information, 1 = all samples of a group are equally long) and within
    them. ``mu`` is solved so the expected *clipped* length equals ``mean_tokens``
    (lengths at ``max_tokens`` model truncated responses). Every prompt has
    ``prompt_tokens`` tokens. Same arguments, same trace.
    """
    if not 0.0 <= icc <= 1.0:
        raise ValueError(f"icc must be in [0, 1], got {icc}")
    if not 1 <= mean_tokens < max_tokens:
        raise ValueError(f"mean_tokens must be in [1, max_tokens={max_tokens}), got {mean_tokens}")
    if num_groups < 1 or group_size < 1 or prompt_tokens < 1 or log_sigma <= 0:
        raise ValueError("num_groups, group_size and prompt_tokens must be >= 1 and log_sigma > 0")
    return generate_iterations(name, 1, num_groups, group_size, max_tokens, mean_tokens, prompt_tokens, icc, seed,
                               persistence=0.0, log_sigma=log_sigma)[0]


def generate_iterations(name: str, num_iterations: int, num_groups: int, group_size: int, max_tokens: int,
                        mean_tokens: float, prompt_tokens: int, icc: float, seed: int, *, persistence: float,
                        log_sigma: float = DEFAULT_LOG_SIGMA) -> list[Trace]:
    """Several rollouts of the *same* prompts (group i is prompt i in every trace), as
    successive RL iterations produce them: each prompt keeps its group effect from one
    iteration to the next with correlation ``persistence`` (an AR(1) step,
    ``u' = persistence * u + sqrt(1 - persistence^2) * N(0, icc * log_sigma^2)``, so every
    iteration has the same length distribution), and every sample is drawn afresh. The
    first trace is ``generate_trace`` with the same arguments. Same arguments, same traces.
    """
    if not 0.0 <= icc <= 1.0:
        raise ValueError(f"icc must be in [0, 1], got {icc}")
    if not 0.0 <= persistence <= 1.0:
        raise ValueError(f"persistence must be in [0, 1], got {persistence}")
    if not 1 <= mean_tokens < max_tokens:
        raise ValueError(f"mean_tokens must be in [1, max_tokens={max_tokens}), got {mean_tokens}")
    if num_iterations < 1 or num_groups < 1 or group_size < 1 or prompt_tokens < 1 or log_sigma <= 0:
        raise ValueError("num_iterations, num_groups, group_size and prompt_tokens must be >= 1 and log_sigma > 0")
    mu = _solve_log_mean(mean_tokens, max_tokens, log_sigma)
    between = math.sqrt(icc) * log_sigma
    within = math.sqrt(1.0 - icc) * log_sigma
    rng = random.Random(seed)
    effects: list[float] = []
    traces = []
    for iteration in range(num_iterations):
        groups = []
        for i in range(num_groups):
            if iteration == 0:
                effects.append(rng.gauss(0.0, between))
            else:  # drawn after the previous iteration's samples: the first trace stays generate_trace's
                effects[i] = persistence * effects[i] + math.sqrt(1.0 - persistence ** 2) * rng.gauss(0.0, between)
            lengths = tuple(min(max_tokens, max(1, round(math.exp(mu + effects[i] + rng.gauss(0.0, within)))))
                            for _ in range(group_size))
            groups.append(TraceGroup(prompt_tokens=prompt_tokens, max_tokens=max_tokens, output_tokens=lengths))
        traces.append(Trace(name=name if num_iterations == 1 else f"{name}#{iteration}", groups=tuple(groups)))
    return traces


def paper_trace(name: str, *, scale: float = 1.0, icc: float = DEFAULT_ICC, seed: int = 0,
                log_sigma: float = DEFAULT_LOG_SIGMA) -> Trace:
    """A synthetic trace shaped like one of ``PAPER_WORKLOADS``. ``scale`` < 1 shrinks
    the number of groups and every length (max, mean, prompt) by the same factor, for
    quick runs: moonlight at 0.1 is 40 groups x 8 with lengths up to 6,554."""
    try:
        shape = PAPER_WORKLOADS[name]
    except KeyError:
        available = ", ".join(sorted(PAPER_WORKLOADS))
        raise ValueError(f"unknown workload {name!r}; available: {available}") from None
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    max_tokens = max(2, round(shape.max_tokens * scale))
    return generate_trace(
        f"{name}@{scale:g}" if scale != 1.0 else name,
        num_groups=max(1, round(shape.num_groups * scale)),
        group_size=shape.group_size,
        max_tokens=max_tokens,
        mean_tokens=min(max_tokens - 1, max(1.0, shape.mean_tokens * scale)),
        prompt_tokens=max(1, round(shape.prompt_tokens * scale)),
        icc=icc,
        seed=seed,
        log_sigma=log_sigma,
    )


def paper_iterations(name: str, num_iterations: int, *, persistence: float, scale: float = 1.0,
                     icc: float = DEFAULT_ICC, seed: int = 0, log_sigma: float = DEFAULT_LOG_SIGMA) -> list[Trace]:
    """``paper_trace`` repeated over RL iterations of the same prompts (``generate_iterations``);
    the first trace equals ``paper_trace(name, scale=scale, icc=icc, seed=seed)``."""
    shape = _shape(name)
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    max_tokens = max(2, round(shape.max_tokens * scale))
    return generate_iterations(
        f"{name}@{scale:g}" if scale != 1.0 else name, num_iterations,
        num_groups=max(1, round(shape.num_groups * scale)), group_size=shape.group_size, max_tokens=max_tokens,
        mean_tokens=min(max_tokens - 1, max(1.0, shape.mean_tokens * scale)),
        prompt_tokens=max(1, round(shape.prompt_tokens * scale)), icc=icc, seed=seed, persistence=persistence,
        log_sigma=log_sigma)


def _shape(name: str) -> WorkloadShape:
    try:
        return PAPER_WORKLOADS[name]
    except KeyError:
        available = ", ".join(sorted(PAPER_WORKLOADS))
        raise ValueError(f"unknown workload {name!r}; available: {available}") from None


def length_icc(trace: Trace) -> float:
    """One-way ANOVA intra-class correlation ICC(1) of the raw output lengths: the
    share of length variance explained by the group (groups of any sizes >= 1)."""
    groups = [g.output_tokens for g in trace.groups if g.output_tokens]
    n = sum(len(g) for g in groups)
    k = len(groups)
    if k < 2 or n <= k:
        raise ValueError("length_icc needs at least two groups and a group with two samples")
    grand = sum(sum(g) for g in groups) / n
    between = sum(len(g) * (sum(g) / len(g) - grand) ** 2 for g in groups) / (k - 1)
    within = sum(sum((x - sum(g) / len(g)) ** 2 for x in g) for g in groups) / (n - k)
    n0 = (n - sum(len(g) ** 2 for g in groups) / n) / (k - 1)  # effective group size
    denominator = between + (n0 - 1) * within
    return (between - within) / denominator if denominator > 0 else 0.0


class ResultGroup(NamedTuple):
    """One group of a finished rollout, as a trace needs it."""

    group_index: int
    prompt_tokens: int
    output_tokens: tuple[int, ...]  # every sample's true length
    cut: tuple[bool, ...]  # per sample: ended by the token budget (finish_reason "length")


def trace_of_results(groups: Iterable[ResultGroup], *, max_tokens: int | None, name: str,
                     where: str | None = None) -> Trace:
    """A finished rollout's groups as a trace, ordered by ``group_index``. The budget is
    ``max_tokens`` or, if None, the length of a sample the budget cut, else the longest
    sample. Raises ValueError (naming ``where``, default ``name``) for no groups, a sample
    with no tokens, or a sample longer than the budget."""
    where = name if where is None else where
    rows = sorted(groups, key=lambda g: g.group_index)
    if not rows:
        raise ValueError(f"{where}: no rollout result rows")
    if any(not g.output_tokens or min(g.output_tokens) < 1 for g in rows):
        raise ValueError(f"{where}: a sample has no tokens; every sample must have at least one")
    longest = max(max(g.output_tokens) for g in rows)
    cut_at = max((n for g in rows for n, cut in zip(g.output_tokens, g.cut) if cut), default=0)
    budget = (cut_at or longest) if max_tokens is None else max_tokens
    if budget < longest:
        raise ValueError(f"{where}: a sample has {longest} tokens, more than max_tokens={max_tokens}")
    return Trace(name=name, groups=tuple(TraceGroup(g.prompt_tokens, budget, g.output_tokens) for g in rows))


def load_rollout_jsonl(path: str | Path, *, max_tokens: int | None = None, name: str | None = None) -> Trace:
    """Read a rollout's results (one JSON object per group: ``{"id", "group_index",
    "samples": [{"token_ids", "num_prompt_tokens", "finish_reason", ...}]}``, as
    ``seerctl rollout`` writes them) as a trace: true length = ``len(token_ids)``;
    budget and ordering as ``trace_of_results``."""
    file = Path(path)
    rows: list[ResultGroup] = []
    for lineno, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            row = json.loads(line)
            samples = row["samples"]
            rows.append(ResultGroup(group_index=int(row["group_index"]),
                                    prompt_tokens=max(int(s["num_prompt_tokens"]) for s in samples),
                                    output_tokens=tuple(len(s["token_ids"]) for s in samples),
                                    cut=tuple(s.get("finish_reason") == "length" for s in samples)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{where}: not a rollout result row (needs group_index and samples with "
                             f"token_ids and num_prompt_tokens): {exc!r}") from None
        except ValueError as exc:  # max() of no samples, or a non-integer field
            raise ValueError(f"{where}: bad rollout result row: {exc}") from None
        if min(rows[-1].output_tokens) < 1:
            raise ValueError(f"{where}: a sample has no tokens; every sample must have at least one")
    return trace_of_results(rows, max_tokens=max_tokens, name=name if name is not None else file.stem,
                            where=str(file))


def _solve_log_mean(mean_tokens: float, max_tokens: int, log_sigma: float) -> float:
    """mu such that E[min(exp(N(mu, sigma^2)), max_tokens)] = mean_tokens (bisection;
    the clipped mean increases with mu)."""
    phi = NormalDist().cdf
    log_max = math.log(max_tokens)
    s = log_sigma

    def clipped_mean(mu: float) -> float:
        return (math.exp(mu + s * s / 2) * phi((log_max - mu - s * s) / s)
                + max_tokens * (1.0 - phi((log_max - mu) / s)))

    lo, hi = -10.0 * s, log_max + 10.0 * s
    for _ in range(200):
        mid = (lo + hi) / 2
        if clipped_mean(mid) < mean_tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
