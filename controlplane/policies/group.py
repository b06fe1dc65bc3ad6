"""``group``: the veRL baseline — whole groups, round-robin, no chunking.

This is how veRL (and OpenRLHF, slime) drive vLLM in synchronous rollout: the batch is
split across engine instances at the start, every prompt's G samples go to one engine
together (so the engine shares the prompt prefix), each with the full ``max_tokens``
budget, and the engine's own continuous batching does the rest. Nothing is held back
and nothing migrates; an engine that runs out of KV preempts inside vLLM. Groups are
dealt round-robin in prompt order, which balances group *counts*, not lengths — the
imbalance Seer sets out to remove. If an engine is lost, its unfinished samples are
re-dealt the same way, from their last completed chunk (under this policy a sample
is a single chunk, so in practice from scratch).
"""

from __future__ import annotations

import sys

from seer.config import SchedulerConfig
from seer.controlplane.policies.base import Assignment, WholeRequestPolicy, register
from seer.controlplane.state import EngineView


@register
class GroupRoundRobinPolicy(WholeRequestPolicy):
    name = "group"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._next = 0

    def assign(self, engines: list[EngineView], limit: int = sys.maxsize) -> list[Assignment]:
        if not engines:
            return []
        out: list[Assignment] = []
        for _group, waiting in self._buffer.by_group():
            if len(out) >= limit:
                break
            engine = engines[self._next % len(engines)]
            self._next += 1
            for request in waiting:
                self._buffer.remove(request)
                out.append(Assignment(request, engine.engine_id, request.remaining_tokens))
        return out
