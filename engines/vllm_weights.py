"""Checking and loading a weights source into a running vLLM engine.

Owns what a weight update must match (the served model's tensor names and shapes, read
from safetensors headers) and the loaders for the two kinds of source
(``seer.weights_segment``): a safetensors checkpoint path, reloaded in place through
the worker extension (``vllm_worker_ext.py``), and a trainer's shared-memory segment,
through vLLM's weight-transfer API (``weight_transfer.py``). ``VLLMBackend.load_weights``
orchestrates an update (pause, load, restore on failure, resume) around them. Runs in
the engine process.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

from seer.weights_segment import SegmentReader, SegmentSource, WeightsSegmentError

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

# A checked update, ready to run with generation paused.
WeightsLoad = Callable[[], Awaitable[None]]
# Tensor name -> shape.
Shapes = dict[str, list[int]]


def tensor_shapes(files: list[Path]) -> Shapes:
    """Name -> shape of every tensor in safetensors files, from the headers only
    (8-byte little-endian header length, then a JSON header)."""
    shapes: Shapes = {}
    for f in files:
        with f.open("rb") as fh:
            # Capped: a non-safetensors file would announce an absurd header length.
            header = json.loads(fh.read(min(int.from_bytes(fh.read(8), "little"), 1 << 27)))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def expected_shapes(model_path: str) -> Shapes | None:
    """What every weight update must match: the served model's tensors (None, no check,
    for a model that is not a local folder). vLLM only warns on missing tensors (a partly
    loaded stacked layer is left uninitialised) and dies on unknown or mis-shaped ones
    with the model half-reloaded, so those are refused up front."""
    local = Path(model_path)
    return tensor_shapes(sorted(local.glob("*.safetensors"))) if local.is_dir() else None


def check_shapes(want: Shapes | None, got: Shapes, path: str) -> None:
    if want is None:
        return
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    reshaped = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    if missing or extra or reshaped:
        raise RuntimeError(
            f"weights {path} do not match the served model's tensors: {len(missing)} missing "
            f"{missing[:3]}, {len(extra)} unknown {extra[:3]}, {len(reshaped)} of another shape "
            f"{reshaped[:3]}"
        )


def check_tensors(want: Shapes | None, files: list[Path], path: str) -> None:
    try:
        got = tensor_shapes(files)
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"weights {path} are not a readable safetensors checkpoint: {e}") from e
    check_shapes(want, got, path)


def segment_loader(engine: AsyncLLM, source: SegmentSource, want: Shapes | None) -> WeightsLoad:
    """Checks the segment's manifest against the served model now; the loader runs
    vLLM's four phases (engines/weight_transfer.py) with the segment as one chunk."""
    try:
        reader = SegmentReader(source, populate=False)  # the manifest only
    except WeightsSegmentError as e:
        raise RuntimeError(str(e)) from None
    try:
        check_shapes(want, reader.shapes(), str(source))
    finally:
        reader.close()

    async def load() -> None:
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(
            update_info={"segment": source.segment, "generation": source.generation}))
        await engine.finish_weight_update()

    return load


def file_loader(engine: AsyncLLM, path: str, want: Shapes | None) -> WeightsLoad:
    """Checks the checkpoint's tensors now; the loader is vLLM's in-place reload
    (``SeerWorkerExtension.seer_reload_weights``)."""
    src = Path(path)
    files = sorted(src.glob("*.safetensors")) if src.is_dir() else [src]
    if not src.exists() or not files or files[0].suffix != ".safetensors":
        what = "is not a .safetensors file or a folder holding some" if src.exists() else "does not exist"
        raise RuntimeError(f"weights path {path} {what}")
    check_tensors(want, files, path)

    async def load() -> None:
        # vLLM's reload_weights(weights_path=...) makes weights_path the model "name"
        # and globs *.safetensors in it: it must be a folder (a file path is taken for
        # a Hugging Face repo id). A lone file is served through a folder of its own.
        tmp: str | None = None
        folder = src if src.is_dir() else src.parent
        if not src.is_dir() and sorted(folder.glob("*.safetensors")) != [src]:
            tmp = tempfile.mkdtemp(prefix="seer-weights-")
            (Path(tmp) / src.name).symlink_to(src.resolve())
            folder = Path(tmp)
        try:
            await engine.collective_rpc("seer_reload_weights", kwargs={"weights_path": str(folder)})
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    return load


__all__ = ["Shapes", "WeightsLoad", "check_shapes", "check_tensors", "expected_shapes", "file_loader",
           "segment_loader", "tensor_shapes"]
