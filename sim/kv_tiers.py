"""The global KV pool's tiers in the simulator: a finite DRAM pool, an optional disk tier,
optional prefetch by the queue — in virtual seconds, no I/O.

Owns which chunked request's KV is where (DRAM, disk, or lost) and what a chunk's start
pays for it, following the rules of the real pool (docs/kv-pool.md, "Disk tier"):

* DRAM holds the KV of every request in flight (its context) and of waiting requests.
  A chunk whose KV does not fit *without* a disk tier runs without saving: its next
  chunk re-prefills (``pooled_tokens = 0``), the real pool's ``kv_pool_full``.
* With a disk tier, room is made by spilling the waiting requests needed *last* (the
  order chunks returned in); a spill decided on a chunk's dispatch delays that chunk by
  the write time (the real server runs spills before it sends the chunk).
* A chunk whose KV is on disk at its dispatch waits for the read (``disk_s_per_token``
  per token): critical-path load time. With prefetch, when a chunk returns the KV needed
  soonest is swapped back into DRAM (spilling later-needed KV) on a disk that serves one
  move at a time; a chunk dispatched after its stage finished pays nothing, one
  dispatched before pays the rest.

``dispatch`` returns (pooled tokens, extra seconds on the chunk's start); the caller
passes both to ``SimEngineModel.add``. Counters give re-prefilled tokens, disk bytes and
critical-path seconds for the tables in docs/benchmarks.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class TierConfig:
    dram_tokens: int  # DRAM pool capacity, tokens of KV (all hosts together)
    disk: bool = False
    prefetch: bool = False
    disk_s_per_token: float = 0.0  # read or write, per token of KV


class PoolTiers:
    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self._valid: dict[str, int] = {}  # waiting request -> tokens of KV it has (somewhere)
        self._where: dict[str, str] = {}  # "dram" | "disk"
        self._inflight: dict[str, int] = {}  # request -> tokens its chunk holds in DRAM
        self._ready_at: dict[str, float] = {}  # on its way back from disk: when it is in DRAM
        self._rank: dict[str, int] = {}
        self._counter = itertools.count(1)
        self._disk_free_at = 0.0
        self.used = 0  # DRAM tokens in use
        self.peak_used = 0
        self.peak_inflight = 0  # DRAM tokens of chunks in flight alone (cannot be spilled)
        self._inflight_tokens = 0
        self.reprefill_tokens = 0
        self.disk_tokens = 0  # written + read
        self.critical_s = 0.0
        self.num_staged_on_path = 0
        self.num_prefetched = 0
        self.num_refused = 0

    def _disk_move(self, tokens: int, now: float) -> float:
        """Queue a move on the disk; when it ends."""
        start = max(now, self._disk_free_at)
        self._disk_free_at = start + tokens * self.config.disk_s_per_token
        self.disk_tokens += tokens
        return self._disk_free_at

    def _spill_for(self, need: int, now: float, later_than: int | None = None) -> float | None:
        """Spill waiting DRAM KV needed last until ``need`` more tokens fit; when the last
        spill ends (None: impossible, nothing spilled)."""
        missing = self.used + need - self.config.dram_tokens
        if missing <= 0:
            return now
        cands = sorted((k for k, w in self._where.items() if w == "dram"
                        and (later_than is None or self._rank.get(k, 0) > later_than)),
                       key=lambda k: self._rank.get(k, 0), reverse=True)
        chosen, freed = [], 0
        for k in cands:
            if freed >= missing:
                break
            chosen.append(k)
            freed += self._valid[k]
        if freed < missing:
            return None
        end = now
        for k in chosen:
            self._where[k] = "disk"
            self.used -= self._valid[k]
            self._ready_at.pop(k, None)
            end = self._disk_move(self._valid[k], now)
        return end

    def dispatch(self, key: str, context_tokens: int, now: float) -> tuple[int, float]:
        """A chunk of ``key`` with ``context_tokens`` of context starts at ``now``."""
        valid = self._valid.pop(key, 0)
        where = self._where.pop(key, None)
        ready = self._ready_at.pop(key, None)
        extra = 0.0
        if where == "dram":
            self.used -= valid
        elif where == "disk":
            if ready is not None:  # prefetch staged it (or is staging it)
                extra = max(0.0, ready - now)
                self.num_prefetched += extra == 0.0
                self.used -= valid  # its stage already took the room
            else:
                extra = self._disk_move(valid, now) - now
            self.num_staged_on_path += extra > 0.0
        pooled = valid if where is not None else 0
        self.reprefill_tokens += max(0, context_tokens - pooled) if self._rank.get(key) else 0
        # The chunk holds its context (and saves into it) in DRAM while it runs.
        if self.used + context_tokens > self.config.dram_tokens:
            end = self._spill_for(context_tokens, now) if self.config.disk else None
            if end is None:
                self.num_refused += 1
                self._inflight[key] = 0  # runs without saving
                self.critical_s += extra
                return pooled, extra
            extra = max(extra, end - now)
        self.used += context_tokens
        self.peak_used = max(self.peak_used, self.used)
        self._inflight_tokens += context_tokens
        self.peak_inflight = max(self.peak_inflight, self._inflight_tokens)
        self._inflight[key] = context_tokens
        self.critical_s += extra
        return pooled, extra

    def returned(self, key: str, context_tokens: int, now: float, finished: bool) -> None:
        """The chunk ended with ``context_tokens`` of context; ``finished``: the request too."""
        held = self._inflight.pop(key, 0)
        self.used -= held
        self._inflight_tokens -= held
        if finished:
            self._rank.pop(key, None)
        else:
            self._rank[key] = next(self._counter)
            if held:  # it saved: its KV waits in DRAM
                self._valid[key] = context_tokens
                self._where[key] = "dram"
                self.used += context_tokens
                self.peak_used = max(self.peak_used, self.used)
        if self.config.prefetch:
            self._prefetch(now)

    def _prefetch(self, now: float) -> None:
        on_disk = sorted((k for k, w in self._where.items() if w == "disk" and k not in self._ready_at),
                         key=lambda k: self._rank.get(k, 0))
        for k in on_disk:
            end = self._spill_for(self._valid[k], now, later_than=self._rank.get(k, 0))
            if end is None:
                return
            self._ready_at[k] = self._disk_move(self._valid[k], max(now, end))
            self.used += self._valid[k]  # reserved for it from now on
            self._where[k] = "disk"  # until its dispatch reads ``ready_at``


__all__ = ["PoolTiers", "TierConfig"]
