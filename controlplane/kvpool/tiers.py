"""The disk tier's decisions: which requests' KV leaves DRAM, which comes back first.

Owns, for the pure scheduler core (no I/O, no clocks): the disk tier's slot allocator,
which request's KV is on disk in which slots, the order in which waiting requests will
be needed (``QueueOrder``), and the two rules built on it:

* **Eviction by queue order.** When the host pool lacks blocks, the KV of *waiting*
  requests (never one with a chunk in flight: an engine may still write or read its
  blocks) goes to disk, the one the scheduler will need *last* first, until enough
  blocks are free. The need order is the policies' own: each chunked policy tells, without
  touching its queue, which waiting requests it would serve next (``upcoming(k)``) and
  which last (``needed_last``) -- arrival order for ``divided``, rank order for
  ``context`` (probes first, then the longest estimate). A request already placed but
  not yet sent is needed before all of them. Requests of a policy without that reading
  fall back to the order their chunks returned (``NeedOrder``). This is the opposite of
  LRU, which would evict exactly the request needed next.
* **Staging ahead of the turn (prefetch from disk).** The on-disk KV of the next
  ``depth`` waiting requests is staged back, soonest first, into free blocks or into
  blocks of waiting requests needed after it (spilled first), stopping at the first that
  would displace nothing needed later; a request whose chunk is dispatched while its KV
  is still on disk is staged on the dispatch path (and counted as not prefetched).

The byte moves are ``DiskOp``s (``Spill``, ``Stage``) that the server runs in order, on
one thread, before it sends any chunk decided after them (``controlplane/kvpool/disk.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seer.controlplane.state import Request, RequestState

if TYPE_CHECKING:
    from seer.controlplane.policies.base import Policy


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
    """The fallback need order, for requests of a policy that cannot tell its own: the
    order their chunks returned (a request that returned earlier is served earlier by a
    first-come first-served queue)."""

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


class QueueOrder:
    """When the scheduler will need each waiting request, read from the policies' queues.

    ``policies`` is the scheduler's live map of policy name -> policy; a policy that
    ``tells_order`` (``upcoming(k)``, ``needed_last(requests)``: the chunked ones) orders its
    own requests, the rest go by return order (``returned``). Across policies, requests are
    interleaved by their position in their own policy's order."""

    def __init__(self, policies: Mapping[str, Policy] | None = None) -> None:
        self._policies: Mapping[str, Policy] = policies if policies is not None else {}
        self.returned = NeedOrder()
        # Placed on an engine but held back (the engine is at ``max_chunks_per_engine``):
        # request -> placement order. Each engine sends its held requests first come first
        # served, so placement order is their need order.
        self._placed: dict[Request, int] = {}
        self._placement_seq = itertools.count()

    def held(self, request: Request) -> None:
        """The scheduler placed ``request`` and holds it until its engine has room."""
        self._placed[request] = next(self._placement_seq)

    def released(self, request: Request) -> None:
        """A held request was sent, or went back to its policy's queue, or was cancelled."""
        self._placed.pop(request, None)

    def _reader(self, request: Request) -> Policy | None:
        policy = self._policies.get(request.group.rollout.policy)
        return policy if policy is not None and policy.tells_order else None

    def upcoming(self, k: int) -> list[Request]:
        """The next ``k`` waiting requests of the policies that can tell, soonest first."""
        lists = [p.upcoming(k) for p in self._policies.values() if p.tells_order]
        if len(lists) == 1:
            return lists[0]
        return [r for row in itertools.zip_longest(*lists) for r in row if r is not None][:k]

    def soonest_first(self, requests: list[Request]) -> list[Request]:
        """``requests`` (waiting), needed soonest first: placed but not yet sent (a waiting
        request its policy no longer holds; held ones in placement order), then by their
        policies' orders, interleaved by position; requests of policies that cannot tell by
        return order. O(m log m)."""
        by_policy: dict[int, tuple[Policy, list[Request]]] = {}
        fallback: list[Request] = []
        placed = self._placed
        ranked: list[tuple[int, int, int, Request]] = []  # (class, position, policy, request)
        for r in requests:
            position = placed.get(r)
            if position is not None:  # held: whatever its policy, it goes out before the queue
                ranked.append((0, position, 0, r))
                continue
            reader = self._reader(r)
            if reader is None:
                fallback.append(r)
            else:
                by_policy.setdefault(id(reader), (reader, []))[1].append(r)
        for n, (reader, mine) in enumerate(by_policy.values()):
            queued = reader.needed_last(mine)
            held = set(queued)
            # Placed but not sent and not held (its KV is on its way from another host): now.
            ranked += [(0, -1, n, r) for r in mine if r not in held and r.state is RequestState.WAITING]
            ranked += [(1, i, n, r) for i, r in enumerate(reversed(queued))]
        fallback.sort(key=lambda r: self.returned.rank(r.kv_key))
        ranked += [(1, i, len(by_policy), r) for i, r in enumerate(fallback)]
        ranked.sort(key=lambda e: e[:3])
        return [e[3] for e in ranked]

    def due(self, requests: list[Request], k: int) -> list[Request]:
        """Those of ``requests`` needed within the next ``k`` dispatches, soonest first:
        placed but not yet sent, among the next ``k`` of their policy's queue, or of a
        policy that cannot tell (all of those: the return-order rule)."""
        window = set(self.upcoming(k)) if k > 0 else set()
        out = []
        for r in self.soonest_first(requests):
            reader = self._reader(r)
            if reader is None or r in window or not reader.needed_last([r]):
                out.append(r)
        return out


def pick_victims(candidates: dict[int, int], need: int, last_first: list[int]) -> list[int] | None:
    """Keys to evict, in the order of ``last_first`` (needed last first), whose blocks
    (``candidates``: key -> number of blocks) add up to at least ``need``; None if all of
    them together are not enough (then nothing should be evicted)."""
    if need <= 0:
        return []
    if sum(candidates.values()) < need:
        return None
    victims, freed = [], 0
    for key in last_first:
        victims.append(key)
        freed += candidates[key]
        if freed >= need:
            return victims
    return None  # unreachable when last_first holds every candidate


__all__ = ["DiskOp", "DiskSlots", "NeedOrder", "QueueOrder", "Spill", "Stage", "pick_victims"]
