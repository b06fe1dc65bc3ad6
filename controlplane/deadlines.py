"""How long an engine may take for a chunk, and when an engine has stopped making progress.

Owns, per engine, the measured time per generated token (from its finished chunks:
``elapsed_ms`` / tokens, so queueing inside the engine's batch counts), when it last
answered a chunk, and every chunk in flight (engine, when sent, budget). Two judgements,
both recomputed from the current measurements whenever they are asked (a chunk sent
before anything was measured is judged by what was measured since):

- **deadline** of a chunk: sent + ``max(engines.chunk_deadline_min_s,
  engines.chunk_deadline_factor x budget x seconds per token)``, the seconds per token
  being the engine's own when it has finished a chunk, else the fleet's (the slowest
  measured engine); with nothing measured anywhere, sent +
  ``engines.chunk_deadline_unmeasured_s``. Generous: it catches one chunk that never
  ends, not a slow engine (``expired``).
- **stall** of an engine (``stalled``): it has chunks in flight and has answered none of
  them (no result, no failure) for ``max(engines.stall_heartbeats x
  engines.heartbeat_interval_s, engines.stall_factor x budget x seconds per token)``,
  budget of its oldest chunk in flight, counted from that chunk's dispatch or the
  engine's last answer, whichever is later; and meanwhile another engine did answer one
  of its chunks. An engine that heartbeats but never finishes (a black hole) is found
  after a few heartbeats, not after a deadline; when every engine is slow (a loaded
  machine), none is, since none answers.

What happens to such chunks and engines is ``health.py``'s: a chunk past its deadline,
and every chunk of a stalled engine, goes back to the buffer (counted as a failure of its
request), is aborted on the engine, and its late result is ignored; the engine is marked
unhealthy (``Registry.mark_unhealthy``) and gets no new work until it answers a chunk.

An engine's own ``elapsed_ms`` is trusted only downwards: a chunk's sample is at most the
time the control plane saw between sending it and its result, a value that is not finite
and non-negative is not used, and a result for a chunk never sent here measures nothing
(a broken engine that reported inf or 1e300 would otherwise have given every chunk an
endless deadline, its own and, as the slowest engine, the unmeasured ones'). Time the
control plane's own loop stood still (``loop_stalled``) does not count against any chunk
or engine. Pure: the time is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from seer.config import EnginesConfig

# Weight of the newest chunk in an engine's per-token estimate (an exponential average).
PER_TOKEN_SMOOTHING = 0.2


@dataclass(slots=True)
class _Chunk:
    engine_id: int
    sent_s: float  # on the stall-free clock (``_clock``)
    sent_wall_s: float  # as the server saw it: caps the engine's reported time
    max_tokens: int
    watched: bool = True  # False once given up on (expired, or its engine stalled): only a late result is awaited


class ChunkDeadlines:
    def __init__(self, config: EnginesConfig) -> None:
        self.min_s = config.chunk_deadline_min_s
        self.factor = config.chunk_deadline_factor
        self.unmeasured_s = config.chunk_deadline_unmeasured_s
        self.stall_window_s = config.stall_heartbeats * config.heartbeat_interval_s
        self.stall_factor = config.stall_factor
        self.per_token_s: dict[int, float] = {}  # engine id -> measured seconds per token
        # task id -> chunk, from its dispatch until its result, failure or its engine's loss
        # (also past its deadline: a late result still measures its engine).
        self._chunks: dict[int, _Chunk] = {}
        # engine id -> its watched chunks' task ids in dispatch order (dicts keep insertion order)
        self._watched: dict[int, dict[int, None]] = {}
        self._answered_s: dict[int, float] = {}  # engine id -> when it last answered a chunk (stall-free clock)
        self._stalled_total_s = 0.0  # time the control plane's loop stood still, in all

    def __len__(self) -> int:
        """Chunks watched for their deadline (not yet answered, given up on or dropped)."""
        return sum(map(len, self._watched.values()))

    # ------------------------------------------------------------------ measurements
    def seconds_per_token(self, engine_id: int) -> float | None:
        """The engine's measured time per token, else the fleet's (slowest measured), else None."""
        own = self.per_token_s.get(engine_id)
        if own is not None:
            return own
        return max(self.per_token_s.values()) if self.per_token_s else None

    def allowance_s(self, engine_id: int, max_tokens: int) -> float:
        """How long a chunk of ``max_tokens`` may take on this engine, as measured now."""
        per_token = self.seconds_per_token(engine_id)
        if per_token is None:
            return max(self.min_s, self.unmeasured_s)
        return max(self.min_s, self.factor * max_tokens * per_token)

    def deadline_s(self, engine_id: int, max_tokens: int, now_s: float) -> float:
        """The deadline of a chunk sent now (later measurements move it)."""
        return now_s + self.allowance_s(engine_id, max_tokens)

    def _clock(self, now_s: float) -> float:
        return now_s - self._stalled_total_s

    def loop_stalled(self, stall_s: float) -> None:
        """The control plane's loop was busy for ``stall_s`` and read nothing: that time is
        held against no chunk and no engine (what engines sent meanwhile waits in the socket)."""
        self._stalled_total_s += max(0.0, stall_s)

    # ------------------------------------------------------------------ chunk events
    def sent(self, engine_id: int, task_id: int, max_tokens: int, now_s: float) -> None:
        """A chunk went to its engine: its clock starts."""
        self._chunks[task_id] = _Chunk(engine_id, self._clock(now_s), now_s, max_tokens)
        self._watched.setdefault(engine_id, {})[task_id] = None

    def finished(self, engine_id: int, task_id: int, num_tokens: int, elapsed_s: float,
                 now_s: float | None = None) -> None:
        """A chunk came back (possibly late): the engine answered, and its per-token time is
        updated. ``now_s`` (the server's): the sample is capped by the time seen here, and a
        chunk not sent here (or sent to another engine) measures nothing."""
        chunk = self._pop(engine_id, task_id, now_s)
        if not math.isfinite(elapsed_s) or elapsed_s < 0:
            elapsed_s = math.inf  # not used as such: replaced by the time seen here, or dropped
        if now_s is not None:
            if chunk is None:
                return
            elapsed_s = min(elapsed_s, max(0.0, now_s - chunk.sent_wall_s))
        if not math.isfinite(elapsed_s):
            return
        sample = elapsed_s / max(1, num_tokens)
        old = self.per_token_s.get(engine_id)
        self.per_token_s[engine_id] = sample if old is None else old + PER_TOKEN_SMOOTHING * (sample - old)

    def failed(self, engine_id: int, task_id: int, now_s: float) -> None:
        """The engine reported a chunk failed: no deadline to watch; the engine answered."""
        self._pop(engine_id, task_id, now_s)

    def engine_gone(self, engine_id: int) -> None:
        """A lost engine's measurement must not judge the others; nothing of it is kept (its
        chunks are requeued by the scheduler)."""
        self.per_token_s.pop(engine_id, None)
        self._answered_s.pop(engine_id, None)
        for task_id in self._watched.pop(engine_id, {}):
            self._chunks.pop(task_id, None)
        for task_id in [t for t, c in self._chunks.items() if c.engine_id == engine_id]:
            del self._chunks[task_id]

    def _pop(self, engine_id: int, task_id: int, now_s: float | None) -> _Chunk | None:
        """The chunk answered by ``engine_id`` (None if it was not sent there); the engine answered."""
        chunk = self._chunks.get(task_id)
        if chunk is None or chunk.engine_id != engine_id:
            return None
        del self._chunks[task_id]
        self._unwatch(engine_id, task_id)
        if now_s is not None:
            self._answered_s[engine_id] = self._clock(now_s)
        return chunk

    def _unwatch(self, engine_id: int, task_id: int) -> None:
        watched = self._watched.get(engine_id)
        if watched is not None:
            watched.pop(task_id, None)
            if not watched:
                del self._watched[engine_id]

    def _give_up(self, engine_id: int, task_id: int) -> None:
        """Stop watching a chunk; keep it for its late result's measurement."""
        self._chunks[task_id].watched = False
        self._unwatch(engine_id, task_id)

    # ------------------------------------------------------------------ judgements
    def expired(self, now_s: float) -> list[tuple[int, int]]:
        """(engine id, task id) of chunks past their deadline as measured now, each reported
        once (then no longer watched). Per engine, chunks are scanned in dispatch order up
        to the first one younger than the shortest allowance, so a tick costs about the
        chunks old enough to be late."""
        now = self._clock(now_s)
        out: list[tuple[int, int]] = []
        for engine_id, watched in list(self._watched.items()):
            shortest = self.allowance_s(engine_id, 1)
            for task_id in list(watched):
                chunk = self._chunks[task_id]
                if chunk.sent_s + shortest > now:
                    break
                if chunk.sent_s + self.allowance_s(engine_id, chunk.max_tokens) <= now:
                    out.append((engine_id, task_id))
                    self._give_up(engine_id, task_id)
        return out

    def stalled(self, now_s: float) -> dict[int, list[int]]:
        """Engines that made no progress (``stall_window_s``, see the module docstring) while
        another engine answered a chunk: engine id -> its chunks in flight (task ids, in
        dispatch order), which are no longer watched."""
        now = self._clock(now_s)
        out: dict[int, list[int]] = {}
        for engine_id, watched in list(self._watched.items()):
            oldest = self._chunks[next(iter(watched))]
            per_token = self.seconds_per_token(engine_id)
            if per_token is None:
                continue  # nothing measured anywhere: no engine has answered either
            since = max(self._answered_s.get(engine_id, -math.inf), oldest.sent_s)
            window = max(self.stall_window_s, self.stall_factor * oldest.max_tokens * per_token)
            if now - since < window:
                continue
            if not any(at > since for other, at in self._answered_s.items() if other != engine_id):
                continue  # nobody answered meanwhile: the whole fleet is slow, not this engine
            out[engine_id] = list(watched)
            for task_id in out[engine_id]:
                self._give_up(engine_id, task_id)
        return out

    def stall_reason(self, engine_id: int, num_chunks: int, now_s: float) -> str:
        """Why ``stalled`` named this engine, for the log."""
        answered = self._answered_s.get(engine_id)
        last = "never" if answered is None else f"{self._clock(now_s) - answered:.1f} s ago"
        return (f"no progress on any of its {num_chunks} chunks in flight (last answer: {last}) while other "
                "engines finished theirs")
