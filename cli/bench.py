"""``seerctl bench``: several policies on the same simulated workload, side by side.

Runs the paper-scale simulator (``sim/simulator.py``: the real scheduler core, a
virtual clock, engine cost models) once per policy on one trace and prints one table:
throughput and its ratio to the first policy (the ``group`` baseline) and to ``request``
(the per-sample least-requests baseline) when it ran, tail time and its change, preemptions, migrations, mean engine idle %, and each policy's throughput as a
share of ``oracle``'s. Real-engine comparisons use ``benchmarks/rollout_policies.py``.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.simulator import SimResult, simulate
from seer.sim.workloads import load_rollout_jsonl, paper_trace

COSTS = {"gpu": CostModel.gpu_h800_like, "cpu": CostModel.cpu_smollm2}


def run_bench(workload: str, scale: float, policies: list[str], num_engines: int, cost: str, kv_tokens: int,
              chunk_tokens: int, seed: int, console: Console) -> list[SimResult]:
    if workload.endswith(".jsonl"):
        trace = load_rollout_jsonl(workload)
    else:
        trace = paper_trace(workload, scale=scale, seed=seed)
    num_requests = sum(len(g.output_tokens) for g in trace.groups)
    console.print(f"workload {workload} (scale {scale}): {len(trace.groups)} groups, {num_requests} requests; "
                  f"{num_engines} engines, cost model {cost}, KV {kv_tokens} tokens each, chunk {chunk_tokens}")
    results = []
    for policy in policies:
        config = SchedulerConfig(policy=policy, chunk_size_tokens=chunk_tokens)  # type: ignore[arg-type]
        t0 = time.monotonic()
        results.append(simulate(trace, policy, num_engines, COSTS[cost](), kv_tokens, config, seed))
        console.print(f"  {policy}: simulated in {time.monotonic() - t0:.1f} s")
    return results


def results_table(results: list[SimResult]) -> Table:
    """One row per policy. Throughput ratios are against the first policy (the ``group``
    baseline by default) and, when it ran, against ``request`` (the per-sample
    least-requests baseline); tail change is against the first policy."""
    base = results[0]
    baselines = [base] + [r for r in results if r.policy == "request" and r is not base][:1]
    oracle = next((r for r in results if r.policy == "oracle"), None)
    table = Table(title="simulated rollout, one iteration")
    for col in ("policy", "makespan s", "tok/s", *(f"vs {b.policy}" for b in baselines), "tail s", "tail change",
                "preemptions", "chunks", "migrations", "idle %", "% of oracle"):
        table.add_column(col, justify="right")
    for r in results:
        idle = sum(r.engine_idle_pct) / max(1, len(r.engine_idle_pct))
        tail_change = f"{(r.tail_time_s / base.tail_time_s - 1) * 100:+.0f} %" if base.tail_time_s else "-"
        of_oracle = f"{r.throughput_tokens_per_s / oracle.throughput_tokens_per_s * 100:.0f} %" if oracle else "-"
        ratios = [f"{r.throughput_tokens_per_s / b.throughput_tokens_per_s:.2f}x" for b in baselines]
        table.add_row(r.policy, f"{r.makespan_s:.0f}", f"{r.throughput_tokens_per_s:.0f}", *ratios,
                      f"{r.tail_time_s:.0f}", tail_change, str(r.num_preemptions), str(r.num_chunks),
                      str(r.num_migrations), f"{idle:.1f}", of_oracle)
    return table
