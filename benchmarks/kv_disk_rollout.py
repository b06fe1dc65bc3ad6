"""A real-engine rollout whose KV working set is larger than the DRAM pool (issue 18):
DRAM only vs + disk tier vs + disk tier + prefetch.

Three daemons in turn, each with two vLLM engines (float32 SmolLM2), ``--policy`` (``context``
by default: the disk tier follows its queue order) in chunks of ``--chunk`` tokens, every chunk moved to the other engine (``placement = "migrate"``,
so every continuation needs its KV from the pool), at most ``--inflight`` chunks per engine
(the other requests wait with their KV in the pool or on disk), and a pool of
``--pool-blocks`` blocks. Same prompts, greedy, in every configuration. From each
daemon's log: chunks that could not save (``kv_pool_full``), tokens re-prefilled by moved
chunks, the engines' pool-load time, the time sends waited for disk work
(``kv_disk_waited``: load time on the critical path; in all, and the part spent waiting
for a chunk's own prefetched stage / its own stage on the dispatch path), stages
prefetched / on the dispatch path, and output tokens per second of the rollout.

    .venv/bin/python benchmarks/kv_disk_rollout.py --prompts 12 --max-tokens 128 --pool-blocks 16

Prefetch needs room: a pool that holds the chunks in flight plus about a round of waiting
requests' KV (``--pool-blocks``), and requests that wait several rounds (``--prompts`` x
``--group-size`` well above 2 x ``--inflight``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 32 * 46080  # one pool block of SmolLM2 float32 KV (32 tokens)


def run(name: str, disk: bool, prefetch: bool, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from seer.cli.daemon import start_background, stop
    from seer.client import SamplingParams, SeerClient
    from seer.config import default_cache_dir

    root = Path(tempfile.mkdtemp(prefix=f"seer-kvdisk-{name}-"))
    (root / "kvdisk").mkdir()
    disk_lines = (f'disk_path = "{root / "kvdisk"}"\ndisk_gib = {args.disk_gib}\n'
                  f"disk_prefetch = {'true' if prefetch else 'false'}\n"
                  f"disk_prefetch_depth = {args.prefetch_depth}\n") if disk else ""
    (root / "seer.toml").write_text(f"""
[model]
dtype = "float32"
max_model_len = 2048
[engines]
count = 2
kv_cache_gib = 1.0
[scheduler]
policy = "{args.policy}"
chunk_size_tokens = {args.chunk}
placement = "migrate"
max_chunks_per_engine = {args.inflight}
[kv_pool]
pool_gib = {(args.pool_blocks + 0.5) * BLOCK / 2**30!r}
min_load_tokens = 1
{disk_lines}""")
    run_dir = root / "run"
    info = start_background(str(root / "seer.toml"), run_dir, default_cache_dir(), 1800)
    try:
        with SeerClient(info["client_address"], timeout_s=3600) as client:
            t0 = time.perf_counter()
            result = client.rollout([{"prompt_token_ids": p} for p in prompts], args.group_size,
                                    SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
            wall = time.perf_counter() - t0
    finally:
        stop(run_dir, 120)
    events = [json.loads(line) for line in (run_dir / "controlplane.log").read_text().splitlines() if line.strip()]
    mine = [e for e in events if e.get("rollout_id") in (None, result.rollout_id)]
    migrated = [e for e in mine if e["event"] == "chunk_migrated"]
    staged = [e for e in mine if e["event"] == "kv_disk_staged"]
    tokens = sum(len(s.token_ids) for g in result.groups for s in g.samples)
    return {
        "config": name,
        "samples": [s.token_ids for g in result.groups for s in g.samples],
        "pool_full": sum(e["event"] == "kv_pool_full" for e in mine),
        "reprefill_tokens": sum(e.get("reprefill_tokens", 0) for e in migrated),
        "engine_load_ms": sum(e.get("load_ms") or 0.0 for e in migrated),
        "disk_wait_ms": sum(e["ms"] for e in mine if e["event"] == "kv_disk_waited"),
        "wait_prefetched_ms": sum(e.get("prefetched_ms", 0.0) for e in mine if e["event"] == "kv_disk_waited"),
        "wait_staged_ms": sum(e.get("staged_ms", 0.0) for e in mine if e["event"] == "kv_disk_waited"),
        "spilled": sum(e["event"] == "kv_disk_spilled" for e in mine),
        "prefetched": sum(1 for e in staged if e["prefetch"]),
        "staged_on_path": sum(1 for e in staged if not e["prefetch"]),
        "disk_failed": sum(e["event"] in ("kv_disk_spill_failed", "kv_disk_stage_failed") for e in mine),
        "tok_s": tokens / wall,
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--inflight", type=int, default=1)
    parser.add_argument("--pool-blocks", type=int, default=16)
    parser.add_argument("--disk-gib", type=float, default=1.0)
    parser.add_argument("--configs", default="dram,disk,disk+prefetch")
    parser.add_argument("--out", default="", help="append each config's row to this JSON-lines file as it ends "
                        "and print the table of every row in it (configs run one at a time survive a failed one)")
    parser.add_argument("--policy", default="context")
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--prefetch-depth", type=int, default=0, help="kv_pool.disk_prefetch_depth (0: 4 per engine)")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    rows = []
    for name in args.configs.split(","):
        rows.append(run(name, disk=name != "dram", prefetch=name == "disk+prefetch", args=args, prompts=prompts))
        print(f"  {name} done", file=sys.stderr)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    if args.out:
        rows = [json.loads(line) for line in Path(args.out).read_text().splitlines() if line.strip()]
    need = args.prompts * args.group_size * -(-(args.prompt_tokens + args.max_tokens) // 32)
    print(f"policy {args.policy}, {args.prompts} prompts x {args.group_size} of {args.prompt_tokens} random tokens, "
          f"{args.max_tokens} greedy tokens, chunks of "
          f"{args.chunk}, every chunk moved, {args.inflight} chunk(s) in flight per engine; pool {args.pool_blocks} "
          f"blocks for a KV working set of up to {need} blocks")
    print("| config | kv_pool_full | tokens re-prefilled | engine pool-load ms | disk wait ms (critical path): all "
          "/ prefetched stages / stages on path | spills | stages prefetched / on path | disk failures | tok/s | "
          "same samples as DRAM only |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = r["samples"] == rows[0]["samples"]
        split = (f" / {r['wait_prefetched_ms']:.0f} / {r['wait_staged_ms']:.0f}" if "wait_prefetched_ms" in r
                 else "")
        print(f"| {r['config']} | {r['pool_full']} | {r['reprefill_tokens']} | {r['engine_load_ms']:.0f} | "
              f"{r['disk_wait_ms']:.0f}{split} | {r['spilled']} | {r['prefetched']} / {r['staged_on_path']} | "
              f"{r['disk_failed']} | {r['tok_s']:.1f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
