"""``sticky``: the agentic baseline users run today — least-requests at a trajectory's
first turn, then every later turn on the same engine.

This is veRL's agent loop (``AsyncLLMServerManager``: the first turn of a trajectory to
the server with the fewest requests, later turns to the same server, for its prefix
cache), and what slime's and SkyRL's routers do by trajectory. A turn is one whole
request with the turn's token budget, as under ``request``; nothing is chunked, held or
migrated. A later turn whose engine was lost goes to the least-loaded live engine. For
single-turn samples it is ``request``.

Per round: a heap of (in flight, engine id) over the live engines, so O(log E) per
decision (a pinned turn adds one to its engine's count: a later pop sees a stale entry
of that engine, which is only a tie-break difference, as in ``request``).
"""

from __future__ import annotations

import heapq

from seer.controlplane.policies.base import Assignment, WholeRequestPolicy, register
from seer.controlplane.state import EngineView


@register
class StickyPolicy(WholeRequestPolicy):
    name = "sticky"

    def assign(self, engines: list[EngineView]) -> list[Assignment]:
        if not engines or not len(self._buffer):
            return []
        inflight = {e.engine_id: e.num_inflight for e in engines}
        load = [(n, engine_id) for engine_id, n in inflight.items()]
        heapq.heapify(load)
        out: list[Assignment] = []
        for request in self._buffer.requests():  # arrival order
            pinned = request.engine_history[-1] if request.engine_history else None
            if pinned in inflight:
                engine_id = pinned
            else:
                while load[0][0] != inflight[load[0][1]]:  # stale: a pinned turn raised it
                    n, e = load[0]
                    heapq.heapreplace(load, (inflight[e], e))
                engine_id = load[0][1]
                heapq.heapreplace(load, (inflight[engine_id] + 1, engine_id))
            inflight[engine_id] += 1
            self._buffer.remove(request)
            out.append(Assignment(request, engine_id, request.remaining_tokens))
        return out
