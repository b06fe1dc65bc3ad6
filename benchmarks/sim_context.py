"""Simulated studies of context-aware scheduling (``seerctl bench`` machinery, one table each).

* ``--study icc``: how ``context`` fares against ``divided`` and ``oracle`` as the
  within-group correlation of lengths (intra-class correlation of log lengths) grows.
* ``--study prior``: two RL iterations of the same prompts (group effects persist with
  correlation ``--persistence``, samples re-drawn); ``context`` with and without the
  cross-iteration length prior learned in iteration 0.

    .venv/bin/python benchmarks/sim_context.py --study icc --workload qwen2-vl-72b --engines 16 --icc 0.5,0.8,0.95
    .venv/bin/python benchmarks/sim_context.py --study prior --workload qwen2-vl-72b --engines 16 --persistence 0.8
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.simulator import simulate, simulate_iterations
from seer.sim.workloads import paper_iterations, paper_trace


def config(policy: str, chunk: int) -> SchedulerConfig:
    return SchedulerConfig(policy=policy, chunk_size_tokens=chunk)  # type: ignore[arg-type]


def icc_study(args: argparse.Namespace, console: Console) -> None:
    table = Table(title=f"{args.workload} (scale {args.scale}), {args.engines} engines: context vs within-group correlation")
    for col in ("icc", "divided tok/s", "context tok/s", "oracle tok/s", "context / divided", "context / oracle",
                "tail s divided / context / oracle"):
        table.add_column(col, justify="right")
    for icc in (float(x) for x in args.icc.split(",")):
        trace = paper_trace(args.workload, scale=args.scale, icc=icc, seed=args.seed)
        kv = round(args.kv_tokens * args.scale)
        r = {p: simulate(trace, p, args.engines, CostModel.gpu_h800_like(), kv, config(p, args.chunk_tokens), args.seed)
             for p in ("divided", "context", "oracle")}
        tput = {p: x.throughput_tokens_per_s for p, x in r.items()}
        table.add_row(f"{icc:g}", *(f"{tput[p]:.0f}" for p in ("divided", "context", "oracle")),
                      f"{tput['context'] / tput['divided']:.2f}x", f"{100 * tput['context'] / tput['oracle']:.0f} %",
                      " / ".join(f"{r[p].tail_time_s:.0f}" for p in ("divided", "context", "oracle")))
        console.print(f"  icc {icc:g} done")
    console.print(table)


def prior_study(args: argparse.Namespace, console: Console) -> None:
    traces = paper_iterations(args.workload, 2, persistence=args.persistence, scale=args.scale, seed=args.seed)
    kv = round(args.kv_tokens * args.scale)
    table = Table(title=f"{args.workload} (scale {args.scale}), {args.engines} engines, two iterations, "
                        f"persistence {args.persistence:g}")
    for col in ("policy", "iteration 0 tok/s", "iteration 1 tok/s", "iteration 1 tail s"):
        table.add_column(col, justify="right")
    for policy, prior in (("divided", False), ("context", False), ("context", True), ("oracle", False)):
        results = simulate_iterations(traces, policy, args.engines, CostModel.gpu_h800_like(), kv,
                                      config(policy, args.chunk_tokens), args.seed, length_prior=prior)
        table.add_row(policy + (" + prior" if prior else ""), *(f"{r.throughput_tokens_per_s:.0f}" for r in results),
                      f"{results[1].tail_time_s:.0f}")
        console.print(f"  {policy}{' + prior' if prior else ''} done")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", choices=["icc", "prior"], required=True)
    parser.add_argument("--workload", default="qwen2-vl-72b")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=1_000_000, help="KV per engine at scale 1 (scaled with it)")
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--icc", default="0.5,0.8,0.95")
    parser.add_argument("--persistence", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console(width=160)
    (icc_study if args.study == "icc" else prior_study)(args, console)


if __name__ == "__main__":
    main()
