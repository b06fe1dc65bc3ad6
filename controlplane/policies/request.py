"""``request``: the baseline users run today — per-sample least-requests routing.

Owns the order and routing of the ``request`` policy. This is how veRL's agent-loop
rollout (``AsyncLLMServerManager``, "least requests load balancing") and vLLM's
data-parallel serving drive engines: every *sample* is its own request with the full
``max_tokens`` budget, sent as soon as it is submitted to the engine with the fewest
requests in flight (ties: lower engine id). Samples of one group may land on different
engines. Nothing is chunked, held back or migrated; admission and preemption are the
engine's own (vLLM's continuous batching), exactly as under ``group``. A sample lost with
its engine is re-routed the same way, from its last completed chunk (under this policy
a sample is a single chunk, so in practice from scratch).

Per round: a heap of (in flight, engine id) over the live engines, one pop and push per
waiting request, so O(log E) per decision.
"""

from __future__ import annotations

import heapq
import sys

from seer.controlplane.policies.base import Assignment, WholeRequestPolicy, register
from seer.controlplane.state import EngineView, Request


@register
class LeastRequestsPolicy(WholeRequestPolicy):
    name = "request"

    def assign(self, engines: list[EngineView], limit: int = sys.maxsize) -> list[Assignment]:
        if not engines or not len(self._buffer):
            return []
        inflight = {e.engine_id: e.num_inflight for e in engines}
        load = [(n, engine_id) for engine_id, n in inflight.items()]
        heapq.heapify(load)
        out: list[Assignment] = []
        for request in self._buffer.requests():  # arrival order
            if len(out) >= limit:
                break
            engine_id = self._pinned(request, inflight)
            if engine_id is None:
                while load[0][0] != inflight[load[0][1]]:  # stale: a pinned request raised it
                    heapq.heapreplace(load, (inflight[load[0][1]], load[0][1]))
                engine_id = load[0][1]
                heapq.heapreplace(load, (inflight[engine_id] + 1, engine_id))
            inflight[engine_id] += 1
            self._buffer.remove(request)
            out.append(Assignment(request, engine_id, request.remaining_tokens))
        return out

    def _pinned(self, request: Request, live: dict[int, int]) -> int | None:
        """The engine ``request`` must go to, if one of ``live`` (keyed by engine id);
        None: the least-loaded one. Least-requests pins nothing; ``sticky`` pins later turns."""
        return None
