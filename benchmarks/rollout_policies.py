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

Speculative decoding on the same engines: ``--speculative grouped`` starts the engines
with ``[speculative] method = "grouped"`` (adaptive, ``--gamma-max`` drafts at most; the
rest of the config as given), and a policy spelled ``<policy>+sd`` in ``--policies``
(``context+sd``) runs that policy with drafting on. Every other entry runs with
``speculative=False``: its samples get no drafts and sample exactly as on engines without
SD, so they stay schedule-invariant and their "samples" column must read "same". SD is
excluded from schedule invariance (a speculative step draws a varying amount of random
numbers, and grouped drafts depend on what the group's other samples have written so
far), so a ``+sd`` run's samples differ from the others': its column says so, and the
oracles never take their lengths from it.

    .venv/bin/python benchmarks/rollout_policies.py --config examples/heavy_tail.toml \
        --speculative grouped --policies group,divided,context,context+sd --reps 3 ...

Trace replay: ``--replay TRACE.json`` makes every sample decode exactly a trace's length
(the engines ignore EOS and stop there), so real engines run a workload of known shape with
real text. TRACE.json is ``{"max_tokens": N, "prompt_tokens": P (optional, ignored: the
prompts are --prompts'), "lengths": [[len, ...], ...]}``, one row of G lengths per group;
other keys are ignored. The i-th prompt of --prompts gets the i-th group; G and max_tokens
come from the trace. ``--replay SHAPE:key=value:...`` generates such a trace from the
simulator's paper-shaped workloads (sim/workloads.py) scaled to this machine, e.g.
``--replay moonlight:scale=0.03125:groups=12`` (keys: scale, groups, seed, icc, log_sigma);
``--out`` then records it (``replay``) so the simulator can replay the same lengths. No
policy is told the lengths, except the oracles (they take them as their true lengths).

    .venv/bin/python benchmarks/rollout_policies.py --replay moonlight:scale=0.03125:groups=12 \
        --policies group,request,context --reps 2 --out /tmp/replay.json

Agentic replay: a TRACE.json with ``"trajectories"`` (``benchmarks/agentic_traces.py``: per
group, per sample, a list of turns ``{"decode", "tool_s", "tool_tokens"}``) instead of
``"lengths"`` runs multi-turn trajectories. The i-th prompt gets the i-th group; turn k of
a sample decodes exactly its ``decode`` tokens (``replay_turns``, EOS ignored), then its
environment sleeps ``tool_s`` and answers with ``tool_tokens`` tokens of real text (slices
of the repo's docs under the model's tokenizer, the same in every run); the last turn is
the end (the environment says done). ``sampling.max_tokens`` is the largest decode;
``TrajectorySpec(max_turns=the most turns, max_total_tokens=--max-context,
tool_timeout_s=120)``; no tool parser. The table then gives per policy the wall time,
sampled tokens (loss mask 1) per second of wall time (tool waits included), re-prefilled
tokens (context computed again although an engine had computed it before; defined under
the table), prefilled and reused tokens, preemptions and engine switches, with ratios
against ``sticky`` and ``request`` (veRL's agent loop routing and least-requests) paired by
repetition, and whether every run's trajectories were token-identical (token ids and
loss mask of every sample).

    .venv/bin/python benchmarks/agentic_traces.py --shape swe --groups 6 --group-size 2 --out /tmp/swe.json
    .venv/bin/python benchmarks/rollout_policies.py --config benchmarks/agentic.toml --replay /tmp/swe.json \
        --limit 6 --group-size 2 --policies context,sticky,request --reps 2 --seed 0 --out /tmp/swe_runs.json
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

import msgspec

from seer.cli.daemon import start_background, stop
from seer.cli.ray_actor import config_toml
from seer.cli.rollout import read_prompts
from seer.client import RolloutResult, SamplingParams, SeerClient
from seer.config import SeerConfig, SpeculativeConfig, default_cache_dir, load_config
from seer.sim.workloads import PAPER_WORKLOADS, generate_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agentic_traces as agentic  # noqa: E402 - a sibling script: the agentic replay's trace, environment and table
from agentic_traces import paired_ratios, spread  # noqa: E402 - the tables' cells, one copy for both tables

BASELINES = ("group", "request")
ORACLES = ("oracle", "oracle-order")
MIN_TAIL_S = 1.0  # tail ratios only against a baseline tail at least this long
SD_SUFFIX = "+sd"  # `context+sd`: the policy with speculative drafting on


def split_policy(label: str) -> tuple[str, bool]:
    """A --policies entry as (daemon policy, drafting on): ``context+sd`` -> (``context``, True)."""
    if label.endswith(SD_SUFFIX):
        return label.removesuffix(SD_SUFFIX), True
    return label, False


def check_policies(labels: list[str], speculative: str, has_true_lengths: bool) -> str | None:
    """What is wrong with the --policies list for this --speculative (one line), or None."""
    drafting = [label for label in labels if split_policy(label)[1]]
    if drafting and speculative != "grouped":
        return (f"{drafting[0]} runs with speculative decoding: add --speculative grouped (the engines must "
                "draft), or drop the +sd suffix")
    for label in drafting:
        if split_policy(label)[0] in ORACLES:
            return (f"{label}: the oracles need every sample's true length, and speculative samples are not "
                    "schedule-invariant; run the oracle without +sd")
    recorders = [label for label in labels if label not in ORACLES and not split_policy(label)[1]]
    if any(label in ORACLES for label in labels) and not recorders and not has_true_lengths:
        return ("the oracle policies need a policy without +sd in --policies (to record the true lengths) "
                "or --true-lengths FILE")
    return None


REPLAY_KEYS = {"scale": float, "groups": int, "seed": int, "icc": float, "log_sigma": float}


def load_replay(spec: str) -> dict:
    """The trace a ``--replay`` argument names: ``{"max_tokens", "lengths", "source"}``.
    A JSON file, or ``SHAPE:key=value:...`` generated from a paper-shaped workload.
    ValueError (one line: what is wrong and how to fix it) for anything else."""
    shape, *options = spec.split(":")
    if shape in PAPER_WORKLOADS:
        params: dict = {"scale": 2048 / PAPER_WORKLOADS[shape].max_tokens, "groups": 12, "seed": 0, "icc": 0.5,
                        "log_sigma": 1.0}
        for option in options:
            key, _, value = option.partition("=")
            if key not in REPLAY_KEYS or not value:
                raise ValueError(f"--replay {spec}: {option!r} is not key=value with key one of "
                                 f"{', '.join(REPLAY_KEYS)}")
            try:
                params[key] = REPLAY_KEYS[key](value)
            except ValueError:
                raise ValueError(f"--replay {spec}: {key}={value!r} is not a {REPLAY_KEYS[key].__name__}") from None
        w = PAPER_WORKLOADS[shape]
        if not 0 < params["scale"] <= 1 or params["groups"] < 1:
            raise ValueError(f"--replay {spec}: scale must be in (0, 1] and groups >= 1")
        max_tokens = max(2, round(w.max_tokens * params["scale"]))
        trace = generate_trace(shape, params["groups"], w.group_size, max_tokens,
                               min(max_tokens - 1, max(1.0, w.mean_tokens * params["scale"])),
                               max(1, round(w.prompt_tokens * params["scale"])), params["icc"], params["seed"],
                               log_sigma=params["log_sigma"])
        return {"max_tokens": max_tokens, "lengths": [list(g.output_tokens) for g in trace.groups],
                "source": {"shape": shape, **params}}
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--replay {spec}: not a file, nor a shape ({', '.join(PAPER_WORKLOADS)}) "
                         "followed by :key=value options")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--replay {spec}: not a readable JSON file ({exc})") from None
    if isinstance(data, dict) and "trajectories" in data:  # an agentic trace (benchmarks/agentic_traces.py)
        return {**agentic.load_agentic_trace(path), "agentic": True}
    if not isinstance(data, dict) or "lengths" not in data or "max_tokens" not in data:
        raise ValueError(f"--replay {spec}: needs an object with \"max_tokens\" and \"lengths\" "
                         "(one list of G lengths per group), or \"trajectories\" (an agentic trace)")
    max_tokens, lengths = data["max_tokens"], data["lengths"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"--replay {spec}: max_tokens must be a positive integer, got {max_tokens!r}")
    if (not isinstance(lengths, list) or not lengths
            or not all(isinstance(row, list) and row for row in lengths)):
        raise ValueError(f"--replay {spec}: lengths must be a non-empty list of non-empty lists (one per group)")
    if len({len(row) for row in lengths}) != 1:
        raise ValueError(f"--replay {spec}: every group needs the same number of lengths (the group size); "
                         f"found {sorted({len(row) for row in lengths})}")
    for i, row in enumerate(lengths):
        for j, n in enumerate(row):
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_tokens:
                raise ValueError(f"--replay {spec}: lengths[{i}][{j}] is {n!r}, not an integer in 1..max_tokens "
                                 f"({max_tokens})")
    return {"max_tokens": max_tokens, "lengths": lengths, "source": {"file": str(path)}}


def bench_config(config: SeerConfig, speculative: str, gamma_max: int) -> SeerConfig:
    """The daemon's config: ``config`` with grouped speculative decoding when asked for.
    ``gamma_max`` is checked against ``[speculative]``'s own bounds either way
    (msgspec.ValidationError)."""
    spec = msgspec.convert({"method": "grouped", "gamma_max": gamma_max, "adaptive": True}, SpeculativeConfig)
    return config if speculative != "grouped" else msgspec.structs.replace(config, speculative=spec)


def samples_digest(result: RolloutResult) -> str:
    """One hash of every sample's token ids, in (group, sample) order."""
    h = hashlib.blake2b(digest_size=8)
    for group in sorted(result.groups, key=lambda g: g.group_index):
        for sample in sorted(group.samples, key=lambda s: s.sample_index):
            h.update(repr((group.group_index, sample.sample_index, sample.token_ids)).encode())
    return h.hexdigest()


def run_record(policy: str, rep: int, result: RolloutResult, wall_s: float, started_at: float = 0.0) -> dict:
    s = result.stats
    return {
        # Wall-clock window of the run (time.time(), as the engines' step records): which
        # steps were this run's (benchmarks/sim_validation.py, "where the time went").
        "started_at": started_at, "ended_at": started_at + wall_s,
        "policy": policy, "speculative": split_policy(policy)[1], "rep": rep, "rollout_id": result.rollout_id, "num_output_tokens": s.num_output_tokens, "wall_time_s": s.wall_time_s,
        "throughput_tokens_per_s": s.throughput_tokens_per_s, "tail_time_s": s.tail_time_s,
        "num_preemptions": s.num_preemptions, "num_chunks": s.num_chunks,
        "num_migrations": sum(len(x.engine_ids) - 1 for g in result.groups for x in g.samples),
        "per_engine_output_tokens": s.per_engine_output_tokens, "client_wall_s": wall_s,
        "digest": samples_digest(result),
        "lengths": [[len(x.token_ids) for x in sorted(g.samples, key=lambda x: x.sample_index)]
                    for g in sorted(result.groups, key=lambda g: g.group_index)],
        "prompt_tokens": [g.samples[0].num_prompt_tokens for g in sorted(result.groups, key=lambda g: g.group_index)],
    }


def print_table(runs: list[dict], policies: list[str]) -> None:
    baselines = [b for b in BASELINES if b in policies]
    head = ["policy", "tok/s", *[f"x {b}" for b in baselines], "tail s", *[f"tail vs {b}" for b in baselines],
            "preemptions", "chunks", "migrations", "samples"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    # Schedule invariance is checked across the runs without drafts only (SD is excluded).
    digests = {r["digest"] for r in runs if not split_policy(r["policy"])[1]}
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
                  samples_cell(mine, digests)]
        print("| " + " | ".join(cells) + " |")


def samples_cell(mine: list[dict], digests: set[str]) -> str:
    """The "samples" column: "same" when every run without drafts generated the same
    samples; a speculative policy's runs are not compared ("SD: differs" or, by chance,
    "SD: same")."""
    own = sorted({r["digest"][:6] for r in mine})
    if mine and split_policy(mine[0]["policy"])[1]:
        return "SD: same" if {r["digest"] for r in mine} <= digests and len(digests) == 1 else "SD: differs"
    return "same" if len(digests) == 1 else ",".join(own)


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


def agentic_rollout(client: SeerClient, run: dict, prompts: list, group_size: int, sampling: SamplingParams,
                    policy: str, name: str, rep: int, speculative: bool) -> dict:
    """One run of an agentic replay: its record (``run_record`` plus ``agentic.run_metrics``)."""
    t0, started_at = time.monotonic(), time.time()
    result = client.rollout(prompts, group_size, sampling, policy=name, speculative=speculative, env=run["env"],
                            trajectory=run["spec"], tool_parser=None, replay_turns=run["turns"], timeout_s=7200)
    wall = time.monotonic() - t0
    r = run_record(policy, rep, result, wall, started_at) | agentic.run_metrics(result, run["trace"])
    r["sampled_tok_per_wall_s"] = r["sampled_tokens"] / wall
    print(f"rep {rep} {policy}: {wall:.1f} s, {r['sampled_tokens']} sampled tokens, "
          f"{r['sampled_tok_per_wall_s']:.1f} tok/s, re-prefilled {r['reprefilled_tokens']} "
          f"(daemon: {r['daemon_recomputed_tokens']}), prefilled "
          f"{r['prefilled_tokens']}, reused {r['reused_tokens']}, {r['num_preemptions']} preemptions, "
          f"{r['engine_switches']} engine switches, finish {r['finish_reasons']}, digest {r['digest'][:6]}", flush=True)
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="examples/math_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="group,request,divided,context",
                        help="comma-separated; <policy>+sd (e.g. context+sd) runs it with speculative drafting, "
                             "which needs --speculative grouped")
    parser.add_argument("--reps", type=int, default=1, help="interleaved repetitions of the whole policy list")
    parser.add_argument("--config")
    parser.add_argument("--speculative", choices=("off", "grouped"), default="off",
                        help="grouped: engines run grouped speculative decoding ([speculative] method = "
                             "\"grouped\", adaptive); only +sd policies draft. off: the config's [speculative] as is")
    parser.add_argument("--gamma-max", type=int, default=4, help="with --speculative grouped: the most drafts per step")
    parser.add_argument("--out", type=Path, help="write every run (with sample lengths) as JSON")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--true-lengths", type=Path,
                        help="an earlier --out file of the same prompts, group size, max_tokens and seed: the oracle's lengths")
    parser.add_argument("--replay", metavar="TRACE.json|SHAPE:key=value:...",
                        help="every sample decodes exactly a trace's length (EOS ignored): a JSON trace, or a "
                             "paper shape scaled to this machine, e.g. moonlight:scale=0.03125:groups=12")
    parser.add_argument("--max-context", type=int, default=4096,
                        help="agentic replay: TrajectorySpec.max_total_tokens (prompt + every token after it)")
    parser.add_argument("--replot", type=Path, metavar="OUT_JSON",
                        help="run nothing: print the table of an earlier --out file and draw --plot from it "
                             "(with timelines while its daemon's logs are still in its run dir)")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        runs = saved["runs"]
        policies = list(dict.fromkeys(r["policy"] for r in runs))
        if runs and "sampled_tok_per_wall_s" in runs[0]:
            agentic.print_agentic_table(runs, policies)
            return 0
        print_table(runs, policies)
        if args.plot:
            plot(runs, policies, args.plot, Path(saved["run_dir"]))
        return 0
    policies = args.policies.split(",")
    replay = None
    if args.replay:
        try:
            replay = load_replay(args.replay)
        except ValueError as exc:
            parser.error(str(exc))
        if args.true_lengths:
            parser.error("--replay gives the oracles their true lengths (the trace's); drop --true-lengths")
    if (problem := check_policies(policies, args.speculative,
                                  args.true_lengths is not None or replay is not None)) is not None:
        parser.error(problem)
    # Oracles last: in the first repetition they need the lengths an earlier run recorded.
    policies = [p for p in policies if p not in ORACLES] + [p for p in policies if p in ORACLES]
    try:
        config = bench_config(load_config(args.config), args.speculative, args.gamma_max)
    except msgspec.ValidationError as exc:
        parser.error(f"--gamma-max {args.gamma_max}: {exc} (speculative.gamma_max)")
    # On grouped-SD engines every run without +sd asks for no drafts; on others the
    # default (True) is the same thing, or all the daemon can do (vLLM's own drafters).
    grouped = config.speculative.method == "grouped"
    true_lengths = json.loads(args.true_lengths.read_text())["runs"][0]["lengths"] if args.true_lengths else None
    prompts, _ = read_prompts(Path(args.prompts))
    prompts = prompts[: args.limit]
    agentic_run = None
    if replay is not None and replay.get("agentic"):
        agentic_run = agentic.replay_setup(parser, args, config, replay, prompts, policies, ORACLES)
        prompts = prompts[:len(replay["trajectories"])]
    elif replay is not None:
        groups = len(replay["lengths"])
        if groups > len(prompts):
            parser.error(f"--replay has {groups} groups and --prompts {args.prompts} gives {len(prompts)} prompts "
                         f"(--limit {args.limit}); use a prompt file with at least {groups} prompts or a smaller trace")
        if replay["max_tokens"] >= config.model.max_model_len:
            parser.error(f"--replay max_tokens {replay['max_tokens']} leaves no room for a prompt within "
                         f"model.max_model_len {config.model.max_model_len}; raise it in --config")
        prompts = prompts[:groups]
        args.group_size, args.max_tokens = len(replay["lengths"][0]), replay["max_tokens"]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="seer-bench-"))
    config_path = args.config
    if args.speculative == "grouped":
        # load_config made the config's relative paths absolute: the copy works from the run dir.
        config_path = run_dir / "bench.toml"
        config_path.write_text(config_toml(msgspec.to_builtins(config)))
    info = start_background(config_path, run_dir, default_cache_dir(), config.engines.startup_timeout_s + 60)
    runs: list[dict] = []
    try:
        with SeerClient(info["client_address"], timeout_s=600) as client:
            client.rollout(prompts[:2], 2, SamplingParams(max_tokens=16))  # warm-up
            for rep in range(args.reps):
                for policy in policies:
                    name, drafting = split_policy(policy)
                    t0, started_at = time.monotonic(), time.time()
                    if agentic_run is not None:
                        runs.append(agentic_rollout(client, agentic_run, prompts, args.group_size, sampling, policy,
                                                    name, rep, speculative=drafting or not grouped))
                        continue
                    result = client.rollout(prompts, args.group_size, sampling, policy=name,
                                            true_lengths=true_lengths if policy in ORACLES and replay is None else None,
                                            speculative=drafting or not grouped,
                                            replay_lengths=None if replay is None else replay["lengths"])
                    runs.append(run_record(policy, rep, result, time.monotonic() - t0, started_at))
                    if true_lengths is None and not drafting:  # speculative samples are not the truth
                        true_lengths = runs[-1]["lengths"]
                    r = runs[-1]
                    print(f"rep {rep} {policy}: {r['num_output_tokens']} tokens, {r['throughput_tokens_per_s']:.1f} "
                          f"tok/s, tail {r['tail_time_s']:.1f} s, {r['num_preemptions']} preemptions", flush=True)
    finally:
        stop(run_dir, 60)
    if agentic_run is not None:
        print(f"\nagentic replay of {replay['file']} ({replay['source']}):")
        print(agentic.summary(replay))
    elif replay is not None:
        print(f"\nreplay of {replay['source']}: {sum(map(sum, replay['lengths']))} tokens in all")
    print(f"\n{len(prompts)} prompts x G={args.group_size}, max_tokens {args.max_tokens}, temperature "
          f"{args.temperature}, seed {args.seed}; {args.reps} interleaved repetition(s); engines: "
          f"{config.engines.count} x {config.engines.backend} ({config.model.dtype}, {config.engines.kv_cache_gib} GiB KV); "
          f"chunk {config.scheduler.chunk_size_tokens} tokens; speculative {config.speculative.method}"
          + (f" (gamma_max {config.speculative.gamma_max}, adaptive; only +sd policies draft)" if grouped else "")
          + f"; logs in {run_dir}")
    if agentic_run is not None:
        agentic.print_agentic_table(runs, policies)
    else:
        print_table(runs, policies)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out), "plot": str(args.plot),
                                                              "true_lengths": str(args.true_lengths)},
                                        "run_dir": str(run_dir), "chunk_size_tokens": config.scheduler.chunk_size_tokens,
                                        "num_engines": config.engines.count,
                                        "speculative_method": config.speculative.method, "replay": replay,
                                        "runs": runs}, indent=1))
        print(f"runs: {args.out}")
    if args.plot:
        plot(runs, policies, args.plot, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
