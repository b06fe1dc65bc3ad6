"""Weight updates inside a vLLM worker, through vLLM's own weight-transfer API.

Owns: Seer's shared-memory engine for vLLM's ``vllm.distributed.weight_transfer``
(``SharedMemoryWeightTransferEngine``, registered in vLLM's factory as ``seer_shm`` by
``vllm_plugin.py``) and the repairs an in-place update needs on this vLLM
(``refresh_tied_heads``, ``unwind_layerwise_reload``). Runs in vLLM's worker process;
imported by vLLM's factory and by the worker extension (``vllm_worker_ext.py``).

vLLM's protocol has four phases around a paused engine: ``init_weight_transfer_engine``
once, then per update ``start_weight_update`` (layerwise reload: every layer's tensors
move to the meta device and its weight loaders buffer until the layer is complete),
``update_weights`` (one or more chunks), ``finish_weight_update`` (layers that got
nothing get their old tensors back; attention layers are processed). The engine driver
(``VLLMBackend.load_weights``) pauses generation around the whole sequence and checks
the manifest against the served model before the first phase, so a mismatch never
reaches the model.

The shared-memory engine's chunk is ``{"segment", "generation"}``: the worker maps the
trainer's segment read-only (``seer.weights_segment``), builds tensor views on it and
hands them to ``model.load_weights``, whose loaders copy each tensor once into the
model's own storage. It checks the segment's generation before and after, so a segment
rewritten during the load fails the update instead of loading a mix of two steps.

The engine is device-agnostic: on a GPU the loaders copy the host views to the device.
vLLM's own CUDA engines (``ipc``, ``nccl``) would skip that host copy, but their phases
must be driven from the trainer (NCCL: the workers' receive runs concurrently with the
trainer's broadcast; IPC: pickled CUDA handles), and Seer's daemon relays one whole
update per ``LoadWeights``, not those phases (docs/integrations.md, "TRL").
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from seer.weights_segment import SegmentReader, SegmentSource

BACKEND_NAME = "seer_shm"
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


def segment_tensors(reader: SegmentReader) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views on a mapped segment, in manifest order; no bytes copied."""
    with warnings.catch_warnings():
        # The mapping is read-only on purpose; the loaders only read from these views.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for entry in reader.entries:
            dtype = _TORCH_DTYPES[entry.dtype]
            count = entry.num_bytes // dtype.itemsize
            view = torch.frombuffer(reader.buffer, dtype=dtype, count=count, offset=entry.offset)
            yield entry.name, view.view(entry.shape)


def refresh_tied_heads(model: torch.nn.Module) -> None:
    """Rebuild the CPU GEMM handle of a tied ``lm_head`` after an in-place update.

    A tied head (SmolLM2: ``tie_word_embeddings``) gets no tensor of its own, so vLLM's
    layerwise reload never re-runs its ``process_weights_after_loading``, and on a CPU that
    is what packs the weight into the handle the logits use: without this the logits keep
    the old embedding."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)


def unwind_layerwise_reload(model: torch.nn.Module, model_config) -> None:
    """End a layerwise reload that stopped half way (a chunk raised): every layer gets a
    real tensor again and its loaders back. Layers the update completed hold new
    weights and a half-loaded layer holds garbage, so the caller must reload a whole
    checkpoint after this; it never serves the model as it is."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the trainer and the engines share the host's memory."""


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    segment: str  # the segment's name under /dev/shm
    generation: int  # the write the engines must find in it


class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """vLLM weight-transfer engine ``seer_shm``: loads a trainer's weights segment in place."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        reader = SegmentReader(SegmentSource(update_info.segment, update_info.generation))
        try:
            self.model.load_weights(segment_tensors(reader))
            reader.check_generation()  # rewritten while we copied: the model holds a mix, fail
        finally:
            reader.close()

    def update_weights(self, update_info: dict) -> None:
        # vLLM's default ends with torch.accelerator.synchronize(), which has nothing to
        # wait for on a CPU (the loaders' copies are synchronous).
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_heads(self.model)

    def shutdown(self) -> None:
        pass


__all__ = ["BACKEND_NAME", "SharedMemoryInitInfo", "SharedMemoryUpdateInfo", "SharedMemoryWeightTransferEngine",
           "refresh_tied_heads", "segment_tensors", "unwind_layerwise_reload"]
