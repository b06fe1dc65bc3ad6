"""``sticky``: the agentic baseline users run today — least-requests at a trajectory's
first turn, then every later turn on the same engine.

This is veRL's agent loop (``AsyncLLMServerManager``: the first turn of a trajectory to
the server with the fewest requests, later turns to the same server, for its prefix
cache), and what slime's and SkyRL's routers do by trajectory. A turn is one whole
request with the turn's token budget, as under ``request``; nothing is chunked, held or
migrated, and the host KV pool is not used (``WholeRequestPolicy``): a later turn finds its
context in its engine's prefix cache or computes it again. A later turn whose engine was lost goes to the least-loaded live engine. For
single-turn samples it is ``request``.

``request``'s least-requests heap with later turns pinned (``_pinned``): O(log E) per
decision; a pinned turn raises its engine's count, and a later pop re-reads that stale
entry before using it.
"""

from __future__ import annotations

from seer.controlplane.policies.base import register
from seer.controlplane.policies.request import LeastRequestsPolicy
from seer.controlplane.state import Request


@register
class StickyPolicy(LeastRequestsPolicy):
    name = "sticky"

    def _pinned(self, request: Request, live: dict[int, int]) -> int | None:
        pinned = request.engine_history[-1] if request.engine_history else None
        return pinned if pinned in live else None
