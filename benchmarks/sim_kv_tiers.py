"""Simulated study: when does the KV pool's disk tier matter at paper scale (issue 18)?

One paper-shaped workload, ``divided`` scheduling, the ``gpu`` cost model. First an
unbounded DRAM pool (today's simulator assumption) measures the peak KV the pool must
hold (in-flight contexts + waiting requests' KV); then DRAM pools of a fraction of that
peak, each without a disk tier (chunks that cannot save re-prefill next time), with a
disk tier, and with disk + prefetch by the queue (sim/kv_tiers.py).

    .venv/bin/python benchmarks/sim_kv_tiers.py --workload moonlight --scale 0.25 --engines 8 --fractions 0.5,0.25,0.1

``--disk-us-per-token``: disk read/write time per token of KV. The default 100 µs is an
assumption: ~320 KiB of KV per token (a 72B GQA model in bf16) at ~3.2 GB/s (one NVMe
drive); it is not a measurement.
"""

from __future__ import annotations

import argparse

from seer.config import SchedulerConfig
from seer.sim.engine_model import CostModel
from seer.sim.kv_tiers import PoolTiers, TierConfig
from seer.sim.simulator import Simulation
from seer.sim.workloads import paper_trace


def run(trace, args, tiers: TierConfig | None):  # noqa: ANN001
    config = SchedulerConfig(policy="divided", chunk_size_tokens=args.chunk_tokens)  # type: ignore[arg-type]
    cost = CostModel.gpu_h800_like() if args.cost == "gpu" else CostModel.cpu_smollm2()
    sim = Simulation(trace, "divided", args.engines, cost, round(args.kv_tokens * args.scale),
                     config, args.seed, 256, tiers=tiers)
    return sim.run(), sim.tiers


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="moonlight")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--kv-tokens", type=int, default=1_000_000)
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--fractions", default="0.5,0.25,0.1")
    parser.add_argument("--disk-us-per-token", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", choices=("gpu", "cpu"), default="gpu")
    args = parser.parse_args()
    trace = paper_trace(args.workload, scale=args.scale, seed=args.seed)
    base, probe = run(trace, args, TierConfig(dram_tokens=1 << 62))
    assert probe is not None
    peak = probe.peak_used
    print(f"{args.workload} scale {args.scale}, {args.engines} engines, divided, chunk {args.chunk_tokens}, "
          f"{args.cost} cost model, disk {args.disk_us_per_token:g} µs/token (assumed); peak pool working set "
          f"{peak:,} tokens, of which chunks in flight {probe.peak_inflight:,}")
    print("| DRAM pool | tiers | makespan s | tok/s | vs unbounded | tokens without pool KV | disk M tokens moved "
          "| critical-path load s | share of makespan | staged on path | prefetched |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| unbounded | DRAM | {base.makespan_s:.0f} | {base.throughput_tokens_per_s:.0f} | 1.00x | "
          f"{probe.reprefill_tokens:,} | 0 | 0 | 0 % | 0 | 0 |")
    for frac in (float(f) for f in args.fractions.split(",")):
        dram = max(1, round(peak * frac))
        for label, disk, prefetch in (("DRAM only", False, False), ("+ disk", True, False),
                                      ("+ disk + prefetch", True, True)):
            res, t = run(trace, args, TierConfig(dram_tokens=dram, disk=disk, prefetch=prefetch,
                                                 disk_s_per_token=args.disk_us_per_token * 1e-6))
            assert isinstance(t, PoolTiers)
            print(f"| {frac:g} x peak ({dram:,}) | {label} | {res.makespan_s:.0f} | {res.throughput_tokens_per_s:.0f} "
                  f"| {res.throughput_tokens_per_s / base.throughput_tokens_per_s:.2f}x | {t.reprefill_tokens:,} | "
                  f"{t.disk_tokens / 1e6:.1f} | {t.critical_s:.1f} | {100 * t.critical_s / args.engines / res.makespan_s:.2f} % "
                  f"| {t.num_staged_on_path} | {t.num_prefetched} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
