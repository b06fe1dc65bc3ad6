"""Owns ``SeerCheckpointEngine``: veRL's checkpoint-engine backend ``seer``, which hands the
trainer's weights to Seer's ``update_weights``.

Selected with ``actor_rollout_ref.rollout.checkpoint_engine.backend=seer``; its keyword
arguments come from ``...checkpoint_engine.engine_kwargs.seer`` (``settings.SeerSettings``).
veRL's actor worker calls ``send_weights(actor.engine.get_per_tensor_param(), global_steps)``
on every rank; every rank iterates the generator (FSDP gathers each full tensor
collectively), rank 0 (``is_master``) writes the tensors as one safetensors file under
``weights_dir`` (default /dev/shm) and asks the daemon to load it, then deletes the
previous step's file (the daemon keeps the latest for engines that join later). The
rollout side of veRL (``receive_weights``) gets nothing: Seer's engines, not veRL's
replicas, generate.

This module subclasses verl's ``CheckpointEngine``, so it imports verl and torch at the
top; only ``plugin.py`` (run by ``import verl``) imports it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine
from verl.workers.rollout.utils import ensure_async_iterator

from seer.client import AsyncSeerClient, ClientKeys, SeerError, SeerServiceError, SeerTimeoutError

from .settings import CONFIG_PATH, load_settings

BACKEND = "seer"


class SeerWeightsError(RuntimeError):
    """Seer did not take the trainer's weights; the message names the fix."""


def explain_weights(error: SeerError, path: Path, step: int | None, address: str) -> str:
    what = f"the trainer's weights of step {step} ({path})"
    if isinstance(error, SeerTimeoutError):
        return (f"Seer did not take {what}: the daemon at {address} did not answer ({error}); start it or set "
                f"{CONFIG_PATH}.address / .run_dir")
    if isinstance(error, SeerServiceError) and error.code == "weights_update_failed":
        return (f"Seer could not load {what}: {error.message}; the actor's model (actor_rollout_ref.model.path) must "
                "be the model Seer serves (model.path in seer.toml): same architecture, tensor names and shapes")
    if isinstance(error, SeerServiceError) and error.code == "bad_weights_path":
        return (f"Seer cannot read {what}: {error.message}; set {CONFIG_PATH}.weights_dir to a folder the daemon's "
                "host can read (the default /dev/shm works when the trainer and the daemon share a machine)")
    if isinstance(error, SeerServiceError) and error.code == "rollout_running":
        return (f"Seer refused {what}: a rollout is running on the daemon ({error.message}); weights are updated "
                "between rollouts -- give each trainer its own daemon")
    return f"Seer did not take {what}: {error}"


class SeerCheckpointEngine(CheckpointEngine):
    """Weights from the actor to Seer through a safetensors file and ``update_weights``."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **seer: Any) -> None:
        self.bucket_size = bucket_size  # unused: the whole state goes into one file
        self.is_master = is_master
        self.settings = load_settings(seer)
        self.weights_version: int | None = None
        self._current: Path | None = None

    # veRL's topology hooks: Seer needs no process group between actor and rollout.
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Write (rank 0) and hand to Seer; returns metrics for the trainer's log."""
        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.is_master:
                if not isinstance(tensor, torch.Tensor):
                    raise SeerWeightsError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
                tensors[name] = tensor.detach().to("cpu").contiguous()
        if not self.is_master:
            return {}
        if not tensors:
            raise SeerWeightsError("the actor yielded no weights (get_per_tensor_param was empty); nothing to send")
        path = self._write(tensors, global_steps)
        written = time.perf_counter()
        self.weights_version = await self._update(path, global_steps)
        previous, self._current = self._current, path.parent
        if previous is not None and previous != self._current:
            shutil.rmtree(previous, ignore_errors=True)
        return {
            "seer/weights_version": float(self.weights_version),
            "seer/weights_bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
            "seer/weights_write_s": written - started,
            "seer/weights_update_s": time.perf_counter() - written,
        }

    def _write(self, tensors: dict[str, torch.Tensor], step: int | None) -> Path:
        from safetensors.torch import save_file

        folder = Path(self.settings.weights_dir) / f"seer-verl-step-{step if step is not None else 'x'}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / "model.safetensors"
            save_file(tensors, str(path), metadata={"format": "pt"})
        except OSError as exc:
            raise SeerWeightsError(f"cannot write the weights to {folder}: {exc}; set {CONFIG_PATH}.weights_dir to a "
                                   "writable folder with room for the model (the daemon must read it too)") from None
        return path

    async def _update(self, path: Path, step: int | None) -> int:
        keys = ClientKeys.from_dir(self.settings.keys_dir) if self.settings.keys_dir else None
        try:
            client = AsyncSeerClient(self.settings.address, run_dir=self.settings.run_dir,
                                     timeout_s=self.settings.timeout_s, keys=keys)
        except SeerError as exc:
            raise SeerWeightsError(f"cannot reach Seer to send step {step}'s weights: {exc}; set {CONFIG_PATH}.address "
                                   "or .run_dir to the running daemon") from None
        async with client:
            try:
                # status() first, bounded by timeout_s: a DEALER queues a request for a daemon that
                # is not there, so update_weights alone would wait its whole weights_timeout_s.
                await client.status()
                return await client.update_weights(path, timeout_s=self.settings.weights_timeout_s)
            except SeerError as exc:
                raise SeerWeightsError(explain_weights(exc, path, step, client.address)) from None

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Nothing for veRL's own rollout replicas: Seer's engines get the weights from the file."""
        return
        yield  # an async generator that yields nothing
