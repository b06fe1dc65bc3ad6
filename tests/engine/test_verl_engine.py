"""Runs the real-vLLM veRL tests (tests/verl, marked engine) inside ``.venv-verl``: the
adapter's prompts with the model's own tokenizer, and weights handed to real engines."""

from __future__ import annotations

import pytest

from tests.integration.test_verl_suite import run_verl_tests


@pytest.mark.engine
def test_verl_engine_checks_pass_in_its_own_venv():
    """tests/verl's engine tests pass: real logprobs, a matching weights update, and a mismatching one refused with the fix."""
    proc = run_verl_tests("engine", timeout_s=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout and " skipped" not in proc.stdout, tail
