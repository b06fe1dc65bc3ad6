"""The orders of the chunked policies.

* ``divided`` — Seer's divided rollout alone: waiting requests are served in arrival
  order (first come, first served), with chunking, admission and placement from
  ``ChunkedPolicy``.
* ``context`` — divided rollout + context-aware scheduling: the first request of every
  group is its *probe*; probes are served first, smallest generated length first, so
  short groups finish early and long groups reveal themselves. Every other request is
  served longest-estimate first, where a group's estimate L̂ is the longest finished
  sample of the group so far, or the request's full budget while nothing has finished.
  Every ``starvation_interval``-th dispatch goes to the waiting request of the group that
  has received the least service (generated tokens) so far. Ties: lower group index,
  then lower sample index (deterministic).
* ``oracle`` — divided rollout + longest *true* remaining length first (true lengths
  come from a trace; only simulations have them). The upper bound for ``context``.

Queues are heaps with lazy re-keying: an entry whose key is stale (the group's
estimate grew, or a probe generated more) is pushed back with its current key when it
reaches the top, so each round costs O(log n) per dispatch, not a sort of everything.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from seer.config import SchedulerConfig
from seer.controlplane.policies.chunked import ChunkedPolicy, is_live
from seer.controlplane.state import Group, Request, RequestState


class DividedPolicy(ChunkedPolicy):
    name = "divided"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._queue: deque[Request] = deque()

    def _push(self, request: Request) -> None:
        self._queue.append(request)

    def _pop(self) -> Request | None:
        return self._queue.popleft() if self._queue else None

    def _unpop(self, request: Request) -> None:
        self._queue.appendleft(request)


def group_estimate(group: Group, request: Request) -> int:
    """L̂: the longest finished sample of the group, else the request's full budget."""
    finished = [r.num_generated_tokens for r in group.requests if r.state is RequestState.FINISHED
                and r.finish_reason != "abort"]
    return max(finished) if finished else request.sampling.max_tokens


class _HeapPolicy(ChunkedPolicy):
    """A priority queue of (key, tie-break, request) with lazy re-keying."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._heap: list[tuple[tuple, int, Request]] = []
        self._seq = itertools.count()

    def _key(self, request: Request) -> tuple:
        raise NotImplementedError

    def _push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), next(self._seq), request))

    def _unpop(self, request: Request) -> None:
        self._push(request)

    def _pop(self) -> Request | None:
        while self._heap:
            key, _, request = heapq.heappop(self._heap)
            if is_live(request):
                current = self._key(request)
                if current != key:  # stale: re-key and look again
                    heapq.heappush(self._heap, (current, next(self._seq), request))
                    continue
            return request
        return None


class ContextPolicy(_HeapPolicy):
    name = "context"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._num_dispatched = 0
        self._service: dict[str, int] = {}  # group_id -> tokens generated so far (at dispatch)

    def _key(self, request: Request) -> tuple:
        g = request.group
        if request.sample_index == 0:  # the probe: high priority, smallest generated first
            return (0, request.num_generated_tokens, g.group_index, request.sample_index)
        return (1, -group_estimate(g, request), g.group_index, request.sample_index)

    def _pop(self) -> Request | None:
        interval = self.config.starvation_interval
        if interval and self._num_dispatched and self._num_dispatched % interval == 0:
            starved = self._least_served()
            if starved is not None:
                return starved
        return super()._pop()

    def _least_served(self) -> Request | None:
        best: tuple[int, int, int] | None = None
        chosen: Request | None = None
        for _, _, request in self._heap:
            if not is_live(request):
                continue
            key = (self._service.get(request.group.group_id, 0), request.group.group_index, request.sample_index)
            if best is None or key < best:
                best, chosen = key, request
        if chosen is not None:
            self._heap = [entry for entry in self._heap if entry[2] is not chosen]
            heapq.heapify(self._heap)
        return chosen

    def _dispatched(self, request: Request) -> None:
        self._num_dispatched += 1
        gid = request.group.group_id
        self._service[gid] = sum(r.num_generated_tokens for r in request.group.requests)


class OraclePolicy(_HeapPolicy):
    name = "oracle"

    def _key(self, request: Request) -> tuple:
        if request.oracle_length is None:
            raise ValueError(f"the oracle policy needs true output lengths (request {request.request_id} has none); "
                             "it runs only in simulations driven by a trace")
        remaining = request.oracle_length - request.num_generated_tokens
        return (-remaining, request.group.group_index, request.sample_index)
