"""The engine backend interface: what the worker loop needs from an inference engine.

Two implementations: ``vllm_backend.VLLMBackend`` (real vLLM; vLLM is imported only by
it, the modules it builds on (``vllm_args.py``, ``vllm_stats.py``, ``vllm_weights.py``),
``kv_connector.py``, ``weight_transfer.py`` and ``vllm_plugin.py``) and
``sim_backend.SimBackend`` (no model; deterministic tokens and a step-time cost model, for
tests and paper-scale simulation). The worker loop (``worker.py``) is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from seer.protocol import ChunkTask, EngineCapabilities, EngineLoad, FinishReason

# Step records a heartbeat carries at most (the most recent): ~8 KB, and more steps than a
# heartbeat interval holds on any engine measured here.
STEPS_KEPT = 512


@dataclass
class ChunkOutput:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each generated token, one per token
    finish_reason: FinishReason  # "stop" (EOS / stop string / stop token), "length" (chunk budget), "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens not computed (prefix cache + host KV pool)
    kv_loaded_tokens: int = 0
    kv_load_failed_tokens: int = 0  # planned pool loads that failed their check (recomputed)
    kv_load_ms: float = 0.0
    kv_saved_tokens: int = 0


class EngineBackend(Protocol):
    async def start(self) -> EngineCapabilities:
        """Load the model and return what the engine can do (called once)."""
        ...

    async def generate(self, task: ChunkTask) -> ChunkOutput:
        """Run one chunk to completion; an aborted task returns finish_reason "abort"."""
        ...

    async def abort(self, task_ids: list[int]) -> None: ...

    def healthy(self) -> bool:
        """False once the engine cannot run anything any more (the worker then exits)."""
        ...

    def load(self) -> EngineLoad:
        """Current load; cheap, called every heartbeat."""
        ...

    async def load_weights(self, path: str) -> None:
        """Load a safetensors checkpoint in place, then drop every cached prefix."""
        ...

    def take_steps(self) -> list[tuple[float, float, float, float]]:
        """The step records since the last call, ``(seconds, batch, KV tokens, prefilled
        tokens)`` of each engine step that followed a busy one (the scheduler fits its step
        cost to them: seer/stepcost.py); cheap, called every heartbeat."""
        ...

    def spec_counts(self) -> tuple[int, int, int]:
        """Cumulative speculative decoding (drafting row-steps, draft tokens, accepted
        draft tokens); zeros when the engine does not speculate."""
        ...

    async def shutdown(self) -> None: ...
