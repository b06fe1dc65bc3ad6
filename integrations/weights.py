"""The trainer's side of a weight push: which tensors a policy sends, and their bytes.

Owns: the policy's tensors as the served checkpoint names them (a tied weight, e.g.
SmolLM2's ``lm_head`` = ``embed_tokens``, once, under its first name), their
safetensors dtype codes, and their bytes as buffers for ``seer.weights_segment``'s writer
(no copy before the one into the segment). torch is imported lazily: the module loads
without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from seer.weights_segment import SegmentSource, SegmentWriter

_DTYPE_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def policy_tensors(model: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of ``model.state_dict()``, detached, contiguous, on the CPU; a
    tensor shared by several names (tied weights) only under its first name."""
    tensors, seen = [], set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:  # a tied weight: the checkpoint holds it once
            continue
        seen.add(key)
        tensors.append((name, tensor.detach().contiguous().cpu()))
    return tensors


def dtype_code(tensor: Any) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPE_CODES:
        raise ValueError(f"cannot send a {name} tensor; Seer's weight segment holds {sorted(_DTYPE_CODES)}")
    return _DTYPE_CODES[name]


def segment_items(tensors: list[tuple[str, Any]]) -> Iterator[tuple[str, str, tuple[int, ...], memoryview]]:
    """What ``SegmentWriter.write`` takes: name, dtype code, shape and the tensor's bytes
    (a view of its storage: ``uint8`` reinterpretation, which also covers bfloat16)."""
    import torch

    for name, tensor in tensors:
        raw = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        yield name, dtype_code(tensor), tuple(tensor.shape), memoryview(raw.numpy())


def write_segment(writer: SegmentWriter, model: Any) -> tuple[SegmentSource, int]:
    """``model``'s weights into ``writer``'s next segment; the source and the bytes written."""
    tensors = policy_tensors(model)
    source = writer.write(segment_items(tensors))
    return source, sum(t.numel() * t.element_size() for _, t in tensors)


__all__ = ["dtype_code", "policy_tensors", "segment_items", "write_segment"]
