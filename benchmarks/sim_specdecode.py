"""The full simulated ablation, speculative decoding included: one table per workload.

Rows, each one simulated rollout of the same trace (``seer.sim.simulator`` with the real
scheduler core; speculation from ``seer.sim.specdecode``):

  group            the veRL baseline: whole groups, round-robin, no speculation
  + divided        divided rollout (chunks, global request buffer)
  + context        context-aware scheduling (probes first, longest predicted first)
  + SD vanilla     + speculative decoding drafting from the request's own text, fixed γ
  + grouped SD     drafts from the whole group (siblings ahead raise acceptance), fixed γ
  + adaptive γ     γ per row from the cost model (choose_draft_lengths, λ for probes)
  + multi-path     + multi-path drafts where they pay (the small-batch tail)

    .venv/bin/python benchmarks/sim_specdecode.py --workload moonlight --engines 32
    .venv/bin/python benchmarks/sim_specdecode.py --workload moonlight --engines 32 --profile paper

Acceptance profiles, the step-time model and the drafting cost are assumptions (see
``sim/specdecode.py`` and docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.specdecode import PROFILES, SimSpecConfig
from seer.sim.simulator import SimResult, simulate
from seer.sim.workloads import paper_trace


def variants(args: argparse.Namespace) -> list[tuple[str, str, SimSpecConfig | None]]:
    common = {"profile": args.profile, "gamma_max": args.gamma_max, "lam": args.lam}
    return [
        ("group", "group", None),
        ("+ divided", "divided", None),
        ("+ context", "context", None),
        (f"+ SD vanilla (self, γ={args.gamma})", "context",
         SimSpecConfig(mode="fixed", gamma=args.gamma, grouped=False, **common)),
        (f"+ grouped SD (γ={args.gamma})", "context", SimSpecConfig(mode="fixed", gamma=args.gamma, **common)),
        (f"+ adaptive γ (max {args.gamma_max}, λ={args.lam:g})", "context", SimSpecConfig(**common)),
        ("+ multi-path", "context", SimSpecConfig(multipath=True, **common)),
    ]


def run(args: argparse.Namespace, console: Console) -> list[tuple[str, SimResult, float]]:
    trace = paper_trace(args.workload, scale=args.scale, seed=args.seed)
    kv = round(args.kv_tokens * args.scale)
    console.print(f"workload {args.workload} (scale {args.scale}): {len(trace.groups)} groups, "
                  f"{trace.num_requests} requests, {trace.num_output_tokens} output tokens; {args.engines} engines, "
                  f"cost model gpu, KV {kv} tokens each, chunk {args.chunk_tokens}; acceptance {args.profile}")
    out = []
    for name, policy, spec in variants(args):
        if args.only and not any(word in name for word in args.only.split(",")):
            continue
        config = SchedulerConfig(policy=policy, chunk_size_tokens=args.chunk_tokens)  # type: ignore[arg-type]
        cpu = time.process_time()
        result = simulate(trace, policy, args.engines, CostModel.gpu_h800_like(), kv, config, args.seed, spec=spec)
        cpu = time.process_time() - cpu
        out.append((name, result, cpu))
        console.print(f"  {name}: {result.throughput_tokens_per_s:.0f} tok/s, tail {result.tail_time_s:.0f} s "
                      f"({cpu:.1f} CPU s)")
    return out


def table(results: list[tuple[str, SimResult, float]], title: str) -> Table:
    base = results[0][1]
    context = next((r for name, r, _ in results if name == "+ context"), base)
    t = Table(title=title)
    for col in ("variant", "tok/s", "vs group", "vs context", "tail s", "tokens / step", "drafts / step",
                "makespan s"):
        t.add_column(col, justify="right")
    for name, r, _ in results:
        t.add_row(name, f"{r.throughput_tokens_per_s:.0f}",
                  f"{r.throughput_tokens_per_s / base.throughput_tokens_per_s:.2f}x",
                  f"{r.throughput_tokens_per_s / context.throughput_tokens_per_s:.2f}x",
                  f"{r.tail_time_s:.0f}", f"{r.tokens_per_seq_step:.2f}", f"{r.drafts_per_seq_step:.2f}",
                  f"{r.makespan_s:.0f}")
    return t


def markdown(t: Table) -> str:
    """The same table as Markdown, for docs/benchmarks.md."""
    headers = [str(c.header) for c in t.columns]
    rows = list(zip(*[list(c.cells) for c in t.columns]))
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="moonlight")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--engines", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=1_000_000, help="KV per engine at scale 1 (scaled with it)")
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="study-same")
    parser.add_argument("--gamma", type=int, default=4, help="draft length of the fixed-γ rows")
    parser.add_argument("--gamma-max", type=int, default=8)
    parser.add_argument("--lam", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated words: run only the rows whose name has one")
    args = parser.parse_args()
    console = Console(width=160)
    results = run(args, console)
    t = table(results, f"{args.workload} (scale {args.scale}), {args.engines} engines, acceptance {args.profile}")
    console.print(t)
    console.print(markdown(t), markup=False, highlight=False, soft_wrap=True)


if __name__ == "__main__":
    main()
