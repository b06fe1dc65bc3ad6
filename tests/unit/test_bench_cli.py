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


def test_bench_shows_the_share_of_oracle_full_when_it_ran():
    """With oracle-full among the policies the table has a "% of oracle-full" column, in
    which oracle-full itself is 100 %; without it there is no such column."""
    args = [sys.executable, "-m", "seer.cli.main", "bench", "--workload", "kimi-k2", "--scale", "0.01",
            "--engines", "2", "--kv-tokens", "20000", "--chunk-tokens", "256"]
    proc = subprocess.run([*args, "--policies", "context,oracle,oracle-full"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "% of oracle-full" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["context", "oracle", "oracle-full"]
    assert rows[2].rstrip("│ ").endswith("100 %")
    without = subprocess.run([*args, "--policies", "context,oracle"], capture_output=True, text=True, timeout=120)
    assert without.returncode == 0 and "% of oracle-full" not in without.stdout


def test_bench_runs_on_the_results_file_seerctl_rollout_writes(tmp_path):
    """`seerctl bench --workload X.jsonl` reads the file `seerctl rollout` writes (made here by
    its own writer from hand-made samples, not by a real engine): lengths, prompt sizes, and
    the budget taken from a sample cut off by it."""
    from types import SimpleNamespace

    from rich.console import Console

    from seer.cli.bench import run_bench
    from seer.cli.rollout import write_results
    from seer.protocol import SampleResult
    from seer.sim.workloads import load_rollout_jsonl

    def sample(i: int, n: int, reason: str) -> SampleResult:
        return SampleResult(sample_index=i, token_ids=[3] * n, logprobs=[-1.0] * n, text="x", finish_reason=reason,
                            num_prompt_tokens=12, first_scheduled_s=0.0, finished_s=1.0, engine_ids=[0])

    groups = [SimpleNamespace(prompt_id="b", group_index=1, samples=[sample(0, 40, "length"), sample(1, 9, "stop")]),
              SimpleNamespace(prompt_id="a", group_index=0, samples=[sample(0, 5, "stop"), sample(1, 30, "stop")])]
    path = tmp_path / "rollout.jsonl"
    write_results(path, SimpleNamespace(groups=groups, weights_version=3), [{}, {"answer": "1"}])

    trace = load_rollout_jsonl(path)
    assert [g.output_tokens for g in trace.groups] == [(5, 30), (40, 9)]
    assert {g.max_tokens for g in trace.groups} == {40} and {g.prompt_tokens for g in trace.groups} == {12}
    results = run_bench(str(path), 1.0, ["group", "context"], 2, "cpu", 1000, 16, 0, Console(file=open(tmp_path / "out", "w")))
    assert [r.num_output_tokens for r in results] == [84, 84]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seer.cli.main", "bench", *args], capture_output=True, text=True,
                          timeout=120)


def test_bad_bench_flags_give_one_line_and_exit_2(tmp_path):
    """A correlation outside [0, 1), a non-positive sigma, an unknown shape or policy and an
    empty trace file each give one clear line on stderr and exit 2, never a traceback."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cases = [(["--icc", "1.0"], "--icc 1"), (["--icc", "-0.2"], "[0, 1)"), (["--log-sigma", "0"], "> 0"),
             (["--log-sigma", "-1"], "--log-sigma -1"), (["--workload", "llama"], "unknown shape"),
             (["--policies", "group,fast"], "unknown policy 'fast'"), (["--workload", str(empty)], "no rollout result rows")]
    for args, expected in cases:
        proc = bench(*args, "--scale", "0.01", "--engines", "2", "--seed", "0")
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_icc_and_log_sigma_shape_the_trace(tmp_path):
    """--icc and --log-sigma reach the synthetic trace (shown in the header line)."""
    proc = bench("--workload", "moonlight", "--scale", "0.01", "--engines", "2", "--kv-tokens", "50000",
                 "--chunk-tokens", "128", "--policies", "divided", "--icc", "0.8", "--log-sigma", "1.4")
    assert proc.returncode == 0, proc.stderr
    assert "icc 0.8, log sigma 1.4" in proc.stdout


def test_sweep_runs_divided_context_and_both_oracles_for_every_point(monkeypatch):
    """The sweep prints one row per (shape, icc, log sigma) with the four policies' numbers."""
    from rich.console import Console

    from seer.cli import bench as b

    monkeypatch.setattr(b, "SWEEP_ICC", (0.2, 0.8))
    monkeypatch.setattr(b, "SWEEP_LOG_SIGMA", (0.6,))
    monkeypatch.setattr(b, "SWEEP_SHAPES", (("moonlight", 32, 1.0),))
    console = Console(file=open("/dev/null", "w"), width=200)
    table = b.run_sweep(0.02, "gpu", 1_000_000, 8192, 0, console)
    assert table.row_count == 2
    assert [c.header for c in table.columns][3:7] == ["divided tok/s", "context tok/s", "oracle-group tok/s",
                                                      "oracle tok/s"]
