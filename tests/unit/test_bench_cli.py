"""`seerctl bench`: the side-by-side table on a small simulated workload."""

from __future__ import annotations

import subprocess
import sys


def test_bench_prints_one_row_per_policy_with_ratios_to_the_first():
    """seerctl bench runs every named policy on the same trace and prints each with its
    throughput ratio to the baseline and its share of the oracle."""
    proc = subprocess.run([sys.executable, "-m", "seer.cli.main", "bench", "--workload", "moonlight", "--scale", "0.02",
                           "--engines", "4", "--kv-tokens", "50000", "--chunk-tokens", "256",
                           "--policies", "group,divided,context,oracle"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["group", "divided", "context", "oracle"]
    assert "1.00x" in rows[0] and rows[3].rstrip("│ ").endswith("100 %")
