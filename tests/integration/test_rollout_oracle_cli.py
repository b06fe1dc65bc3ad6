"""`seerctl rollout --policy oracle --true-lengths FILE` runs the oracle from the command
line (issue 38, point 2): the lengths come from an earlier seeded `seerctl rollout`'s
results, and the oracle run generates exactly those samples."""

from __future__ import annotations

import json

from tests.daemon_helpers import seerctl


def _samples(path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {(r["group_index"], s["sample_index"]): s["token_ids"] for r in rows for s in r["samples"]}


def test_an_oracle_rollout_runs_from_the_command_line_with_recorded_lengths(sim_daemon, tmp_path):
    """A seeded context run records the lengths; the oracle run, given them, exits 0 and
    returns every sample, token for token the same (seeded samples are schedule-invariant)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(4)))
    common = ["rollout", "--run-dir", str(sim_daemon.run_dir), "--prompts", str(prompts), "--group-size", "3",
              "--max-tokens", "24", "--seed", "5"]
    first = seerctl(*common, "--policy", "context", "--out", str(tmp_path / "first.jsonl"))
    assert first.returncode == 0, first.stderr
    oracle = seerctl(*common, "--policy", "oracle", "--true-lengths", str(tmp_path / "first.jsonl"),
                     "--out", str(tmp_path / "oracle.jsonl"))
    assert oracle.returncode == 0, oracle.stderr
    assert "policy oracle" in oracle.stdout
    assert _samples(tmp_path / "oracle.jsonl") == _samples(tmp_path / "first.jsonl")
