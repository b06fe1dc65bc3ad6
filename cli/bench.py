"""``seerctl bench``: several policies on the same simulated workload, side by side.

Runs the paper-scale simulator (``sim/simulator.py``: the real scheduler core, a
virtual clock, engine cost models) once per policy on one trace and prints one table:
throughput and its ratio to the first policy (the ``group`` baseline) and to ``request``
(the per-sample least-requests baseline) when it ran, tail time and its change,
preemptions, migrations, mean engine idle %, and each policy's throughput as a share of
``oracle``'s. ``--sweep`` prints the robustness table instead: ``divided``, ``context``
and ``oracle`` over within-group correlation x tail heaviness x the three paper shapes.
Real-engine comparisons use ``benchmarks/rollout_policies.py``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.simulator import SimResult, simulate
from seer.sim.workloads import DEFAULT_ICC, DEFAULT_LOG_SIGMA, PAPER_WORKLOADS, load_rollout_jsonl, paper_trace

COSTS = {"gpu": CostModel.gpu_h800_like, "cpu": CostModel.cpu_smollm2}
# The sweep: within-group correlation of log length x log sigma x shape (engines, scale).
SWEEP_ICC = (0.2, 0.5, 0.8)
SWEEP_LOG_SIGMA = (0.6, 1.0, 1.4)
SWEEP_SHAPES = (("moonlight", 32, 1.0), ("qwen2-vl-72b", 16, 1.0), ("kimi-k2", 8, 0.5))
SWEEP_POLICIES = ("divided", "context", "oracle-group", "oracle")


def bench_problem(workload: str, scale: float, policies: list[str], num_engines: int, kv_tokens: int,
                  chunk_tokens: int, icc: float, log_sigma: float) -> str | None:
    """What is wrong with these bench arguments, as one line naming the fix; None if nothing."""
    from seer.controlplane.policies import POLICIES

    if workload.endswith(".jsonl"):
        path = Path(workload)
        if not path.is_file():
            return f"--workload {workload}: no such file; pass a rollout JSONL written by `seerctl rollout`"
    elif workload not in PAPER_WORKLOADS:
        return (f"--workload {workload!r}: unknown shape; choose one of {', '.join(sorted(PAPER_WORKLOADS))} "
                "or a rollout JSONL file")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        return f"--policies: unknown policy {unknown[0] if unknown else ''!r}; choose from {', '.join(sorted(POLICIES))}"
    if not (math.isfinite(scale) and 0.0 < scale <= 1.0):
        return f"--scale {scale:g}: must be in (0, 1]"
    if not (math.isfinite(icc) and 0.0 <= icc < 1.0):
        return f"--icc {icc:g}: the within-group correlation of log lengths must be in [0, 1)"
    if not (math.isfinite(log_sigma) and log_sigma > 0.0):
        return f"--log-sigma {log_sigma:g}: the standard deviation of log lengths must be > 0"
    if num_engines < 1:
        return f"--engines {num_engines}: need at least 1 engine"
    if kv_tokens < 1 or chunk_tokens < 1:
        return f"--kv-tokens {kv_tokens} / --chunk-tokens {chunk_tokens}: both must be >= 1"
    return None


def run_bench(workload: str, scale: float, policies: list[str], num_engines: int, cost: str, kv_tokens: int,
              chunk_tokens: int, seed: int, console: Console, *, icc: float = DEFAULT_ICC,
              log_sigma: float = DEFAULT_LOG_SIGMA) -> list[SimResult]:
    if workload.endswith(".jsonl"):
        trace = load_rollout_jsonl(workload)
    else:
        trace = paper_trace(workload, scale=scale, seed=seed, icc=icc, log_sigma=log_sigma)
    num_requests = sum(len(g.output_tokens) for g in trace.groups)
    shape = "" if workload.endswith(".jsonl") else f", icc {icc:g}, log sigma {log_sigma:g}"
    console.print(f"workload {workload} (scale {scale}{shape}): {len(trace.groups)} groups, {num_requests} requests; "
                  f"{num_engines} engines, cost model {cost}, KV {kv_tokens} tokens each, chunk {chunk_tokens}")
    results = []
    for policy in policies:
        config = SchedulerConfig(policy=policy, chunk_size_tokens=chunk_tokens)
        t0 = time.monotonic()
        results.append(simulate(trace, policy, num_engines, COSTS[cost](), kv_tokens, config, seed))
        console.print(f"  {policy}: simulated in {time.monotonic() - t0:.1f} s")
    return results


def results_table(results: list[SimResult]) -> Table:
    """One row per policy. Throughput ratios are against the first policy (the ``group``
    baseline by default) and, when it ran, against ``request`` (the per-sample
    least-requests baseline); tail change is against the first policy. "% of oracle" is
    against ``oracle`` (true lengths of every sample); when they ran, "% of oracle-full"
    against ``oracle-full`` (the same, admitting against the whole KV) and "% of
    oracle-group" against ``oracle-group`` (true lengths of every group only: what
    ``context`` learns)."""
    base = results[0]
    baselines = [base] + [r for r in results if r.policy == "request" and r is not base][:1]
    oracle = next((r for r in results if r.policy == "oracle"), None)
    bars = [("% of oracle", oracle)] + [(f"% of {name}", ran) for name in ("oracle-full", "oracle-group")
                                        if (ran := next((r for r in results if r.policy == name), None))]
    table = Table(title="simulated rollout, one iteration")
    for col in ("policy", "makespan s", "tok/s", *(f"vs {b.policy}" for b in baselines), "tail s", "tail change",
                "preemptions", "chunks", "migrations", "idle %", *(name for name, _ in bars)):
        table.add_column(col, justify="right")
    for r in results:
        idle = sum(r.engine_idle_pct) / max(1, len(r.engine_idle_pct))
        tail_change = f"{(r.tail_time_s / base.tail_time_s - 1) * 100:+.0f} %" if base.tail_time_s else "-"
        of_bars = [f"{r.throughput_tokens_per_s / bar.throughput_tokens_per_s * 100:.0f} %" if bar else "-"
                   for _, bar in bars]
        ratios = [f"{r.throughput_tokens_per_s / b.throughput_tokens_per_s:.2f}x" for b in baselines]
        table.add_row(r.policy, f"{r.makespan_s:.0f}", f"{r.throughput_tokens_per_s:.0f}", *ratios,
                      f"{r.tail_time_s:.0f}", tail_change, str(r.num_preemptions), str(r.num_chunks),
                      str(r.num_migrations), f"{idle:.1f}", *of_bars)
    return table


def run_sweep(scale: float, cost: str, kv_tokens: int, chunk_tokens: int, seed: int, console: Console) -> Table:
    """The robustness table: every (shape, icc, log sigma) of the sweep under ``divided``,
    ``context``, ``oracle-group`` (true group lengths: the bar for what ``context`` learns)
    and ``oracle``. ``scale`` shrinks each shape's own scale, its engine count
    and the KV per engine alike (so requests per engine and sequences per batch stay
    roughly those of the full shape)."""
    table = Table(title=f"sweep at scale {scale:g} (engines and KV scaled with it), cost model {cost}")
    for col in ("shape", "icc", "log sigma", *(f"{p} tok/s" for p in SWEEP_POLICIES), "context / divided",
                "context / oracle-group", "context / oracle", f"tail s {' / '.join(SWEEP_POLICIES)}", "preemptions"):
        table.add_column(col, justify="right")
    for name, engines, shape_scale in SWEEP_SHAPES:
        num_engines = max(1, round(engines * scale))
        for icc in SWEEP_ICC:
            for sigma in SWEEP_LOG_SIGMA:
                trace = paper_trace(name, scale=shape_scale * scale, seed=seed, icc=icc, log_sigma=sigma)
                kv = max(round(kv_tokens * scale), max(g.prompt_tokens + g.max_tokens for g in trace.groups) + 1)
                r = {p: simulate(trace, p, num_engines, COSTS[cost](), kv,
                                 SchedulerConfig(policy=p, chunk_size_tokens=max(1, round(chunk_tokens * scale))),
                                 seed) for p in SWEEP_POLICIES}
                tput = {p: x.throughput_tokens_per_s for p, x in r.items()}
                table.add_row(f"{name} ({num_engines})", f"{icc:g}", f"{sigma:g}",
                              *(f"{tput[p]:.0f}" for p in SWEEP_POLICIES),
                              f"{tput['context'] / tput['divided']:.3f}x",
                              f"{100 * tput['context'] / tput['oracle-group']:.1f} %",
                              f"{100 * tput['context'] / tput['oracle']:.1f} %",
                              " / ".join(f"{r[p].tail_time_s:.0f}" for p in SWEEP_POLICIES),
                              " / ".join(str(r[p].num_preemptions) for p in SWEEP_POLICIES))
                console.print(f"  {name} icc {icc:g} log sigma {sigma:g} done")
    return table
