"""Benchmark of the KV pool's disk tier (issue 18) against dd on the same disk.

Spills ``--tokens`` tokens of SmolLM2 float32 KV (pool blocks of 1.41 MiB) from a real
pool segment to a disk tier file in ``--dir`` and stages them back, ``--repeats`` times;
every spill ends with ``fdatasync`` (the bytes are on the disk, not only in the page
cache) and before every stage the file's cached pages are dropped
(``posix_fadvise(DONTNEED)``), so both directions measure the disk. In the same run,
``dd`` writes and reads a file of the same size in the same folder with 1 MiB blocks and
``oflag=direct`` / ``iflag=direct`` (the disk without the page cache) for the baseline.

    .venv/bin/python benchmarks/kv_disk.py --dir /tmp --tokens 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from seer.dataplane.kvdisk import DiskTier
from seer.dataplane.kvpool import KVPoolSegment
from seer.protocol import PoolGeometry

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_size=64, block_size=32, dtype="float32")


def _dd(args: list[str]) -> float:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"copied, ([0-9.]+) s", out)
    if not m:
        raise RuntimeError(f"cannot read dd's output: {out!r}")
    return float(m.group(1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    geometry = PoolGeometry(**SMOLLM2)  # type: ignore[arg-type]
    n = -(-args.tokens // geometry.block_size)
    nbytes = n * geometry.bytes_per_block
    name = f"seer-kv-diskbench-{random.randrange(1 << 30)}"
    pool = KVPoolSegment.create(name, geometry, n)
    tier = DiskTier.create(args.dir, pool, nbytes)
    ddfile = Path(args.dir) / f"seer-dd-bench-{os.getpid()}.bin"
    mib = nbytes // 2**20 + 1
    times: dict[str, list[float]] = {}
    try:
        rng = np.random.default_rng(0)
        for b in range(n):
            pool.blocks[b] = rng.integers(0, 256, pool.blocks[b].shape, dtype=np.uint8)
        pool.seal(list(range(n)), 1, 0, 0)
        blocks = list(range(n))
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tier.spill(pool, blocks, blocks, 1, 0, 0)
            os.fdatasync(tier._data_fd)
            times.setdefault("spill", []).append(time.perf_counter() - t0)
            os.posix_fadvise(tier._data_fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            got = tier.stage(pool, blocks, blocks, 1, 0, 0)
            times.setdefault("stage", []).append(time.perf_counter() - t0)
            assert got == n, f"staged {got} of {n} blocks"
            times.setdefault("dd write", []).append(
                _dd(["if=/dev/zero", f"of={ddfile}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fdatasync"]))
            times.setdefault("dd read", []).append(_dd([f"if={ddfile}", "of=/dev/null", "bs=1M", "iflag=direct"]))
    finally:
        tier.close()
        pool.close()
        pool.unlink()
        ddfile.unlink(missing_ok=True)
    print(f"{args.tokens} tokens of SmolLM2 float32 KV = {n} blocks = {nbytes / 2**20:.0f} MiB in {args.dir}; "
          f"median of {args.repeats}")
    print("| path | GB/s | s | vs dd |")
    print("|---|---|---|---|")
    labels = {"spill": ("disk tier spill (pwritev + fdatasync)", "dd write"),
              "dd write": ("dd write, 1 MiB, oflag=direct, fdatasync", "dd write"),
              "stage": ("disk tier stage (preadv + checksum + seal), cache dropped", "dd read"),
              "dd read": ("dd read, 1 MiB, iflag=direct", "dd read")}
    for key in ("spill", "dd write", "stage", "dd read"):
        label, base = labels[key]
        med = statistics.median(times[key])
        size = nbytes if not key.startswith("dd") else mib * 2**20
        base_med = statistics.median(times[base])
        print(f"| {label} | {size / med / 1e9:.2f} | {med:.3f} | "
              f"{(size / med) / (mib * 2**20 / base_med):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
