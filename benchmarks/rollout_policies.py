"""Benchmark: the same seeded rollout under several policies, same daemon, same engines.

Starts one daemon (the embedded default config unless --config: two real vLLM engines),
warms it up, then runs the prompt file once per policy per repetition, *interleaved*
(A B C A B C ...) so that machine noise hits every policy alike. Prints one table: median
throughput and tail time per policy with their spread (min-max over repetitions), and the
ratio against each baseline (`group`, `request`) computed repetition by repetition (each
ratio pairs runs that sat next to each other in time), plus preemptions, chunks and
migrations. With a seed, schedule-invariant sampling makes every policy generate the same
samples; the table says whether they did (a digest of every sample's tokens).

    .venv/bin/python benchmarks/rollout_policies.py --config examples/heavy_tail.toml \
        --prompts examples/math_prompts.jsonl --limit 16 --group-size 8 --max-tokens 1024 \
        --policies group,request,context --reps 2 --plot /tmp/policies.png --out /tmp/policies.json

``--out`` keeps every run (and every sample's length, for replaying the same lengths in
the simulator); ``--plot`` draws throughput and tail bars with spread, then each
policy's per-engine timeline (its first run, from the daemon's log), as ``seerctl bench
--plot`` does for the simulator. ``--replot OUT_JSON`` redraws both from an earlier run.

The oracle policies (``oracle``, ``oracle-order``) run on the real engines too: they get
every sample's true length from the first run of the first repetition (seeded sampling is
schedule-invariant, so those are the lengths every later run generates; the samples
column checks it), or from ``--true-lengths`` (an earlier ``--out`` file). They run last in
each repetition.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from seer.cli.daemon import start_background, stop
from seer.cli.rollout import read_prompts
from seer.client import RolloutResult, SamplingParams, SeerClient
from seer.config import default_cache_dir, load_config

BASELINES = ("group", "request")
ORACLES = ("oracle", "oracle-order")
MIN_TAIL_S = 1.0  # tail ratios only against a baseline tail at least this long


def samples_digest(result: RolloutResult) -> str:
    """One hash of every sample's token ids, in (group, sample) order."""
    h = hashlib.blake2b(digest_size=8)
    for group in sorted(result.groups, key=lambda g: g.group_index):
        for sample in sorted(group.samples, key=lambda s: s.sample_index):
            h.update(repr((group.group_index, sample.sample_index, sample.token_ids)).encode())
    return h.hexdigest()


def run_record(policy: str, rep: int, result: RolloutResult, wall_s: float) -> dict:
    s = result.stats
    return {
        "policy": policy, "rep": rep, "rollout_id": result.rollout_id, "num_output_tokens": s.num_output_tokens, "wall_time_s": s.wall_time_s,
        "throughput_tokens_per_s": s.throughput_tokens_per_s, "tail_time_s": s.tail_time_s,
        "num_preemptions": s.num_preemptions, "num_chunks": s.num_chunks,
        "num_migrations": sum(len(x.engine_ids) - 1 for g in result.groups for x in g.samples),
        "per_engine_output_tokens": s.per_engine_output_tokens, "client_wall_s": wall_s,
        "digest": samples_digest(result),
        "lengths": [[len(x.token_ids) for x in sorted(g.samples, key=lambda x: x.sample_index)]
                    for g in sorted(result.groups, key=lambda g: g.group_index)],
        "prompt_tokens": [g.samples[0].num_prompt_tokens for g in sorted(result.groups, key=lambda g: g.group_index)],
    }


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def paired_ratios(runs: list[dict], policy: str, baseline: str, key: str) -> list[float]:
    by_rep = {(r["policy"], r["rep"]): r[key] for r in runs}
    reps = sorted({r["rep"] for r in runs})
    return [by_rep[(policy, k)] / by_rep[(baseline, k)] for k in reps
            if (policy, k) in by_rep and (baseline, k) in by_rep and by_rep[(baseline, k)] > 0]


def print_table(runs: list[dict], policies: list[str]) -> None:
    baselines = [b for b in BASELINES if b in policies]
    head = ["policy", "tok/s", *[f"x {b}" for b in baselines], "tail s", *[f"tail vs {b}" for b in baselines],
            "preemptions", "chunks", "migrations", "samples"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    digests = {r["digest"] for r in runs}
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        cells = [policy, spread([r["throughput_tokens_per_s"] for r in mine])]
        for b in baselines:
            ratios = paired_ratios(runs, policy, b, "throughput_tokens_per_s")
            cells.append(spread(ratios, "{:.2f}") if ratios else "-")
        cells.append(spread([r["tail_time_s"] for r in mine]))
        for b in baselines:
            # A tail under a second (every sample ending within a step or two) has no
            # meaningful ratio: "-" rather than thousands of percent.
            base_tails = [r["tail_time_s"] for r in runs if r["policy"] == b]
            ratios = paired_ratios(runs, policy, b, "tail_time_s") if min(base_tails, default=0) >= MIN_TAIL_S else []
            cells.append(spread([(x - 1) * 100 for x in ratios], "{:+.0f} %") if ratios else "-")
        cells += [str(sum(r["num_preemptions"] for r in mine)), spread([r["num_chunks"] for r in mine], "{:.0f}"),
                  spread([r["num_migrations"] for r in mine], "{:.0f}"),
                  "same" if len(digests) == 1 else ",".join(sorted({r["digest"][:6] for r in mine}))]
        print("| " + " | ".join(cells) + " |")


def plot(runs: list[dict], policies: list[str], path: Path, run_dir: Path | None = None) -> None:
    """Throughput and tail bars (median, min-max) per policy, then -- as ``seerctl bench
    --plot`` draws them for the simulator -- the per-engine timeline of each policy's
    first run, read from the daemon's log in ``run_dir`` (one bar per chunk, colour =
    group, a tick on each migration), on one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from seer.cli.plots import draw_timeline
    from seer.controlplane.trace import build_trace, read_log, summarize

    trace = build_trace(*read_log(run_dir)) if run_dir is not None and Path(run_dir).exists() else None
    if trace is not None and any("rollout_id" not in r for r in runs):
        # Files written before runs carried their rollout id: the log's rollouts after the warm-up, in order.
        ids = list(trace.rollouts)[1:]
        if len(ids) == len(runs):
            runs = [{**r, "rollout_id": i} for r, i in zip(runs, ids)]
    firsts = [next(r for r in runs if r["policy"] == p) for p in policies if any(r["policy"] == p for r in runs)]
    shown = [r for r in firsts if trace is not None and r.get("rollout_id") in trace.rollouts]
    fig = plt.figure(figsize=(12, 3.8 + 2.2 * len(shown)), layout="constrained")
    grid = fig.add_gridspec(1 + len(shown), 2, height_ratios=[3.8] + [2.2] * len(shown))
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])]
    first = None
    for k, run in enumerate(shown):
        summary = summarize(trace, [run["rollout_id"]])
        ax = fig.add_subplot(grid[1 + k, :], sharex=first)
        first = first or ax
        draw_timeline(ax, [s for s in trace.spans if s.rollout_id == run["rollout_id"]], origin_s=summary.start_s,
                      engine_ids=[e.engine_id for e in summary.engines],
                      title=f"{run['policy']} (repetition 1): {run['wall_time_s']:.0f} s, {summary.num_chunks} chunks, "
                            f"{run['num_preemptions']} preemptions (real engines; colour = group)")
    if first is not None:
        first.set_xlim(0, max(r["wall_time_s"] for r in shown) * 1.01)
    for ax, key, label in ((axes[0], "throughput_tokens_per_s", "output tokens/s"), (axes[1], "tail_time_s", "tail time, s")):
        meds, lows, highs = [], [], []
        for policy in policies:
            values = [r[key] for r in runs if r["policy"] == policy]
            med = statistics.median(values)
            meds.append(med)
            lows.append(med - min(values))
            highs.append(max(values) - med)
        ax.bar(policies, meds, yerr=[lows, highs], capsize=4, color="#4c72b0")
        ax.set_ylabel(label)
        ax.set_title(f"{label} (median, min–max)")
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="examples/math_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="group,request,divided,context")
    parser.add_argument("--reps", type=int, default=1, help="interleaved repetitions of the whole policy list")
    parser.add_argument("--config")
    parser.add_argument("--out", type=Path, help="write every run (with sample lengths) as JSON")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--true-lengths", type=Path,
                        help="an earlier --out file of the same prompts, group size, max_tokens and seed: the oracle's lengths")
    parser.add_argument("--replot", type=Path, metavar="OUT_JSON",
                        help="run nothing: print the table of an earlier --out file and draw --plot from it "
                             "(with timelines while its daemon's logs are still in its run dir)")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        runs = saved["runs"]
        policies = list(dict.fromkeys(r["policy"] for r in runs))
        print_table(runs, policies)
        if args.plot:
            plot(runs, policies, args.plot, Path(saved["run_dir"]))
        return 0
    config = load_config(args.config)
    policies = args.policies.split(",")
    # Oracles last: in the first repetition they need the lengths an earlier run recorded.
    policies = [p for p in policies if p not in ORACLES] + [p for p in policies if p in ORACLES]
    if policies[0] in ORACLES and args.true_lengths is None:
        parser.error("the oracle policies need a non-oracle policy in --policies (to record the true lengths) "
                     "or --true-lengths FILE")
    true_lengths = json.loads(args.true_lengths.read_text())["runs"][0]["lengths"] if args.true_lengths else None
    prompts, _ = read_prompts(Path(args.prompts))
    prompts = prompts[: args.limit]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="seer-bench-"))
    info = start_background(args.config, run_dir, default_cache_dir(), config.engines.startup_timeout_s + 60)
    runs: list[dict] = []
    try:
        with SeerClient(info["client_address"], timeout_s=600) as client:
            client.rollout(prompts[:2], 2, SamplingParams(max_tokens=16))  # warm-up
            for rep in range(args.reps):
                for policy in policies:
                    t0 = time.monotonic()
                    result = client.rollout(prompts, args.group_size, sampling, policy=policy,
                                            true_lengths=true_lengths if policy in ORACLES else None)
                    runs.append(run_record(policy, rep, result, time.monotonic() - t0))
                    if true_lengths is None:
                        true_lengths = runs[-1]["lengths"]
                    r = runs[-1]
                    print(f"rep {rep} {policy}: {r['num_output_tokens']} tokens, {r['throughput_tokens_per_s']:.1f} "
                          f"tok/s, tail {r['tail_time_s']:.1f} s, {r['num_preemptions']} preemptions", flush=True)
    finally:
        stop(run_dir, 60)
    print(f"\n{len(prompts)} prompts x G={args.group_size}, max_tokens {args.max_tokens}, temperature "
          f"{args.temperature}, seed {args.seed}; {args.reps} interleaved repetition(s); engines: "
          f"{config.engines.count} x {config.engines.backend} ({config.model.dtype}, {config.engines.kv_cache_gib} GiB KV); "
          f"chunk {config.scheduler.chunk_size_tokens} tokens; logs in {run_dir}")
    print_table(runs, policies)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out), "plot": str(args.plot),
                                                              "true_lengths": str(args.true_lengths)},
                                        "run_dir": str(run_dir), "chunk_size_tokens": config.scheduler.chunk_size_tokens,
                                        "num_engines": config.engines.count, "runs": runs}, indent=1))
        print(f"runs: {args.out}")
    if args.plot:
        plot(runs, policies, args.plot, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
