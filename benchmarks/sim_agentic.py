"""Benchmark: agentic (multi-turn) rollouts in the simulator, at this machine's scale and at
paper scale, with the baselines agentic RL uses today.

Runs the simulator's trajectories (``sim/agentic.py``: the real scheduler core, simulated
engines with an LRU prefix cache each, tool waits in virtual time) under each policy on
one agentic trace (``benchmarks/agentic_traces.py``'s format: per group, per sample, turns
``{"decode", "tool_s", "tool_tokens"}``), and prints one table per scale: makespan, sampled
tokens per second (tool waits included), its ratio against ``sticky`` (veRL's agent-loop
routing: a trajectory's later turns on its first engine) and ``request`` (least-requests
per turn) in the same setting, recomputed tokens (prefilled beyond what was new, as the
daemon counts them), prefilled and pool-loaded tokens, engine idle %, preemptions and
engine switches. Each scale runs Seer's policies with the host KV pool (every trajectory's
KV kept between turns, loaded at the pool's cost) and without it (only the engines' prefix
caches); the baselines never use the pool (``Policy.uses_kv_pool``) and run once.

* ``machine``: the trace as it is (contexts <= 4,096), 2 engines of 8,736 tokens of KV
  (``benchmarks/agentic.toml``), the measured CPU step cost, 32-token blocks, 512-token chunks, pool loads from 1 token.
* ``paper``: the same shape drawn larger (``--paper-groups`` x ``--paper-group-size``), every
  token count x ``--paper-token-scale`` (contexts up to 65,536), tool waits x
  ``--paper-tool-scale``, 16 engines of 1M tokens of KV, the assumed GPU step cost,
  16-token blocks, 8,192-token chunks.

    .venv/bin/python benchmarks/sim_agentic.py --shape swe
    .venv/bin/python benchmarks/sim_agentic.py --trace /tmp/swe.json --scales machine

``--validate RUNS.json`` compares instead: the ``--out`` file of ``benchmarks/rollout_policies.py
--replay TRACE.json`` (an agentic replay on the real engines) against the simulation of the
same trace, prompts, engines, KV capacity, pool and scheduler settings, with the step cost
fitted to that run's own engine step records (``sim_validation.py``), per policy:

    .venv/bin/python benchmarks/sim_agentic.py --validate /tmp/swe_runs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import msgspec

from seer.config import SchedulerConfig, load_config
from seer.controlplane.policies import POLICIES as REGISTERED
from seer.sim.agentic import AgenticResult, AgenticTrace, agentic_trace, alone_s, scale_trace, simulate_agentic
from seer.sim.engine_model import CostModel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts: agentic_traces, sim_validation

SHAPES = ("swe", "search")  # agentic_traces.SHAPES
POLICIES = "sticky,request,divided,context"
BASELINES = ("sticky", "request")
# "min_load": kv_pool.min_load_tokens (benchmarks/agentic.toml's at machine scale; a block at paper scale).
MACHINE = {"engines": 2, "cost": "cpu", "kv_tokens": 8736, "block": 32, "chunk": 512, "min_load": 1}
PAPER = {"engines": 16, "cost": "gpu", "kv_tokens": 1_000_000, "block": 16, "chunk": 8192, "min_load": 16}
COSTS = {"cpu": CostModel.cpu_smollm2, "gpu": CostModel.gpu_h800_like}


def run_setting(trace: AgenticTrace, policies: list[str], engines: int, cost: CostModel, kv_tokens: int, block: int,
                chunk: int, min_load: int, pool: bool, seed: int,
                baselines: dict[str, AgenticResult]) -> list[AgenticResult]:
    """Each policy's run with the pool ``pool``; a policy that never uses the pool (the
    baselines) runs once, its result kept in ``baselines`` for the other setting."""
    out = []
    for policy in policies:
        if policy in baselines:
            out.append(baselines[policy])
            continue
        t0 = time.monotonic()
        r = simulate_agentic(trace, policy, engines, cost, kv_tokens, SchedulerConfig(policy=policy,
                                                                                      chunk_size_tokens=chunk),
                             seed, pool=pool, block_tokens=block, min_load_tokens=min_load)
        print(f"  {policy} (pool {pool_label(policy, pool)}): simulated in {time.monotonic() - t0:.1f} s", flush=True)
        out.append(r)
        if not REGISTERED[policy].uses_kv_pool:
            baselines[policy] = r
    return out


def pool_label(policy: str, pool: bool) -> str:
    """'on' or 'off', or 'unused' for a policy that never uses the pool (``Policy.uses_kv_pool``)."""
    return "unused" if not REGISTERED[policy].uses_kv_pool else "on" if pool else "off"


def describe(trace: AgenticTrace) -> str:
    contexts = trace.context_tokens()
    tools = [t for s in trace.trajectories for t in s[:-1]]
    return (f"{trace.name}: {len(trace.trajectories)} trajectories, {trace.num_turns} turns, "
            f"{sum(t.decode for s in trace.trajectories for t in s)} decoded tokens, "
            f"{sum(t.tool_tokens for t in tools)} tool tokens (+{trace.template_tokens} template each), "
            f"{sum(t.tool_s for t in tools):.0f} tool s; context at the end: mean {statistics.fmean(contexts):.0f}, "
            f"max {max(contexts)} of {trace.max_context}; all together {sum(contexts)} tokens")


def print_table(results: list[tuple[bool, list[AgenticResult]]]) -> None:
    """One row per (pool, policy); ratios against the baselines (which never use the pool),
    each once."""
    head = ["pool", "policy", "makespan s", "sampled tok/s", "x sticky", "x request", "recomputed", "prefilled",
            "pool-loaded", "idle %", "preemptions", "engine switches", "turns as traced"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    printed = set()
    for pool, rows in results:
        base = {r.policy: r for r in rows}
        for r in rows:
            if r.policy in printed:
                continue  # a baseline: the same run in both settings
            if not REGISTERED[r.policy].uses_kv_pool:
                printed.add(r.policy)
            ratios = [f"{r.sampled_tok_per_s / base[b].sampled_tok_per_s:.2f}" if b in base else "-" for b in BASELINES]
            ok = "yes" if not r.off_trace and set(r.finish_reasons) <= {"stop", "length"} else \
                f"NO: {r.off_trace} off, {r.finish_reasons}"
            print(f"| {pool_label(r.policy, pool)} | {r.policy} | {r.makespan_s:.1f} | {r.sampled_tok_per_s:.1f} | {' | '.join(ratios)} | "
                  f"{r.recomputed_tokens} | {r.prefilled_tokens} | {r.pool_loaded_tokens} | "
                  f"{100 * r.engine_idle_frac:.1f} | {r.num_preemptions} | {r.engine_switches} | {ok} |")
    print("\nrecomputed: over every chunk, what it prefilled beyond what was new to it (the prompt; a turn's appended "
          "answer and last sampled token; a chunk's first token), as turns.recomputed_tokens counts it; a partly "
          "filled cache block counts. sampled tok/s: tokens the model sampled over the makespan (tool waits "
          "included). idle %: mean over engines of the makespan with nothing to run.")


def shape_trace(shape: str, groups: int, group_size: int, seed: int, max_context: int) -> AgenticTrace:
    import agentic_traces  # noqa: PLC0415 - the trace generator, a sibling script

    data = agentic_traces.generate(shape, groups, group_size, seed, max_context)
    return agentic_trace(data, name=f"{shape} {groups}x{group_size} seed {seed}")


def bench(args: argparse.Namespace) -> None:
    policies = args.policies.split(",")
    pools = {"both": (True, False), "on": (True,), "off": (False,)}[args.pool]
    if args.trace:
        data = json.loads(args.trace.read_text())
        small = agentic_trace(data, name=args.trace.name)
        shape = args.shape or data.get("shape")
    else:
        small = shape_trace(args.shape, args.groups, args.group_size, args.seed, args.max_context)
        shape = args.shape
    for scale in args.scales.split(","):
        if scale == "machine":
            trace, s = small, MACHINE
        elif scale == "paper":
            if shape not in SHAPES:
                raise SystemExit("--scales paper draws the trace's shape larger: give --shape (swe or search)")
            drawn = shape_trace(shape, args.paper_groups, args.paper_group_size, args.seed, args.max_context)
            trace, s = scale_trace(drawn, args.paper_token_scale, args.paper_tool_scale), PAPER
            s = {**s, "engines": args.paper_engines, "kv_tokens": args.paper_kv_tokens}
        else:
            raise SystemExit(f"--scales: machine or paper, got {scale!r}")
        print(f"\n## {scale}: {s['engines']} engines, {s['cost']} step cost, KV {s['kv_tokens']} tokens each, "
              f"{s['block']}-token blocks, chunk {s['chunk']}\n{describe(trace)}", flush=True)
        baselines: dict[str, AgenticResult] = {}
        results = [(pool, run_setting(trace, policies, s["engines"], COSTS[s["cost"]](), s["kv_tokens"], s["block"],
                                      s["chunk"], s["min_load"], pool, args.seed, baselines)) for pool in pools]
        print(f"\nthe longest trajectory alone (batch 1, its KV kept, its tool waits): "
              f"{alone_s(trace, COSTS[s['cost']]()):.1f} s: no policy's makespan can be shorter\n")
        print_table(results)


def validate(path: Path, kv_tokens: int | None) -> int:
    """Simulated vs measured makespan per policy of a real agentic replay's ``--out`` file."""
    import sim_validation  # noqa: PLC0415 - a sibling script: step-record reading and the cost fit

    data = json.loads(path.read_text())
    runs, bench_args = data["runs"], data["args"]
    if not runs or "sampled_tok_per_wall_s" not in runs[0]:
        raise SystemExit(f"{path}: not an agentic replay's --out file (benchmarks/rollout_policies.py --replay "
                         "TRACE.json with \"trajectories\")")
    config = load_config(bench_args.get("config"))
    trace_data = json.loads(Path(bench_args["replay"]).read_text())
    trace = agentic_trace(trace_data, name=Path(bench_args["replay"]).name, prompt_tokens=runs[0]["prompt_tokens"])
    trace = AgenticTrace(trace.name, trace.groups, int(bench_args.get("max_context") or trace.max_context),
                         trace.template_tokens)
    num_engines = int(data.get("num_engines", config.engines.count))
    prior = CostModel.cpu_smollm2()
    fitted, capacity, note = prior, kv_tokens, "no engine step records: the built-in cpu model"
    run_dir = Path(data.get("run_dir", ""))
    if run_dir.is_dir() and any(run_dir.glob("engine-*.log")):
        engines, capacity_seen = sim_validation.load_steps(run_dir)
        fitted, fit = sim_validation.fit_cost_model(engines, capacity_seen, 2.0)
        capacity = kv_tokens or capacity_seen
        note = (f"fitted to {fit['num_steps']} engine steps of the run (R^2 {fit['r2']:.3f}): a = {fitted.a:.4f}, "
                f"b = {fitted.b:.2e}, c = {fitted.c:.2e}, p = {fitted.p:.2e}")
    if not capacity:
        raise SystemExit(f"{path}: the engines' KV capacity is unknown (no engine logs in {run_dir}); pass --kv-tokens")
    pool, block = config.kv_pool.enabled, config.kv_pool.block_size
    print(f"{path}: {describe(trace)}\n{num_engines} engines, KV {capacity} tokens each, pool "
          f"{'on' if pool else 'off'} (loads of >= {config.kv_pool.min_load_tokens} tokens), {block}-token blocks; "
          f"step cost {note}")
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    head = ["policy", "measured s (min-max)", "simulated s (fitted)", "error", "simulated s (cpu prior)", "error",
            "measured x sticky (per rep)", "simulated x sticky", "measured recomputed", "simulated recomputed",
            "measured switches", "simulated switches"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    worst = 0.0
    simulated: dict[str, list[AgenticResult]] = {}
    for policy in policies:
        scheduler = msgspec.structs.replace(config.scheduler, policy=policy.split("+")[0])
        simulated[policy] = [simulate_agentic(trace, policy.split("+")[0], num_engines, cost, capacity, scheduler,
                                              bench_args.get("seed", 0), pool=pool, block_tokens=block,
                                              min_load_tokens=config.kv_pool.min_load_tokens)
                             for cost in (fitted, prior)]
    wall = {(r["policy"], r["rep"]): r["wall_time_s"] for r in runs}
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        walls = [r["wall_time_s"] for r in mine]
        measured = statistics.median(walls)
        sims = simulated[policy]
        errors = [x.makespan_s / measured - 1 for x in sims]
        worst = max(worst, abs(errors[0]))
        paired = [wall[("sticky", r["rep"])] / r["wall_time_s"] for r in mine if ("sticky", r["rep"]) in wall]
        sim_ratio = (f"{simulated['sticky'][0].makespan_s / sims[0].makespan_s:.2f}" if "sticky" in simulated else "-")
        print(f"| {policy} | {measured:.1f} ({min(walls):.1f}-{max(walls):.1f}) | {sims[0].makespan_s:.1f} | "
              f"{100 * errors[0]:+.1f} % | {sims[1].makespan_s:.1f} | {100 * errors[1]:+.1f} % | "
              f"{', '.join(f'{x:.2f}' for x in paired) or '-'} | {sim_ratio} | "
              f"{statistics.median(r['reprefilled_tokens'] for r in mine):.0f} | {sims[0].recomputed_tokens} | "
              f"{statistics.median(r['engine_switches'] for r in mine):.0f} | {sims[0].engine_switches} |")
    print(f"\nmeasured: median rollout wall time over {len(runs) // max(1, len(policies))} repetition(s); worst "
          f"error of the fitted simulation {100 * worst:.1f} % (goal: within 10 %). x sticky: sticky's makespan over "
          "the policy's (measured: paired by repetition)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, help="an agentic trace file (benchmarks/agentic_traces.py --out)")
    parser.add_argument("--shape", choices=SHAPES, help="generate the trace instead (and at paper scale)")
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-context", type=int, default=4096, help="of a generated trace, before scaling")
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--scales", default="machine,paper", help="machine, paper or both (comma-separated)")
    parser.add_argument("--pool", choices=("both", "on", "off"), default="both")
    parser.add_argument("--paper-engines", type=int, default=PAPER["engines"])
    parser.add_argument("--paper-kv-tokens", type=int, default=PAPER["kv_tokens"], help="KV per engine, tokens")
    parser.add_argument("--paper-groups", type=int, default=64)
    parser.add_argument("--paper-group-size", type=int, default=8)
    parser.add_argument("--paper-token-scale", type=float, default=16.0)
    parser.add_argument("--paper-tool-scale", type=float, default=10.0)
    parser.add_argument("--validate", type=Path, metavar="RUNS.json",
                        help="compare with a real agentic replay (benchmarks/rollout_policies.py --replay ... --out)")
    parser.add_argument("--kv-tokens", type=int, help="--validate: the engines' KV capacity when the run's logs are gone")
    args = parser.parse_args()
    if args.validate:
        return validate(args.validate, args.kv_tokens)
    if not args.trace and not args.shape:
        parser.error("give --trace FILE or --shape swe|search (or --validate RUNS.json)")
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
