"""The disk tier's decisions: which requests' KV leaves DRAM, which comes back first.

Owns, for the pure scheduler core (no I/O, no clocks): the disk tier's slot allocator,
which request's KV is on disk in which slots, the order in which waiting requests will
be needed, and the two rules built on it:

* **Eviction by queue order.** When the host pool lacks blocks, the KV of *waiting*
  requests (never one with a chunk in flight: an engine may still write or read its
  blocks) goes to disk, the one the scheduler will need *last* first, until enough
  blocks are free. The need order is the request buffer's: a chunked request becomes
  waiting when its chunk returns, and the chunked policies serve returned requests in
  the order they returned (``divided``: first in, first out), so the one that returned
  most recently is needed last (``NeedOrder``). This is the opposite of LRU, which would
  evict exactly the request needed next.
* **Staging ahead of the turn (prefetch from disk).** Whenever DRAM blocks are free,
  the on-disk KV needed *soonest* is staged back, while it fits without evicting
  anything; a request whose chunk is dispatched while its KV is still on disk is staged
  on the dispatch path (and counted as not prefetched).

The byte moves are ``DiskOp``s (``Spill``, ``Stage``) that the server runs in order, on
one thread, before it sends any chunk decided after them (``controlplane/kvpool/disk.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Spill:
    """Copy the request's pool blocks to disk slots (tags and checksums with them)."""

    key: int
    pool_blocks: list[int]
    slots: list[int]
    num_tokens: int
    epoch: int


@dataclass(frozen=True)
class Stage:
    """Copy disk slots back into pool blocks and seal them (checksums verified)."""

    key: int
    slots: list[int]
    pool_blocks: list[int]
    num_tokens: int
    epoch: int
    prefetch: bool  # ahead of the request's turn (False: on its chunk's dispatch path)


DiskOp = Spill | Stage


class DiskSlots:
    """Which disk slots are free (low ids first)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self.peak_used = max(self.peak_used, self.num_slots - len(self._free))
        return out

    def give(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))


class NeedOrder:
    """When each request's KV will be needed: the order its chunks returned (a request
    that returned earlier is served earlier by the chunked policies' queue)."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._returned: dict[int, int] = {}

    def returned(self, key: int) -> None:
        self._returned[key] = next(self._counter)

    def forget(self, key: int) -> None:
        self._returned.pop(key, None)

    def rank(self, key: int) -> int:
        """Smaller: needed sooner. A key never seen ranks first (needed now)."""
        return self._returned.get(key, 0)


def pick_victims(candidates: dict[int, int], need: int, order: NeedOrder) -> list[int] | None:
    """Keys to evict, needed last first, whose blocks (``candidates``: key -> number of
    blocks) add up to at least ``need``; None if all of them together are not enough
    (then nothing should be evicted)."""
    if need <= 0:
        return []
    if sum(candidates.values()) < need:
        return None
    victims, freed = [], 0
    for key in sorted(candidates, key=order.rank, reverse=True):
        victims.append(key)
        freed += candidates[key]
        if freed >= need:
            return victims
    return None  # unreachable: the sum was checked


def pick_prefetch(on_disk: dict[int, int], free_blocks: int, order: NeedOrder) -> list[int]:
    """On-disk keys to stage now, needed soonest first, while their blocks
    (``on_disk``: key -> blocks needed in DRAM) fit in ``free_blocks``; stops at the
    first that does not fit (staging a later one would take the room the sooner one needs)."""
    out = []
    for key in sorted(on_disk, key=order.rank):
        if on_disk[key] > free_blocks:
            break
        out.append(key)
        free_blocks -= on_disk[key]
    return out


__all__ = ["DiskOp", "DiskSlots", "NeedOrder", "Spill", "Stage", "pick_prefetch", "pick_victims"]
