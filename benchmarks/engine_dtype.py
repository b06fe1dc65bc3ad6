"""Benchmark: one real vLLM engine (our VLLMBackend), float32 vs bfloat16 on this machine.

Runs N sampled requests of M tokens (ignore_eos, so every request has the same length)
through ``VLLMBackend`` for each dtype in a fresh subprocess with the same KV budget,
and prints a table with throughput and its ratio to the first dtype.

    .venv/bin/python benchmarks/engine_dtype.py --requests 64 --max-tokens 128 --kv-gib 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time


def run_one(dtype: str, requests: int, max_tokens: int, model: str) -> dict:
    from seer.engines.vllm_backend import VLLMBackend
    from seer.protocol import ChunkTask, EngineSampling, pack_token_ids

    async def go() -> dict:
        backend = VLLMBackend(model, dtype=dtype, max_model_len=2048, enforce_eager=True,
                              gpu_memory_utilization=0.85, logprobs_mode="raw")
        caps = await backend.start()
        prompt = list(range(1000, 1064))
        tasks = [ChunkTask(task_id=i, request_id=f"r{i}", group_id="g", prompt_token_ids=pack_token_ids(prompt),
                           sampling=EngineSampling(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                                                   min_tokens=0, seed=i, stop=[], stop_token_ids=[],
                                                   ignore_eos=True)) for i in range(requests)]
        t0 = time.monotonic()
        outs = await asyncio.gather(*[backend.generate(t) for t in tasks])
        wall = time.monotonic() - t0
        load = backend.load()
        await backend.shutdown()
        tokens = sum(len(o.token_ids) for o in outs)
        return {"dtype": dtype, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                "kv_capacity_tokens": caps.kv_capacity_tokens, "preemptions": load.num_preemptions}

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-gib", type=float, default=2.0)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/seer/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.requests, args.max_tokens, args.model)))
        return
    rows = []
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib).rstrip("0").rstrip(".")}
    for dtype in args.dtypes.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", dtype, "--requests", str(args.requests),
                              "--max-tokens", str(args.max_tokens), "--model", args.model],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            sys.exit(f"{dtype} run failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]["tok_s"]
    print(f"{args.requests} requests x {args.max_tokens} tokens, one engine, KV {args.kv_gib} GiB")
    print(f"{'dtype':<10} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'ratio':>6} {'KV tokens':>10} {'preempt':>8}")
    for r in rows:
        print(f"{r['dtype']:<10} {r['tokens']:>7} {r['wall_s']:>8.1f} {r['tok_s']:>8.1f} {r['tok_s'] / base:>6.2f} "
              f"{r['kv_capacity_tokens']:>10} {r['preemptions']:>8}")


if __name__ == "__main__":
    main()
