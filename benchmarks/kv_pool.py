"""Benchmarks of the host KV pool (docs/kv-pool.md, "Measured").

``copy``: bytes per second of the pool's copy path (vLLM KV pages -> pool blocks and
back with the connector's ``PageCopier``, one thread, checksums included) against plain
memcpy of the same bytes between pre-faulted buffers and against the earlier numpy path
(slice copies, then a checksum pass), on this machine, in the same run.

    .venv/bin/python benchmarks/kv_pool.py copy --tokens 2048

``migrate``: what a chunk that moves to another engine costs on real vLLM, KV loaded
from the pool vs re-prefilled. Two daemons in turn (pool loads on / off), each with two
engines and ``placement = "migrate"``; for each prefix length, fresh random prompts of
that length are generated in 1-token chunks, so chunk 2 runs on the other engine with
nothing of the prompt in its cache. The time of that second chunk (engine side, from
``chunk_finished``) is the migration cost: a pool load plus one decode step, or a
prefill of the whole prefix plus one decode step.

    .venv/bin/python benchmarks/kv_pool.py migrate --prefixes 512,2048,8000 --repeats 3

``idle``: what the first write into memory this process wrote long ago costs, against a
second write and against memory written just before (no pool, no engine). An engine's
KV pages are zeroed at start-up and may sit untouched for minutes before a migrated
chunk's load writes them; on a virtual machine whose host reclaims or merges idle guest
memory, that first write is slower than the copy loop. Buffers are allocated as vLLM
allocates its KV cache (``torch.zeros``, 4 KiB pages), zero-filled and random-filled.

    .venv/bin/python benchmarks/kv_pool.py idle --mib 352 --wait 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import KVPoolSegment
from seer.engines.kv_connector import block_runs
from seer.engines.kv_copy import PageCopier

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_size=64, block_size=32, dtype="float32")


def bench_copy(tokens: int, repeats: int) -> None:
    geometry = PoolGeometry(**SMOLLM2)  # type: ignore[arg-type]
    num_blocks = -(-tokens // geometry.block_size)
    engine_blocks = num_blocks * 2
    # The engine's KV: one [blocks, H, N, C] float32 tensor per layer, as vLLM allocates it.
    layers = [torch.randn(engine_blocks, 3, 32, 128).view(torch.uint8).reshape(engine_blocks, -1).numpy()
              for _ in range(geometry.num_layers)]
    name = f"seer-kv-bench-{random.randrange(1 << 30)}"
    created = KVPoolSegment.create(name, geometry, num_blocks + 8)
    # The engine's side attaches like the connector's worker does (mapping populated).
    seg = KVPoolSegment.attach(name, populate=True)
    copier = PageCopier(layers)
    nbytes = num_blocks * geometry.bytes_per_block
    dst_ids = list(range(num_blocks))
    # Engine blocks scattered (every other one: no run longer than one block, the worst
    # case for slice copies) and consecutive (a fresh request's usual allocation).
    layouts = {"scattered": list(range(0, engine_blocks, 2)), "consecutive": list(range(num_blocks))}
    times: dict[str, list[float]] = {}

    def timed(label: str, fn) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        fn()
        times.setdefault(label, []).append(time.perf_counter() - t0)

    a = np.ones(nbytes, dtype=np.uint8)
    b = np.zeros(nbytes, dtype=np.uint8)
    try:
        for _ in range(repeats):
            timed("memcpy", lambda: np.copyto(b, a))
            for layout, src_ids in layouts.items():
                timed(f"before save {layout}", lambda: _numpy_save(seg, layers, dst_ids, src_ids))
                timed(f"before load {layout}", lambda: _numpy_load(seg, layers, dst_ids, src_ids))
                timed(f"save {layout}", lambda: copier.save(seg, dst_ids, src_ids, 1, 0, 0))
                n_ok: list[int] = []
                timed(f"load {layout}", lambda: n_ok.append(copier.load(seg, dst_ids, src_ids, 1, 0, 0)))
                assert n_ok == [num_blocks], "the fused load rejected a block it had just saved"
    finally:
        seg.close()
        created.close()
        created.unlink()

    print(f"{tokens} tokens of SmolLM2 float32 KV = {num_blocks} blocks = {nbytes / 2**20:.1f} MiB; "
          f"{repeats} repeats, best / median; one thread; load includes the checksum check")
    print("| path | engine blocks | GB/s best | GB/s median | ms median | vs memcpy (median) |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(times["memcpy"])
    labels = {"memcpy": "memcpy (numpy copyto, pre-faulted)",
              "before save": "before: numpy slices + seal pass", "before load": "before: check pass + numpy slices",
              "save": "save: fused copy + checksum, seal", "load": "load: fused copy + checksum check"}
    for label, ts in times.items():
        path, _, layout = label.rpartition(" ") if label != "memcpy" else ("memcpy", "", "-")
        med = statistics.median(ts)
        print(f"| {labels[path]} | {layout} | {nbytes / min(ts) / 1e9:.2f} | {nbytes / med / 1e9:.2f} | "
              f"{med * 1000:.1f} | {base / med:.2f}x |")


def _numpy_save(seg: KVPoolSegment, layers: list[np.ndarray], dst_ids: list[int], src_ids: list[int]) -> None:
    """The earlier copy path: one numpy slice per run and layer, then a checksum pass."""
    for p0, v0, n in block_runs(dst_ids, src_ids):
        for i, layer in enumerate(layers):
            seg.blocks[p0:p0 + n, i] = layer[v0:v0 + n]
    seg.seal(dst_ids, 1, 0, 0)


def _numpy_load(seg: KVPoolSegment, layers: list[np.ndarray], dst_ids: list[int], src_ids: list[int]) -> None:
    assert seg.first_bad(dst_ids, 1, 0, 0, verify_checksums=True) is None
    for p0, v0, n in block_runs(dst_ids, src_ids):
        for i, layer in enumerate(layers):
            layer[v0:v0 + n] = seg.blocks[p0:p0 + n, i]


def _engine_log_sizes(run_dir: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in run_dir.glob("engine-*.out")}


def _copies_since(run_dir: Path, sizes: dict[Path, int]) -> list[dict]:
    """The connector's ``seer_kv_copy`` lines (SEER_KV_COPY_TIMING=1) written since ``sizes``."""
    out = []
    for path in run_dir.glob("engine-*.out"):
        with open(path, "rb") as f:
            f.seek(sizes.get(path, 0))
            text = f.read().decode(errors="replace")
        for m in re.finditer(r"seer_kv_copy (\w+) req=\S+ blocks=(\d+) bytes=(\d+) ms=([0-9.]+) gbps=\S+ "
                             r"cpu_ms=([0-9.]+) minflt=(\d+) majflt=(\d+) nivcsw=(\d+) repeat_ms=(-?[0-9.]+)", text):
            out.append({"what": m.group(1), "bytes": int(m.group(3)), "ms": float(m.group(4)),
                        "cpu_ms": float(m.group(5)), "minflt": int(m.group(6)), "majflt": int(m.group(7)),
                        "nivcsw": int(m.group(8)), "repeat_ms": float(m.group(9))})
    return out


def bench_migrate(prefixes: list[int], repeats: int, max_model_len: int, modes: list[str], chunk: int) -> None:
    from seer.cli.daemon import start_background, stop
    from seer.client import SamplingParams, SeerClient
    from seer.config import default_cache_dir

    # the engines log every pool copy and time a second copy of the same bytes (inherited)
    os.environ["SEER_KV_COPY_TIMING"] = "repeat"
    rows: dict[tuple[str, int], list[dict]] = {}
    copies: dict[int, list[dict]] = {}
    memcpy: dict[int, list[float]] = {}
    rng = random.Random(0)
    for mode, min_load in (m for m in (("pool", 1), ("re-prefill", 1 << 30)) if m[0] in modes):
        root = Path(tempfile.mkdtemp(prefix=f"seer-kvbench-{mode}-"))
        config = root / "seer.toml"
        config.write_text(f"""
[model]
max_model_len = {max_model_len}
[engines]
count = 2
[scheduler]
policy = "divided"
chunk_size_tokens = {chunk}
placement = "migrate"
[kv_pool]
min_load_tokens = {min_load}
""")
        run_dir = root / "run"
        info = start_background(str(config), run_dir, default_cache_dir(), 1200)
        try:
            with SeerClient(info["client_address"], timeout_s=600) as client:
                client.rollout([{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(64)]}], 1,
                               SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
                for prefix in prefixes:
                    for _ in range(repeats):
                        prompt = [rng.randrange(100, 40000) for _ in range(prefix - 1)]
                        sizes = _engine_log_sizes(run_dir)
                        result = client.rollout([{"prompt_token_ids": prompt}], 1,
                                                SamplingParams(max_tokens=2 * chunk, temperature=0.0, ignore_eos=True))
                        rows.setdefault((mode, prefix), []).append(_second_chunk(run_dir, result.rollout_id))
                        if mode == "pool":
                            time.sleep(1.0)  # let the engines' log lines reach their files
                            copies.setdefault(prefix, []).extend(_copies_since(run_dir, sizes))
                            nbytes = max((c["bytes"] for c in copies[prefix]), default=0)
                            if nbytes:
                                a, b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
                                np.copyto(b, a)
                                t0 = time.perf_counter()
                                np.copyto(b, a)
                                memcpy.setdefault(prefix, []).append(nbytes / (time.perf_counter() - t0) / 1e9)
        finally:
            stop(run_dir, 120)
    if copies:
        print("pool copies inside these migrations (the connector's own timing, SEER_KV_COPY_TIMING=1) vs memcpy of "
              "the same bytes measured by this process right after each rollout (pre-faulted buffers)")
        print("repeat: the same copy again, right after, into the same pages (SEER_KV_COPY_TIMING=repeat)")
        print("| prefix tokens | copy | n | MiB | ms median | thread CPU ms | minor faults | preempted | GB/s median "
              "| memcpy GB/s median | vs memcpy | repeat GB/s median | repeat vs memcpy |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for prefix in prefixes:
            for what in ("save", "load"):
                cs = [c for c in copies.get(prefix, []) if c["what"] == what and c["bytes"] >= prefix // 2 * 46080]
                if not cs:
                    continue
                gbs = statistics.median(c["bytes"] / c["ms"] / 1e6 for c in cs)
                base = statistics.median(memcpy.get(prefix, [float("nan")]))
                med = {k: statistics.median(c[k] for c in cs) for k in ("bytes", "ms", "cpu_ms", "minflt", "nivcsw")}
                rep = statistics.median(c["bytes"] / c["repeat_ms"] / 1e6 for c in cs) if all(
                    c["repeat_ms"] > 0 for c in cs) else float("nan")
                print(f"| {prefix} | {what} | {len(cs)} | {med['bytes'] / 2**20:.1f} | {med['ms']:.1f} | "
                      f"{med['cpu_ms']:.1f} | {med['minflt']:.0f} | {med['nivcsw']:.0f} | {gbs:.2f} | {base:.2f} | "
                      f"{gbs / base:.2f}x | {rep:.2f} | {rep / base:.2f}x |")
    if len(modes) < 2:
        return
    print(f"migration cost on real vLLM (2 engines, float32 SmolLM2, {chunk}-token chunks, fresh random prompts); "
          f"median of {repeats}")
    print("| prefix tokens | mode | chunk ms (engine) | KV loaded tokens | load ms | MiB moved | re-prefilled tokens "
          "| vs re-prefill |")
    print("|---|---|---|---|---|---|---|---|")
    for prefix in prefixes:
        base = statistics.median(e["latency_ms"] for e in rows[("re-prefill", prefix)])
        for mode in ("pool", "re-prefill"):
            evs = rows[(mode, prefix)]
            ms = statistics.median(e["latency_ms"] for e in evs)
            loaded = statistics.median(e.get("kv_loaded_tokens", 0) for e in evs)
            # null when the chunk finished in its loading step (1-token chunks): unknown
            known = [e["load_ms"] for e in evs if e.get("load_ms") is not None and e.get("kv_loaded_tokens")]
            load_ms = f"{statistics.median(known):.1f}" if known else "-"
            moved = statistics.median(e.get("num_bytes", 0) for e in evs) / 2**20
            reprefill = statistics.median(e["num_prompt_tokens"] - e["num_cached_tokens"] for e in evs)
            print(f"| {prefix} | {mode} | {ms:.1f} | {loaded:.0f} | {load_ms} | {moved:.1f} | {reprefill:.0f} "
                  f"| {base / ms:.1f}x |")


def bench_idle(mib: int, wait_s: float) -> None:
    n = mib << 20
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)

    def buffer(fill: str) -> np.ndarray:
        t = torch.zeros(n, dtype=torch.uint8)
        if fill == "random":
            t.random_(0, 255)
        return t.numpy()

    bufs = {(fill, when): buffer(fill) for when in ("now", "later") for fill in ("zero", "random")}
    rows = []

    def write(fill: str, when: str) -> None:
        dst = bufs[(fill, when)]
        t0 = time.perf_counter()
        np.copyto(dst, src)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        np.copyto(dst, src)
        rows.append((fill, when, n / first / 1e9, n / (time.perf_counter() - t0) / 1e9))

    write("zero", "now")
    write("random", "now")
    time.sleep(wait_s)
    write("zero", "later")
    write("random", "later")
    print(f"first vs second write (numpy copyto) of {mib} MiB into torch.zeros buffers, filled then written "
          f"right away or after {wait_s:.0f} s untouched")
    print("| buffer filled with | written | first write GB/s | second write GB/s | first / second |")
    print("|---|---|---|---|---|")
    fills = {"zero": "zeros", "random": "random bytes"}
    whens = {"now": "right away", "later": f"after {wait_s:.0f} s"}
    for fill, when, first, second in rows:
        print(f"| {fills[fill]} | {whens[when]} | {first:.2f} | {second:.2f} | {first / second:.2f}x |")


def _second_chunk(run_dir: Path, rollout_id: str) -> dict:
    finished, migrated = [], {}
    for line in (run_dir / "controlplane.log").read_text().splitlines():
        e = json.loads(line)
        if e.get("rollout_id") != rollout_id:
            continue
        if e["event"] == "chunk_finished":
            finished.append(e)
        elif e["event"] == "chunk_migrated":
            migrated[e["task_id"]] = e
    second = finished[1]
    if second["task_id"] not in migrated:
        raise RuntimeError(f"rollout {rollout_id}: the second chunk did not migrate")
    return {**migrated[second["task_id"]], **second}


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("copy")
    c.add_argument("--tokens", type=int, default=2048)
    c.add_argument("--repeats", type=int, default=10)
    m = sub.add_parser("migrate")
    m.add_argument("--prefixes", default="512,2048,8000")
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--max-model-len", type=int, default=8192)
    m.add_argument("--modes", default="pool,re-prefill")
    m.add_argument("--chunk", type=int, default=1, help="tokens per chunk (2+: the load time is reported)")
    i = sub.add_parser("idle")
    i.add_argument("--mib", type=int, default=352, help="buffer size (352 MiB: an 8K-token SmolLM2 prefix)")
    i.add_argument("--wait", type=float, default=300.0, help="seconds the 'later' buffers stay untouched")
    args = parser.parse_args()
    if args.what == "idle":
        bench_idle(args.mib, args.wait)
    elif args.what == "copy":
        bench_copy(args.tokens, args.repeats)
    else:
        bench_migrate([int(p) for p in args.prefixes.split(",")], args.repeats, args.max_model_len,
                      args.modes.split(","), args.chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
