"""Microbenchmark: what freeing an ended rollout costs the control plane's loop, taken apart
(``MemoryRelease.dismantle``: reference counting frees it) against left to a full
garbage collection (what the release did before rollouts were taken apart).

For each size, a ``context`` rollout of ``--group-size`` samples per prompt is built by the
daemon's own intake (byte tokenizer), then freed one way, then an identical one the other
way; ``--repeat`` rounds, alternating which way goes first. Wall time of the call that
frees it (the loop stands still that long), median and min-max, and their ratio.

    .venv/bin/python benchmarks/release_cost.py --samples 10000 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from seer.controlplane.intake import Limits, build_rollout
from seer.controlplane.memory import MemoryRelease
from seer.controlplane.registry import Registry
from seer.controlplane.state import Rollout
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import Prompt, RolloutRequest, SamplingParams


def make(num_samples: int, group_size: int) -> Rollout:
    prompts = [Prompt(prompt=f"prompt {i}") for i in range(-(-num_samples // group_size))]
    req = RolloutRequest(call_id="c", rollout_id="r", group_size=group_size, sampling=SamplingParams(max_tokens=16),
                         prompts=prompts)
    return build_rollout(req, ByteTokenizer(), Limits(64, len(prompts), 512, 259), "context", 0.0)


def taken_apart(num_samples: int, group_size: int) -> float:
    rollout = make(num_samples, group_size)
    gc.collect()
    memory = MemoryRelease(Registry(), lambda _s: None)
    t0 = time.perf_counter()
    memory.dismantle(rollout)
    return time.perf_counter() - t0


def collected(num_samples: int, group_size: int) -> float:
    rollout = make(num_samples, group_size)
    gc.collect()
    del rollout  # a cycle: only the collector frees it
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.repeat < 1 or args.group_size < 1 or min(args.samples) < args.group_size:
        parser.error(f"--repeat and --group-size must be at least 1 and each --samples at least --group-size "
                     f"({args.group_size})")
    gc.disable()  # only the explicit collections run
    print("| samples | collected, ms: median (min-max) | taken apart, ms: median (min-max) | collected / taken apart |")
    print("|---|---|---|---|")
    for n in args.samples:
        times: dict[str, list[float]] = {"collected": [], "taken apart": []}
        for k in range(args.repeat):
            order = [("collected", collected), ("taken apart", taken_apart)]
            for name, fn in (order if k % 2 == 0 else order[::-1]):
                times[name].append(fn(n, args.group_size) * 1000)
        c, t = (statistics.median(times[name]) for name in ("collected", "taken apart"))
        cell = {name: f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for name, v in times.items()}
        print(f"| {n:,} | {cell['collected']} | {cell['taken apart']} | {c / t:.1f}x |")


if __name__ == "__main__":
    main()
