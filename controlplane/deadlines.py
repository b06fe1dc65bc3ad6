"""Chunk deadlines: how long an engine may take for a chunk before it goes elsewhere.

Owns, per engine, the measured time per generated token (from its finished chunks:
``elapsed_ms`` / tokens, so queueing inside the engine's batch counts) and, per chunk
sent, its deadline: ``max(engines.chunk_deadline_min_s, engines.chunk_deadline_factor x
budget x per-token time)``. An engine not measured yet is judged by the slowest engine
measured; with nothing measured anywhere, a chunk gets ``engines.chunk_deadline_unmeasured_s``.
Generous on purpose: a deadline catches an engine that heartbeats but never finishes,
not a slow one. An engine's own ``elapsed_ms`` is trusted only downwards: a chunk's
sample is at most the time the control plane saw between sending it and its result, a
value that is not finite and non-negative is not used, and a result for a chunk never
sent here measures nothing (a broken engine that reported inf or 1e300 would otherwise
have given every chunk an endless deadline, its own and, as the slowest engine, the
unmeasured ones'). What happens to a chunk past its deadline is the server's (it goes back
to the buffer like a failed chunk, its late result is ignored, the engine is marked
unhealthy: see ``Registry.mark_unhealthy``). Pure: the time is passed in.
"""

from __future__ import annotations

import heapq
import math

from seer.config import EnginesConfig

# Weight of the newest chunk in an engine's per-token estimate (an exponential average).
PER_TOKEN_SMOOTHING = 0.2


class ChunkDeadlines:
    def __init__(self, config: EnginesConfig) -> None:
        self.min_s = config.chunk_deadline_min_s
        self.factor = config.chunk_deadline_factor
        self.unmeasured_s = config.chunk_deadline_unmeasured_s
        self.per_token_s: dict[int, float] = {}  # engine id -> measured seconds per token
        self._deadlines: dict[int, tuple[int, float]] = {}  # task id -> (engine id, deadline)
        self._heap: list[tuple[float, int]] = []  # (deadline, task id), lazily cleaned
        # task id -> (engine id, when sent) until its result, a failure or its engine's loss
        # (kept past the deadline: a late result still measures its engine).
        self._sent: dict[int, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def deadline_s(self, engine_id: int, max_tokens: int, now_s: float) -> float:
        per_token = self.per_token_s.get(engine_id)
        if per_token is None and self.per_token_s:
            per_token = max(self.per_token_s.values())
        if per_token is None:
            return now_s + max(self.min_s, self.unmeasured_s)
        return now_s + max(self.min_s, self.factor * max_tokens * per_token)

    def sent(self, engine_id: int, task_id: int, max_tokens: int, now_s: float) -> None:
        """A chunk went to its engine: its clock starts."""
        deadline = self.deadline_s(engine_id, max_tokens, now_s)
        self._deadlines[task_id] = (engine_id, deadline)
        self._sent[task_id] = (engine_id, now_s)
        heapq.heappush(self._heap, (deadline, task_id))

    def finished(self, engine_id: int, task_id: int, num_tokens: int, elapsed_s: float,
                 now_s: float | None = None) -> None:
        """A chunk came back (possibly late): the engine's per-token time is updated.
        ``now_s`` (the server's): the sample is capped by the time seen here, and a chunk
        not sent here measures nothing."""
        self._deadlines.pop(task_id, None)
        sent = self._sent.pop(task_id, None)
        self._compact()
        if not math.isfinite(elapsed_s) or elapsed_s < 0:
            elapsed_s = math.inf  # not used as such: replaced by the time seen here, or dropped
        if now_s is not None:
            if sent is None or sent[0] != engine_id:
                return
            elapsed_s = min(elapsed_s, max(0.0, now_s - sent[1]))
        if not math.isfinite(elapsed_s):
            return
        sample = elapsed_s / max(1, num_tokens)
        old = self.per_token_s.get(engine_id)
        self.per_token_s[engine_id] = sample if old is None else old + PER_TOKEN_SMOOTHING * (sample - old)

    def dropped(self, task_id: int) -> None:
        """A chunk that will not come back (failed, aborted): no deadline to watch."""
        self._deadlines.pop(task_id, None)
        self._sent.pop(task_id, None)

    def engine_gone(self, engine_id: int) -> None:
        """A lost engine's measurement must not judge the others (its chunks are requeued;
        their deadlines run out harmlessly: ``expired`` reports them, the scheduler has
        nothing under those task ids any more)."""
        self.per_token_s.pop(engine_id, None)
        for task_id in [t for t, (e, _) in self._sent.items() if e == engine_id]:
            del self._sent[task_id]

    def _compact(self) -> None:
        """Finished chunks leave their heap entries behind until their deadline: rebuild
        the heap when they dominate, so memory follows the chunks in flight, not the
        chunks of the last deadline's worth of time."""
        if len(self._heap) > 2 * len(self._deadlines) + 1024:
            self._heap = [(deadline, task_id) for task_id, (_, deadline) in self._deadlines.items()]
            heapq.heapify(self._heap)

    def expired(self, now_s: float) -> list[tuple[int, int]]:
        """(engine id, task id) of chunks past their deadline, each reported once."""
        out = []
        while self._heap and self._heap[0][0] <= now_s:
            deadline, task_id = heapq.heappop(self._heap)
            entry = self._deadlines.get(task_id)
            if entry is not None and entry[1] == deadline:
                del self._deadlines[task_id]
                out.append((entry[0], task_id))
        return out
