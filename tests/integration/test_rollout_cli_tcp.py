"""`seerctl rollout` against a daemon served on tcp:// with CURVE keys (simulated engines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, curve_tcp_server, seerctl, write_sim_config


@pytest.fixture(scope="module")
def curve_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("curve-cli")
    assert seerctl("keys", str(root / "keys")).returncode == 0
    server = curve_tcp_server()
    daemon = Daemon(root / "run", write_sim_config(root / "curve.toml", server=server, count=1))
    info = daemon.start()
    yield daemon, info, root / "keys"
    daemon.stop()


def _prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}", "answer": i}) + "\n"
                            for i in range(3)))
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollout_finds_the_keys_through_the_run_dir(curve_daemon, tmp_path):
    """With only --run-dir, `seerctl rollout` reads the daemon's client key paths from
    daemon.json and rolls out over CURVE."""
    daemon, _, _ = curve_daemon
    out = tmp_path / "out.jsonl"
    proc = seerctl("rollout", "--run-dir", str(daemon.run_dir), "--prompts", str(_prompts(tmp_path / "p.jsonl")),
                   "--group-size", "2", "--max-tokens", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["p0", "p1", "p2"] and [r["meta"]["answer"] for r in rows] == [0, 1, 2]
    assert all(len(r["samples"]) == 2 for r in rows)
    summary = " ".join(proc.stdout.split())  # rich wraps table cells
    assert "policy context" in summary and "vs group (estimate:" in summary  # the default policy, with its estimate


def test_rollout_by_address_with_a_keys_dir(curve_daemon, tmp_path):
    """From another "host" (no run dir, no config), --address and --keys DIR are enough;
    (the refusal without keys is the next test)."""
    _, info, keys = curve_daemon
    prompts = _prompts(tmp_path / "p.jsonl")
    out = tmp_path / "out.jsonl"
    empty_run_dir = tmp_path / "no-daemon-here"
    proc = seerctl("rollout", "--address", info["client_address"], "--keys", str(keys), "--prompts", str(prompts),
                   "--group-size", "1", "--max-tokens", "8", "--out", str(out), "--run-dir", str(empty_run_dir))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert [len(r["samples"]) for r in _rows(out)] == [1, 1, 1]
    assert not empty_run_dir.exists()  # no embedded daemon was started


def test_rollout_by_address_without_keys_fails_naming_the_timeout(curve_daemon, tmp_path):
    """Without keys the daemon refuses every handshake: exit 1 within the timeout, naming the
    keys (this hung before the client's sends were all made non-blocking; the unit test
    tests/unit/test_client_unreachable.py reproduces it without a daemon)."""
    _, info, _ = curve_daemon
    prompts = _prompts(tmp_path / "p.jsonl")
    refused = seerctl("rollout", "--address", info["client_address"], "--prompts", str(prompts),
                      "--max-tokens", "8", "--out", str(tmp_path / "refused.jsonl"), "--timeout", "3")
    assert refused.returncode == 1
    stderr = " ".join(refused.stderr.split())  # rich wraps long lines
    assert "did not answer" in stderr and "CURVE keys" in stderr


def test_rollout_by_address_needs_an_output_file(curve_daemon, tmp_path):
    """--address without --out is a usage error (there is no run dir to write into)."""
    _, info, keys = curve_daemon
    proc = seerctl("rollout", "--address", info["client_address"], "--keys", str(keys),
                   "--prompts", str(_prompts(tmp_path / "p.jsonl")))
    assert proc.returncode == 2 and "--out" in proc.stderr
