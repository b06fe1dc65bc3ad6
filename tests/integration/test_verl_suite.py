"""Runs the veRL integration tests (tests/verl) inside ``.venv-verl`` against a sim daemon
of this venv; fails, never skips, when ``.venv-verl`` is missing (scripts/setup.sh makes it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"


def run_verl_tests(marker: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    assert VERL_PYTHON.exists(), (f"{VERL_PYTHON} is missing: run `bash scripts/setup.sh` (it creates .venv-verl "
                                  "with veRL 0.9.1 for the integration tests)")
    env = {**os.environ, "SEER_DAEMON_PYTHON": sys.executable}
    return subprocess.run([str(VERL_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker,
                           "tests/verl"], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)


def test_verl_integration_suite_passes_in_its_own_venv():
    """Every non-engine test of tests/verl passes under veRL 0.9.1 (DataProto, plugin loader, registry) with a real sim daemon."""
    proc = run_verl_tests("not engine", timeout_s=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout and " skipped" not in proc.stdout, tail
