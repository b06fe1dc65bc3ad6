"""Benchmark: does the simulator predict the real engines? Fit, replay, compare.

Input: the ``--out`` file of ``benchmarks/rollout_policies.py`` (every run's policy,
wall time and every sample's length) and that run's daemon run dir, whose engine logs
carry the engines' own step records (``engine_steps`` events, engines/vllm_stats.py).

1. **Fit** the simulator's cost model (``seer.sim.engine_model.CostModel``) to the step
   records by least squares: the time from one engine step's output to the next is
   ``a + b*B + c*S + p*P`` for a batch of B running sequences holding S tokens of KV (the
   step's KV use x the engine's KV capacity) that prefilled P prompt tokens. Gaps longer
   than ``--max-step-s`` (an idle engine) are left out.
2. **Replay** the recorded lengths (seeded sampling makes them the same under every
   policy) in the simulator for every policy of the run, on as many engines with the
   engines' KV capacity and the daemon's scheduler settings.
3. **Compare** predicted with measured makespan and with the measured throughput ratio
   against ``group`` (medians over the repetitions), in one table; beside them, the ratio
   the same lengths give under the built-in ``gpu`` cost model (what this workload's
   schedule would be worth on GPU-shaped engines).

    .venv/bin/python benchmarks/sim_validation.py /tmp/policies.json

The fit uses only the step records, never the makespans it is then compared with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import msgspec
import numpy as np

from seer.config import load_config
from seer.sim.engine_model import CostModel
from seer.sim.simulator import Simulation, simulate
from seer.sim.workloads import Trace, TraceGroup


def load_steps(run_dir: Path) -> tuple[list[np.ndarray], int]:
    """Per engine, its step records as rows [t, B, kv_usage, generated, prefilled]; and
    the engines' KV capacity in tokens (the smallest reported)."""
    engines: list[np.ndarray] = []
    capacity = 0
    for log_file in sorted(run_dir.glob("engine-*.log")):
        rows: list[list[float]] = []
        for line in log_file.read_text().splitlines():
            if '"engine_steps"' not in line:
                continue
            event = json.loads(line)
            rows.extend(event["steps"])
            if event["kv_capacity_tokens"]:
                capacity = min(capacity or event["kv_capacity_tokens"], event["kv_capacity_tokens"])
        if rows:
            engines.append(np.array(sorted(rows), dtype=float))
    if not engines:
        raise SystemExit(f"{run_dir}: no engine_steps events in engine-*.log; run the benchmark with this "
                         "version of the engines (they log their step records)")
    return engines, capacity


def fit_cost_model(engines: list[np.ndarray], capacity: int, max_step_s: float) -> tuple[CostModel, dict]:
    """Least-squares a, b, c, p from consecutive step records of each engine."""
    features, seconds = [], []
    for rows in engines:
        dt = np.diff(rows[:, 0])
        cur = rows[1:]
        keep = (dt > 0) & (dt <= max_step_s) & (cur[:, 1] > 0)
        batch, context, prefilled = cur[keep, 1], cur[keep, 2] * capacity, cur[keep, 4]
        features.append(np.column_stack([np.ones_like(batch), batch, context, prefilled]))
        seconds.append(dt[keep])
    x, y = np.vstack(features), np.concatenate(seconds)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    predicted = x @ coef
    r2 = 1 - float(np.sum((y - predicted) ** 2) / np.sum((y - y.mean()) ** 2))
    a, b, c, p = (float(v) for v in coef)
    default = CostModel.cpu_smollm2()
    model = CostModel(a=a, b=b, c=c, p=p, pool_s_per_token=default.pool_s_per_token)
    return model, {"num_steps": int(len(y)), "r2": r2, "mean_step_s": float(y.mean()),
                   "mean_batch": float(x[:, 1].mean())}


def measured_breakdown(engines: list[np.ndarray], run: dict, capacity: int, cost: CostModel,
                       max_step_s: float) -> dict | None:
    """Where a real run's engine time went, from the step records inside its wall-clock
    window: engine steps, sequences per step, the fixed step cost ``a`` times the steps,
    the prefill ``p`` times the tokens recomputed, and the engines' idle time (makespan x
    engines - busy). None for a run recorded without its window."""
    if not run.get("started_at"):
        return None
    start, end = run["started_at"], run["ended_at"]
    steps = seqs = prefilled = 0
    busy = 0.0
    for rows in engines:
        inside = rows[(rows[:, 0] >= start) & (rows[:, 0] <= end)]
        if len(inside) < 2:
            continue
        dt = np.diff(inside[:, 0])
        busy += float(dt[dt <= max_step_s].sum())
        steps += len(inside)
        seqs += float(inside[:, 1].sum())
        prefilled += float(inside[:, 4].sum())
    makespan = end - start
    return {"makespan_s": makespan, "steps": steps, "batch": seqs / max(1, steps), "fixed_s": cost.a * steps,
            "prefill_s": cost.p * prefilled, "pool_s": None, "idle_s": makespan * len(engines) - busy}


def simulated_breakdown(sim: Simulation) -> dict:
    """The same quantities from a simulation's engine models."""
    e = sim.engines
    steps = sum(x.num_steps for x in e)
    makespan = max((r.finished_s or 0.0) for g in sim.rollout.groups for r in g.requests)
    cost = e[0].cost
    return {"makespan_s": makespan, "steps": steps, "batch": sum(x.num_seq_steps for x in e) / max(1, steps),
            "fixed_s": cost.a * steps, "prefill_s": cost.p * sum(x.num_prefill_tokens for x in e),
            "pool_s": cost.pool_s_per_token * sum(x.num_pool_tokens for x in e),
            "idle_s": sum(makespan - x.busy_s for x in e)}


def print_breakdown(rows: list[tuple[str, str, dict]]) -> None:
    print("\nWhere the time went (both engines; a·N: the fixed step cost over all steps, what concurrency "
          "saves; p·P: prefill recomputed; idle: engine time with nothing to run; measured rows are medians):")
    print("| policy | source | makespan s | engine steps | sequences per step | a·N s | p·P s | pool loads s | idle s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, source, b in rows:
        pool = "-" if b["pool_s"] is None else f"{b['pool_s']:.1f}"
        print(f"| {policy} | {source} | {b['makespan_s']:.1f} | {b['steps']:.0f} | {b['batch']:.1f} | "
              f"{b['fixed_s']:.1f} | {b['prefill_s']:.1f} | {pool} | {b['idle_s']:.1f} |")


def trace_of(run: dict, max_tokens: int) -> Trace:
    groups = tuple(TraceGroup(prompt_tokens=int(p), max_tokens=max_tokens, output_tokens=tuple(int(n) for n in lengths))
                   for p, lengths in zip(run["prompt_tokens"], run["lengths"]))
    return Trace(name="recorded", groups=groups)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the --out file of benchmarks/rollout_policies.py")
    parser.add_argument("--run-dir", type=Path, help="its daemon run dir (default: the one the file names)")
    parser.add_argument("--max-step-s", type=float, default=2.0, help="longer gaps between steps are idle time")
    args = parser.parse_args()
    data = json.loads(args.runs.read_text())
    runs, bench_args = data["runs"], data["args"]
    if "prompt_tokens" not in runs[0]:
        raise SystemExit(f"{args.runs}: no prompt_tokens per group; re-run benchmarks/rollout_policies.py (this version)")
    config = load_config(bench_args.get("config"))
    engines, capacity = load_steps(args.run_dir or Path(data["run_dir"]))
    cost, fit = fit_cost_model(engines, capacity, args.max_step_s)
    print(f"fit over {fit['num_steps']} engine steps (mean batch {fit['mean_batch']:.1f}, mean step "
          f"{fit['mean_step_s'] * 1000:.0f} ms): a = {cost.a:.4f} s, b = {cost.b:.2e} s/seq, c = {cost.c:.2e} s/token "
          f"of KV, p = {cost.p:.2e} s/prefilled token; R^2 = {fit['r2']:.3f}; KV capacity {capacity} tokens")
    default = CostModel.cpu_smollm2()
    print(f"(the built-in `cpu` model: a = {default.a}, b = {default.b}, c = {default.c}, p = {default.p})")

    policies = list(dict.fromkeys(r["policy"] for r in runs))
    trace = trace_of(runs[0], int(bench_args["max_tokens"]))
    measured = {p: statistics.median(r["wall_time_s"] for r in runs if r["policy"] == p) for p in policies}
    predicted, predicted_default, predicted_gpu = {}, {}, {}
    breakdown: list[tuple[str, str, dict]] = []
    num_engines = data.get("num_engines", config.engines.count)
    for policy in policies:
        scheduler = msgspec.structs.replace(config.scheduler, policy=policy)
        sim = Simulation(trace, policy, num_engines, cost, capacity, scheduler, bench_args.get("seed", 0), 256)
        predicted[policy] = sim.run().makespan_s
        parts = [measured_breakdown(engines, r, capacity, cost, args.max_step_s) for r in runs if r["policy"] == policy]
        parts = [b for b in parts if b is not None]
        if parts:
            breakdown.append((policy, "measured", {k: statistics.median(b[k] for b in parts) if k != "pool_s" else None
                                                   for k in parts[0]}))
        breakdown.append((policy, "simulated (fitted)", simulated_breakdown(sim)))
        for model, out in ((default, predicted_default), (CostModel.gpu_h800_like(), predicted_gpu)):
            result = simulate(trace, policy, num_engines, model, capacity, scheduler)
            out[policy] = result.makespan_s
    base = "group" if "group" in policies else policies[0]
    print(f"\n{trace.num_requests} samples, {trace.num_output_tokens} tokens; medians of "
          f"{len([r for r in runs if r['policy'] == base])} repetition(s); ratio = {base}'s makespan / the policy's")
    print("| policy | measured s | predicted s (fitted) | error | measured ratio | predicted ratio | error | "
          "predicted s (built-in cpu) | ratio under gpu model |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy in policies:
        m_ratio, p_ratio = measured[base] / measured[policy], predicted[base] / predicted[policy]
        print(f"| {policy} | {measured[policy]:.1f} | {predicted[policy]:.1f} | "
              f"{(predicted[policy] / measured[policy] - 1) * 100:+.1f} % | {m_ratio:.3f} | {p_ratio:.3f} | "
              f"{(p_ratio / m_ratio - 1) * 100:+.1f} % | {predicted_default[policy]:.1f} | "
              f"{predicted_gpu[base] / predicted_gpu[policy]:.3f} |")
    print_breakdown(breakdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
