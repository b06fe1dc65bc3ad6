"""Benchmark: the same rollout under several policies, same daemon, same engines.

Starts one daemon (the embedded default config unless --config: two real vLLM engines),
runs the prompt file once per policy in sequence (a warm-up rollout first, so every
policy sees warm engines), and prints one table with throughput, tail time, preemptions,
chunks and migrations, each with its ratio to the first policy (the baseline).

    .venv/bin/python benchmarks/rollout_policies.py --prompts examples/math_prompts.jsonl \
        --limit 16 --group-size 8 --max-tokens 256 --policies group,divided,context
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from seer.cli.daemon import start_background, stop
from seer.cli.rollout import read_prompts
from seer.client import SamplingParams, SeerClient
from seer.config import default_cache_dir, load_config


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", default="examples/math_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="group,request,divided,context")
    parser.add_argument("--config")
    args = parser.parse_args()
    config = load_config(args.config)
    prompts, _ = read_prompts(Path(args.prompts))
    prompts = prompts[: args.limit]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="seer-bench-"))
    info = start_background(args.config, run_dir, default_cache_dir(), config.engines.startup_timeout_s + 60)
    rows = []
    try:
        with SeerClient(info["client_address"], timeout_s=300) as client:
            client.rollout(prompts[:2], 2, SamplingParams(max_tokens=16))  # warm-up
            for policy in args.policies.split(","):
                t0 = time.monotonic()
                result = client.rollout(prompts, args.group_size, sampling, policy=policy)
                s = result.stats
                migrations = sum(len(x.engine_ids) - 1 for g in result.groups for x in g.samples)
                rows.append((policy, s.num_output_tokens, s.wall_time_s, s.throughput_tokens_per_s, s.tail_time_s,
                             s.num_preemptions, s.num_chunks, migrations, time.monotonic() - t0))
    finally:
        stop(run_dir, 60)
    base_tps, base_tail = rows[0][3], rows[0][4]
    print(f"{len(prompts)} prompts x G={args.group_size}, max_tokens {args.max_tokens}, temperature "
          f"{args.temperature}, seed {args.seed}; engines: {config.engines.count} x {config.engines.backend} "
          f"({config.model.dtype}); chunk {config.scheduler.chunk_size_tokens} tokens; logs in {run_dir}")
    print(f"| policy | output tokens | wall s | tok/s | ratio | tail s | tail vs {rows[0][0]} | preemptions "
          "| chunks | migrations |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for policy, tokens, wall, tps, tail, pre, chunks, mig, _ in rows:
        tail_ratio = f"{(tail / base_tail - 1) * 100:+.0f} %" if base_tail > 0 else "-"
        print(f"| {policy} | {tokens} | {wall:.1f} | {tps:.1f} | {tps / base_tps:.2f} | {tail:.1f} | {tail_ratio} "
              f"| {pre} | {chunks} | {mig} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
