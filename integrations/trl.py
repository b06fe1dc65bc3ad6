"""Owns TRL's side of Seer: ``SeerRollout`` (a ``GRPOTrainer(rollout_func=...)``) and
``SeerWeightSync`` (a ``TrainerCallback`` that pushes the policy's weights after every
optimizer step). Verified against TRL 1.16.0 (``pip install 'seer-rollout[trl]'``).

    seer = SeerRollout()                                   # the daemon of ~/.seer/run
    trainer = GRPOTrainer(..., args=GRPOConfig(..., use_vllm=False),
                          rollout_func=seer, callbacks=[seer.weight_sync()])

The rollout follows TRL's own server-mode pattern (``generation/vllm_generation.py``):
every rank tokenizes its slice with the trainer's ``_tokenize_prompts`` (the same chat
template and kwargs TRL uses itself), the batch is gathered on the main process,
de-duplicated into groups of G (``batching.unique_groups``), sent to Seer as ONE rollout,
and the result is broadcast and sliced back so each rank gets its own rows. Only the main
process talks to the daemon; an error there is broadcast and raised on every rank (no rank
is left waiting in a collective).

Guarantees checked here, not assumed: row ``i*G+j`` is sample ``j`` of the ``i``-th distinct
prompt; the returned logprobs are the engine's, one per completion token; every row carries
the ``weights_version`` it was generated with (TRL hands it to reward functions); when a
``SeerWeightSync`` is attached, every rollout ran on the weights it last pushed (the
rollout's ``weights_version`` is compared, a stale one raises).

Weights go to the engines through a shared-memory segment by default (written once,
loaded in place by every engine: ``seer/weights_segment.py``), or as a safetensors file
(``weight_sync(weights_dir=...)``, also the way to keep checkpoints on disk).

torch and TRL are imported lazily (inside functions) or only by the callback's base class,
``transformers.TrainerCallback``; ``seer.client`` stays torch-free.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from transformers import TrainerCallback

from seer.agentic import Environment
from seer.client import SeerClient, SeerError, SeerServiceError, SeerTimeoutError
from seer.integrations.batching import (
    SeerIntegrationError,
    process_slice,
    rows_from_groups,
    sampling_from_settings,
    unique_groups,
)
from seer.integrations.weights import policy_tensors, write_segment
from seer.protocol import EngineCapabilities, TrajectorySpec
from seer.weights_segment import SegmentWriter

log = structlog.get_logger(__name__)

SEED_STRIDE = 1_000_003  # rollout seed = args.seed * SEED_STRIDE + global_step (distinct per step)


@dataclass
class RolloutTiming:
    """One rollout call on the main process: seconds in Seer and what it produced."""

    global_step: int
    seconds: float
    num_groups: int
    num_output_tokens: int
    weights_version: int
    num_turns: int = 0  # model turns over all samples (trajectories; 0 for single-turn samples)


@dataclass
class SyncTiming:
    """One weight push: seconds to write the weights (segment or file) and for ``update_weights``."""

    global_step: int
    write_s: float
    update_s: float
    num_bytes: int
    weights_version: int
    transport: str = "shm"  # "shm" (shared-memory segment) or "file" (safetensors)


@dataclass
class SeerRollout:
    """TRL ``rollout_func``: ``f(prompts, trainer) -> {prompt_ids, completion_ids, logprobs}``.

    ``address`` / ``run_dir`` / ``timeout_s``: as ``SeerClient``. ``policy``: a Seer
    scheduling policy (None: the daemon's default). ``env`` / ``trajectory``: every sample
    is a multi-turn trajectory (``seer.agentic``; docs/client.md "Agentic rollouts"); TRL
    then gets ``env_mask`` (its loss mask for appended tokens) and the extra fields
    ``env_reward`` and ``num_turns``, which reach its reward functions as keyword arguments.
    """

    address: str | None = None
    run_dir: str | None = None
    timeout_s: float = 60.0
    policy: str | None = None
    env: Environment | None = None
    trajectory: TrajectorySpec | None = None
    rollouts: list[RolloutTiming] = field(default_factory=list)
    _client: SeerClient | None = field(default=None, repr=False)
    _capabilities: EngineCapabilities | None = field(default=None, repr=False)
    sync: SeerWeightSync | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ the daemon
    def client(self) -> SeerClient:
        if self._client is None:
            try:
                self._client = SeerClient(self.address, run_dir=self.run_dir, timeout_s=self.timeout_s)
            except SeerError as exc:
                raise SeerIntegrationError(f"cannot reach the Seer daemon: {exc}") from None
        return self._client

    def capabilities(self) -> EngineCapabilities:
        """The served model's limits, from the daemon (cached); a daemon that is down raises with the fix."""
        if self._capabilities is None:
            client = self.client()
            try:
                status = client.status()
            except SeerTimeoutError:
                raise SeerIntegrationError(
                    f"the Seer daemon at {client.address} did not answer within {self.timeout_s:g} s: start it "
                    f"with `seerctl start --config seer.toml` (serving the trainer's model) or pass "
                    f"SeerRollout(address=...) / run_dir=") from None
            ready = [e.capabilities for e in status.engines if e.state == "ready" and e.capabilities is not None]
            if not ready:
                raise SeerIntegrationError(f"the Seer daemon at {client.address} has no ready engine "
                                           f"(`seerctl status`); wait for its engines or restart it")
            self._capabilities = ready[0]
        return self._capabilities

    def check_model(self, vocab_size: int, max_completion_length: int | None) -> None:
        """Refuse a trainer model the daemon does not serve (vocabulary) or a length it cannot fit."""
        caps = self.capabilities()
        if vocab_size != caps.vocab_size:
            raise SeerIntegrationError(
                f"the trainer's model has vocab_size={vocab_size} but the Seer daemon serves {caps.model} with "
                f"vocab_size={caps.vocab_size}: start the daemon with the trainer's model ([model] path in "
                f"seer.toml)")
        if max_completion_length is not None and max_completion_length >= caps.max_model_len:
            raise SeerIntegrationError(
                f"max_completion_length={max_completion_length} leaves no room for a prompt in the daemon's "
                f"max_model_len={caps.max_model_len}: lower max_completion_length or raise [model] max_model_len")

    def weight_sync(self, weights_dir: str | None = None, sync_at_start: bool = True,
                    transport: str = "auto") -> SeerWeightSync:
        """The callback that keeps the daemon's weights equal to the trainer's (pass it in
        ``callbacks``). ``transport``: "shm" (a shared-memory segment), "file" (a safetensors
        file in ``weights_dir``); "auto": "file" when ``weights_dir`` is given, else "shm"."""
        self.sync = SeerWeightSync(self, weights_dir=weights_dir, sync_at_start=sync_at_start, transport=transport)
        return self.sync

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ TRL's seam
    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        from accelerate.utils import broadcast_object_list, gather_object

        args = trainer.args
        if getattr(trainer, "use_vllm", False):
            raise SeerIntegrationError("use_vllm=True: Seer replaces TRL's vLLM generation; set use_vllm=False in "
                                       "GRPOConfig when passing rollout_func=SeerRollout(...)")
        group_size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        seed = None if args.seed is None else args.seed * SEED_STRIDE + trainer.state.global_step
        sampling = sampling_from_settings(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_completion_length=args.max_completion_length, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, generation_kwargs=args.generation_kwargs, seed=seed)
        prompt_ids, images, _ = trainer._tokenize_prompts(prompts)
        if images is not None:
            raise SeerIntegrationError("the batch holds images: Seer serves text-only models; use a text dataset")
        accelerator = trainer.accelerator
        all_prompt_ids = gather_object([list(ids) for ids in prompt_ids])
        payload: tuple[str, Any] | None = None
        if accelerator.is_main_process:
            try:
                payload = ("ok", self._generate(all_prompt_ids, group_size, sampling, trainer))
            except (SeerIntegrationError, SeerError) as exc:
                payload = ("error", str(exc))
        box = [payload]
        broadcast_object_list(box, from_process=0)
        status, body = box[0]
        if status == "error":
            raise SeerIntegrationError(body)
        rows = process_slice(accelerator.process_index, len(prompts))
        return {key: values[rows] for key, values in body.items()}

    def _generate(self, all_prompt_ids: list[list[int]], group_size: int, sampling: Any,
                  trainer: Any) -> dict[str, list]:
        groups = unique_groups(all_prompt_ids, group_size)
        if self._capabilities is None:
            self.check_model(trainer.model.config.vocab_size, trainer.args.max_completion_length)
        caps = self.capabilities()
        longest = max(len(p) for p in groups)
        if longest + sampling.max_tokens > caps.max_model_len:
            raise SeerIntegrationError(
                f"a prompt of {longest} tokens + max_completion_length={sampling.max_tokens} exceeds the daemon's "
                f"max_model_len={caps.max_model_len}: set max_prompt_length / shorter prompts, lower "
                f"max_completion_length, or raise [model] max_model_len")
        client = self.client()
        t0 = time.perf_counter()
        try:
            result = client.rollout([{"prompt_token_ids": p} for p in groups], group_size, sampling=sampling,
                                    policy=self.policy, env=self.env, trajectory=self.trajectory)
        except SeerTimeoutError as exc:
            raise SeerIntegrationError(f"the Seer daemon at {client.address} stopped answering during the "
                                       f"rollout ({exc}): check `seerctl status` / its log, restart it with "
                                       f"`seerctl start`") from None
        except SeerServiceError as exc:
            raise SeerIntegrationError(f"Seer refused the rollout: {exc}") from None
        seconds = time.perf_counter() - t0
        if self.sync is not None and self.sync.weights_version is not None \
                and result.weights_version != self.sync.weights_version:
            raise SeerIntegrationError(
                f"the rollout ran on weights_version {result.weights_version} but the trainer last pushed "
                f"version {self.sync.weights_version}: another client updated the daemon's weights; give each "
                f"trainer its own daemon")
        num_turns = sum(len(s.turns) for g in result.groups for s in g.samples)
        self.rollouts.append(RolloutTiming(trainer.state.global_step, seconds, len(groups),
                                           result.stats.num_output_tokens, result.weights_version, num_turns))
        log.info("trl_rollout_finished", global_step=trainer.state.global_step, num_groups=len(groups),
                 group_size=group_size, num_output_tokens=result.stats.num_output_tokens,
                 weights_version=result.weights_version, latency_ms=round(seconds * 1000, 1),
                 num_turns=num_turns or None)
        rows = rows_from_groups(groups, result.groups, group_size)
        rows["weights_version"] = [result.weights_version] * len(rows["prompt_ids"])  # per sample (the fence)
        return rows


def default_weights_dir() -> Path:
    """A fresh folder in /dev/shm (RAM, no disk write) when it exists, else in the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    folder = Path(tempfile.mkdtemp(prefix="seer-trl-weights-", dir=base))
    # on_train_end removes it; this covers a trainer that raises or exits before that (not SIGKILL).
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def write_weights(model: Any, folder: Path) -> tuple[Path, int]:
    """The model's weights as ``folder/model.safetensors`` (tied tensors stored once, under
    their first name, as the served checkpoint has them); written then renamed, so the
    daemon never reads a half-written file. Returns the path and its size in bytes."""
    from safetensors.torch import save_file

    path, partial = folder / "model.safetensors", folder / "model.safetensors.partial"
    save_file(dict(policy_tensors(model)), str(partial))
    os.replace(partial, path)
    return path, path.stat().st_size


class SeerWeightSync(TrainerCallback):
    """After every optimizer step, send the policy's weights and load them into Seer's engines.

    Made by ``SeerRollout.weight_sync()``. With ``sync_at_start`` the trainer's initial
    weights are pushed before the first rollout, so even step 0 runs on the trainer's own
    weights (not whatever the daemon loaded at start). Runs on the main process only; the
    other ranks wait in the next rollout's gather. Not for sharded models (FSDP/ZeRO-3) or
    PEFT adapters (the callback refuses a PEFT model).

    ``transport="shm"``: every tensor is copied once into a shared-memory segment (two used
    in turn, ``seer/weights_segment.py``) that the engines load in place. ``"file"``: a
    safetensors file in ``weights_dir`` (a fresh folder in /dev/shm by default).
    """

    def __init__(self, rollout: SeerRollout, weights_dir: str | None = None, sync_at_start: bool = True,
                 transport: str = "auto") -> None:
        if transport not in ("auto", "shm", "file"):
            raise SeerIntegrationError(f"transport={transport!r}: use 'shm', 'file' or 'auto'")
        self.rollout = rollout
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.transport = ("file" if weights_dir else "shm") if transport == "auto" else transport
        self.sync_at_start = sync_at_start
        self.weights_version: int | None = None
        self.syncs: list[SyncTiming] = []
        self._owns_dir = weights_dir is None
        self._writer: SegmentWriter | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001 (TRL's signature)
        if not state.is_world_process_zero:
            return
        if hasattr(model, "peft_config"):
            raise SeerIntegrationError("the model is a PEFT model: SeerWeightSync pushes full weights only; "
                                       "merge the adapter (model.merge_and_unload()) or train without PEFT")
        self.rollout.check_model(model.config.vocab_size, getattr(args, "max_completion_length", None))
        if self.sync_at_start:
            self.push(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        if state.is_world_process_zero:
            self.push(model, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.close()

    def close(self) -> None:
        """Remove what the pushes left: the segments, or the folder this callback made."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._owns_dir and self.weights_dir is not None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
            self.weights_dir = None

    def _write(self, model: Any) -> tuple[Any, int]:
        if self.transport == "shm":
            if self._writer is None:
                self._writer = SegmentWriter()
                atexit.register(self._writer.close)  # a trainer that raises before on_train_end
            return write_segment(self._writer, model)
        if self.weights_dir is None:
            self.weights_dir = default_weights_dir()
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        return write_weights(model, self.weights_dir)

    def push(self, model: Any, global_step: int) -> int:
        """Send ``model``'s weights and ``update_weights`` them; the new version (checked to increase)."""
        t0 = time.perf_counter()
        source, num_bytes = self._write(model)
        t1 = time.perf_counter()
        client = self.rollout.client()
        try:
            version = client.update_weights(source)
        except SeerTimeoutError:
            raise SeerIntegrationError(f"the Seer daemon at {client.address} did not answer the weights update: "
                                       f"check `seerctl status`; restart it with `seerctl start`") from None
        except SeerServiceError as exc:
            fix = {"weights_update_failed": "the daemon must serve the trainer's model architecture "
                                            "([model] path in seer.toml); no tensor may be added or renamed",
                   "bad_weights_path": "the daemon must run on the trainer's host (it maps the segment in /dev/shm "
                                       "or reads the file by path), or pass weight_sync(weights_dir=...) on a "
                                       "filesystem both share",
                   "rollout_running": "another client's rollout is running: give each trainer its own daemon",
                   "busy": "another weights update or an engine's catch-up load is running: retry"}
            raise SeerIntegrationError(f"Seer refused the weights {source}: {exc.message} -- fix: "
                                       f"{fix.get(exc.code, 'see the daemon log')}") from None
        t2 = time.perf_counter()
        if self._writer is not None and self.transport == "shm":
            self._writer.accepted()
        if self.weights_version is not None and version <= self.weights_version:
            raise SeerIntegrationError(f"weights_version went from {self.weights_version} to {version}: another "
                                       f"client reloaded the daemon; give each trainer its own daemon")
        self.weights_version = version
        self.syncs.append(SyncTiming(global_step, t1 - t0, t2 - t1, num_bytes, version, self.transport))
        log.info("trl_weights_synced", global_step=global_step, weights_version=version, num_bytes=num_bytes,
                 transport=self.transport, write_ms=round((t1 - t0) * 1000, 1),
                 update_ms=round((t2 - t1) * 1000, 1))
        return version


__all__ = ["RolloutTiming", "SeerRollout", "SeerWeightSync", "SyncTiming", "default_weights_dir",
           "write_weights"]
