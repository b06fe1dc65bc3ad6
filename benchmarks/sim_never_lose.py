"""Benchmark (simulated): does Seer's default policy ever lose to the baselines users run?

For each paper-shaped workload scaled to this machine (lengths scaled so the budget is
``--budget`` tokens, ``--groups`` groups), each KV budget per engine and each trace seed, it
simulates ``group`` (whole groups round-robin), ``request`` (per-sample least requests) and
``context`` (Seer's default) on 2 engines with the built-in ``cpu`` cost model (or ``--cost
gpu``), and prints every case's throughputs and ``context``'s ratio to the better baseline
of that case, then the minimum, the median and the cases below ``--floor``. Deterministic:
the same arguments print the same table.

    .venv/bin/python benchmarks/sim_never_lose.py                # ~30 s: 3 shapes x 3 KV x 3 seeds
    .venv/bin/python benchmarks/sim_never_lose.py --policies context,oracle --seeds 0
"""

from __future__ import annotations

import argparse
import statistics
import sys

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.simulator import simulate
from seer.sim.workloads import PAPER_WORKLOADS, generate_trace

BASELINES = ("group", "request")
KV_TOKENS_PER_GIB = 23_296  # SmolLM2-135M's float32 KV: 46 KB per token (vLLM's block count at 1 GiB)
COSTS = {"cpu": CostModel.cpu_smollm2, "gpu": CostModel.gpu_h800_like}


def cpu_trace(shape: str, budget: int, groups: int, seed: int):
    """A paper shape with every length (budget, mean, prompt) scaled so the budget is ``budget``."""
    w = PAPER_WORKLOADS[shape]
    scale = budget / w.max_tokens
    return generate_trace(shape, groups, w.group_size, budget, w.mean_tokens * scale,
                          max(1, round(w.prompt_tokens * scale)), 0.5, seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(PAPER_WORKLOADS))
    parser.add_argument("--kv-gib", default="0.3,1,2", help="KV per engine, GiB of SmolLM2 float32 KV")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=2048, help="max_tokens of the scaled traces")
    parser.add_argument("--groups", type=int, default=0, help="groups per trace (0: 16 for G = 8, 12 for G = 16)")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--cost", choices=tuple(COSTS), default="cpu")
    parser.add_argument("--policies", default="context", help="compared with the better baseline, each")
    parser.add_argument("--floor", type=float, default=0.99)
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in PAPER_WORKLOADS]:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(PAPER_WORKLOADS)}")
    try:
        kvs = [float(x) for x in args.kv_gib.split(",")]
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError as exc:
        parser.error(f"--kv-gib / --seeds: {exc}")
    policies = args.policies.split(",")
    cost = COSTS[args.cost]()
    print(f"{args.engines} engines, cost model {args.cost}, budget {args.budget} tokens, chunk "
          f"{SchedulerConfig().chunk_size_tokens}; ratio = the policy's throughput / the better baseline's")
    head = ["shape", "KV GiB", "seed", *(f"{p} tok/s" for p in (*BASELINES, *policies)),
            *(f"{p} ratio" for p in policies), "preemptions (request / " + "/".join(policies) + ")"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    for shape in shapes:
        groups = args.groups or (16 if PAPER_WORKLOADS[shape].group_size == 8 else 12)
        for gib in kvs:
            kv = int(gib * KV_TOKENS_PER_GIB)
            for seed in seeds:
                trace = cpu_trace(shape, args.budget, groups, seed)
                runs = {p: simulate(trace, p, args.engines, cost, kv, SchedulerConfig(policy=p))
                        for p in (*BASELINES, *policies)}
                best = max(runs[b].throughput_tokens_per_s for b in BASELINES)
                row = [shape, f"{gib:g}", str(seed), *(f"{runs[p].throughput_tokens_per_s:.1f}" for p in runs)]
                for p in policies:
                    ratios[p].append(runs[p].throughput_tokens_per_s / best)
                    row.append(f"{ratios[p][-1]:.3f}")
                row.append(" / ".join(str(runs[p].num_preemptions) for p in ("request", *policies)))
                print("| " + " | ".join(row) + " |", flush=True)
    for p, values in ratios.items():
        below = sum(v < args.floor for v in values)
        print(f"\n{p}: min {min(values):.3f}, median {statistics.median(values):.3f}, mean "
              f"{statistics.mean(values):.3f} of the better baseline; {below} of {len(values)} cases below {args.floor}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
