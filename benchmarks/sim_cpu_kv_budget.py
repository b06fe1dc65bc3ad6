"""Benchmark (simulated): policies on 2 CPU-shaped engines as the KV budget shrinks.

Synthetic heavy-tailed groups shaped like the bundled model's 1024-token math rollouts
(mean 430 tokens, 70-token prompts, within-group correlation 0.3, log sigma 1.1), three
trace seeds, the built-in ``cpu`` cost model, 512-token chunks. For each KV budget it
prints every policy's throughput and vLLM-style preemptions per seed, and each policy's
ratio to ``group`` on the same trace. It shows where ``group`` starts to preempt, and
what avoiding preemption is worth when a step costs about the same whatever the batch.

    .venv/bin/python benchmarks/sim_cpu_kv_budget.py --groups 8
    .venv/bin/python benchmarks/sim_cpu_kv_budget.py --groups 32
"""

from __future__ import annotations

import argparse
import sys

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.simulator import simulate
from seer.sim.workloads import generate_trace

POLICIES = ("group", "request", "divided", "context", "oracle")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--kv-tokens", default="23296,15000,11648,8000",
                        help="KV capacity per engine, tokens (23,296 = 1 GiB of SmolLM2 float32 KV)")
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{args.groups} groups x G={args.group_size}, max_tokens 1024, 2 engines, cpu cost model, chunk 512; "
          "cells: tok/s / preemptions for each seed, then the median ratio to group")
    print("| KV tokens | " + " | ".join(POLICIES) + " |")
    print("|---|" + "---|" * len(POLICIES))
    for kv in (int(k) for k in args.kv_tokens.split(",")):
        results = {p: [] for p in POLICIES}
        for seed in seeds:
            trace = generate_trace("cpu-heavy-tail", args.groups, args.group_size, 1024, 430, 70, 0.3, seed,
                                   log_sigma=1.1)
            for policy in POLICIES:
                r = simulate(trace, policy, 2, CostModel.cpu_smollm2(), kv,
                             SchedulerConfig(policy=policy, chunk_size_tokens=512))
                results[policy].append((r.throughput_tokens_per_s, r.num_preemptions))
        cells = []
        for policy in POLICIES:
            ratios = sorted(t / g[0] for (t, _), g in zip(results[policy], results["group"]))
            runs = ", ".join(f"{t:.0f}/{n}" for t, n in results[policy])
            cells.append(f"{runs} (x{ratios[len(ratios) // 2]:.2f})")
        print(f"| {kv} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
