"""A real two-host rollout where every continuation's KV crosses hosts: cross-host prefetch
(``kv_pool.transfer_prefetch``) on against off, interleaved (issue 18).

Two "hosts" are network namespaces joined by a veth pair (``dataplane/netns.py``; needs root
and iproute2). Host A runs the daemon and its vLLM engine, host B a vLLM engine joined with
``seerctl engine --join`` over CURVE-keyed tcp; each host has its pool and agent, KV moves
between them over tcp. ``placement = "migrate"`` sends every chunk to the other host and
``max_chunks_per_engine`` (1 by default) holds the requests the scheduler places on a busy
engine, which is what lets their KV move ahead: with prefetch on, the pull starts when the
request is placed; off, when its chunk is sent. Same prompts, greedy, float32 SmolLM2.

From each daemon's log: pulls (``kv_transferred``), how many started ahead, the time chunks
waited for their pull (``chunk_waited_ms``: transfer time left on the critical path), split
into pulls started ahead and pulls started when the chunk was sent, and output tokens per
second. Configurations alternate (on, off, on, off, ...) so a drift of the machine hits both.

    .venv/bin/python benchmarks/kv_transfer_rollout.py --prompts 8 --group-size 2 --max-tokens 96 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEERCTL = [sys.executable, "-m", "seer.cli.main"]


def config_text(args: argparse.Namespace, keys: dict[str, Path], address: str, prefetch: bool) -> str:
    return f"""
[model]
dtype = "float32"
max_model_len = 2048
[engines]
backend = "vllm"
count = 1
kv_cache_gib = 1.0
cpu_binding = "none"
[server]
engine_address = "{address}"
curve_server_secret_key = "{keys['server_secret']}"
curve_authorized_keys = "{keys['authorized']}"
curve_server_public_key = "{keys['server_public']}"
curve_client_secret_key = "{keys['client_secret']}"
[scheduler]
policy = "{args.policy}"
chunk_size_tokens = {args.chunk}
placement = "migrate"
max_chunks_per_engine = {args.inflight}
[kv_pool]
pool_gib = 0.5
min_load_tokens = 1
transport = "tcp"
transfer_prefetch = {'true' if prefetch else 'false'}
"""


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)


def run(pair, prefetch: bool, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from seer.auth import generate_keys
    from seer.client import SamplingParams, SeerClient
    from seer.process import stop_process

    root = Path(tempfile.mkdtemp(prefix=f"seer-kvxfer-{'on' if prefetch else 'off'}-"))
    keys = generate_keys(root / "keys")
    address = f"tcp://{pair.addresses[0]}:{20000 + secrets.randbelow(20000)}"
    config = root / "seer.toml"
    config.write_text(config_text(args, keys, address, prefetch))
    run_dir = root / "run"
    join_log = root / "join" / "engine.log"
    join_log.parent.mkdir()
    # One core per host's engine. The daemon's own "auto" binding would give its one engine
    # both cores, and its OpenMP threads would then wait on the core the joined engine
    # keeps busy: its first chunk took ~50 s while the other engine ran the rollout.
    with open(join_log.with_suffix(".out"), "wb") as out:
        joined = subprocess.Popen([*pair.prefix(1), *SEERCTL, "engine", "--join", address, "--config", str(config),
                                   "--log-file", str(join_log)], stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1"})
    cp_log = run_dir / "controlplane.log"
    try:
        start = subprocess.run([*pair.prefix(0), *SEERCTL, "start", "--config", str(config), "--run-dir",
                                str(run_dir)], capture_output=True, text=True, timeout=1800,
                               env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"})
        if start.returncode != 0:
            raise RuntimeError(f"seerctl start failed: {start.stderr}{start.stdout}")
        with SeerClient(run_dir=run_dir, timeout_s=3600) as client:
            wait_until(lambda: sum(e.state == "ready" for e in client.status().engines) == 2, 1800,
                       f"the joined engine on host B (see {join_log.with_suffix('.out')})")
            wait_until(lambda: sum(e["event"] == "kv_agent_registered" for e in events(cp_log)) >= 2, 120,
                       "both hosts' agents")
            t0 = time.perf_counter()
            result = client.rollout([{"prompt_token_ids": p} for p in prompts], group_size=args.group_size,
                                    sampling=SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                            ignore_eos=True), timeout_s=3600)
            wall = time.perf_counter() - t0
    finally:
        stop_process(joined, 60)
        subprocess.run([*SEERCTL, "stop", "--run-dir", str(run_dir)], capture_output=True, timeout=120)
    mine = [e for e in events(cp_log) if e.get("rollout_id") == result.rollout_id]
    moved = [e for e in mine if e["event"] == "kv_transferred"]
    ahead = [e for e in moved if e.get("ahead")]
    sent = [e for e in moved if not e.get("ahead")]
    migrated = [e for e in mine if e["event"] == "chunk_migrated"]
    return {
        "config": "prefetch on" if prefetch else "prefetch off",
        "samples": [s.token_ids for g in result.groups for s in g.samples],
        "pulls": len(moved),
        "ahead": len(ahead),
        "failed": sum(e["event"] in ("kv_transfer_failed", "kv_transfer_timed_out") for e in mine),
        "wait_ahead_ms": sum(e["chunk_waited_ms"] for e in ahead),
        "wait_sent_ms": sum(e["chunk_waited_ms"] for e in sent),
        "pull_ms": sum(e["ms"] for e in moved),
        "reprefill_tokens": sum(e.get("reprefill_tokens", 0) for e in migrated),
        "tok_s": sum(len(s.token_ids) for g in result.groups for s in g.samples) / wall,
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--inflight", type=int, default=1, help="scheduler.max_chunks_per_engine")
    parser.add_argument("--policy", default="context")
    parser.add_argument("--reps", type=int, default=2, help="pairs of runs (on, off)")
    parser.add_argument("--out", default="", help="append each run's row to this JSON-lines file")
    args = parser.parse_args()
    from seer.dataplane.netns import NetnsPair, NetnsUnavailable

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    try:
        pair = NetnsPair()
    except NetnsUnavailable as exc:
        print(f"error: this benchmark needs two network namespaces: {exc}", file=sys.stderr)
        return 2
    rows = []
    with pair:
        for rep in range(args.reps):
            for prefetch in (True, False):
                rows.append(run(pair, prefetch, args, prompts))
                print(f"  rep {rep + 1}: {rows[-1]['config']} done ({rows[-1]['wall_s']:.0f} s)", file=sys.stderr)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    print(f"policy {args.policy}, {args.prompts} prompts x {args.group_size} of {args.prompt_tokens} random tokens, "
          f"{args.max_tokens} greedy tokens in chunks of {args.chunk}, every chunk moved to the other host, "
          f"{args.inflight} chunk(s) in flight per engine; runs in the order shown")
    print("| run | pulls | started ahead | chunks' wait for pulls started ahead ms | chunks' wait for pulls started "
          "at send ms | total wait ms | pull time ms | tokens re-prefilled | failed | tok/s | same samples |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['pulls']} | {r['ahead']} | {r['wait_ahead_ms']:.0f} | {r['wait_sent_ms']:.0f} | "
              f"{r['wait_ahead_ms'] + r['wait_sent_ms']:.0f} | {r['pull_ms']:.0f} | {r['reprefill_tokens']} | "
              f"{r['failed']} | {r['tok_s']:.1f} | {r['samples'] == rows[0]['samples']} |")
    for name in ("prefetch on", "prefetch off"):
        mine = [r for r in rows if r["config"] == name]
        waits = [r["wait_ahead_ms"] + r["wait_sent_ms"] for r in mine]
        print(f"{name}: total wait median {statistics.median(waits):.0f} ms "
              f"(range {min(waits):.0f}-{max(waits):.0f}), tok/s median "
              f"{statistics.median(r['tok_s'] for r in mine):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
