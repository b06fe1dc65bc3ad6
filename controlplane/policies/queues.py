"""The chunked policies' queues of waiting requests: a FIFO and a lazy heap.

Owns the one stale-ticket rule. Each time a request becomes waiting its policy gives it
a fresh *ticket* (``ChunkedPolicy._index``), kept in the policy's ``tickets`` map while
it waits, and an entry ``(key, ticket, request)`` of a queue is live only while
``tickets.get(request) == ticket``: its ticket is still the request's current one. So the same waiting request can sit in several queues at once
(the policy's order, the backfill-by-need heap, ``context``'s starvation guard) and
whichever serves it retires its entries in the others: each queue drops a stale entry
when it meets one, and ``compact`` drops them all. Queues never change request state;
their policy takes what they return.

``LazyHeap`` keeps each entry under the key it had when pushed. A key may only *grow*
while its request waits (a group's estimate fell below the max-length placeholder), so a
stale-keyed entry surfaces early, is re-keyed and pushed back: each pop costs O(log n)
instead of a re-sort. A key that *shrinks* would stay buried: the policy must push such
a request again (a fresh ticket), as ``context`` does when a group's sample finishes.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

from seer.controlplane.state import Request, RequestState

Tickets = dict[Request, int]  # waiting request -> its current ticket (the policy's; shared, never copied)
Entry = tuple  # (key, ticket, request); a FIFO's key is None


def is_live(request: Request) -> bool:
    """Still waiting and not part of a cancelled rollout (queues drop the rest lazily)."""
    return request.state is RequestState.WAITING and not request.group.rollout.cancelled


class FifoQueue:
    """Arrival order: entries ``(ticket, request)`` in a deque; ``push_back`` puts a skipped
    request back at the head, where it was taken from."""

    def __init__(self, tickets: Tickets) -> None:
        self._ticket_of = tickets.get
        self.entries: deque[tuple[int, Request]] = deque()

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self.entries)

    def push(self, request: Request, ticket: int, key: object = None) -> None:
        self.entries.append((ticket, request))

    def push_back(self, request: Request, ticket: int, key: object = None) -> None:
        self.entries.appendleft((ticket, request))

    def _current(self) -> Iterator[tuple[int, Request]]:
        ticket_of = self._ticket_of
        return ((t, r) for t, r in self.entries if ticket_of(r) == t)

    def pop(self) -> Entry | None:
        """The first current entry, removed (stale ones before it are dropped)."""
        entries, ticket_of = self.entries, self._ticket_of
        while entries:
            ticket, request = entries.popleft()
            if ticket_of(request) == ticket:
                return None, ticket, request
        return None

    def settle(self, dropped: list[tuple[int, Request]] | None = None) -> Entry | None:
        """The first current entry, left in place (stale ones before it are dropped, and
        listed as ``(ticket, request)`` in ``dropped``)."""
        entries, ticket_of = self.entries, self._ticket_of
        while entries:
            ticket, request = entries[0]
            if ticket_of(request) == ticket:
                return None, ticket, request
            entries.popleft()
            if dropped is not None:
                dropped.append((ticket, request))
        return None

    def pop_top(self) -> Entry:
        """Remove the head entry (after ``settle`` found it current)."""
        ticket, request = self.entries.popleft()
        return None, ticket, request

    def top(self) -> Entry:
        ticket, request = self.entries[0]
        return None, ticket, request

    def head(self) -> Request | None:
        """The request ``pop`` would return if it is live, else None; nothing changes."""
        ticket_of = self._ticket_of
        for ticket, request in self.entries:
            if ticket_of(request) == ticket:
                return request if is_live(request) else None
        return None

    def upcoming(self, k: int) -> list[Request]:
        """The next ``k`` live requests in order, nothing taken: O(k + stale entries passed)."""
        return list(islice((r for _, r in self._current() if is_live(r)), k))

    def compact(self) -> None:
        self.entries = deque(self._current())

    def rebuild(self, entries: Iterable[Entry]) -> None:
        self.entries = deque((t, r) for _, t, r in sorted(entries, key=lambda e: e[1]))


class LazyHeap:
    """Smallest key first: entries ``(key, ticket, request)`` in a binary heap. ``key_of``:
    a live request's current key (re-keyed lazily, see the module docstring); None for
    keys that never change while the request waits (the need heap)."""

    def __init__(self, tickets: Tickets, key_of: Callable[[Request], int] | None = None) -> None:
        self._ticket_of = tickets.get
        self._key_of = key_of
        self.entries: list[tuple[int, int, Request]] = []

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self.entries)

    def push(self, request: Request, ticket: int, key: int | None = None) -> None:
        """``key`` None: the request's current key (``key_of``)."""
        heapq.heappush(self.entries, (self._key_of(request) if key is None else key, ticket, request))  # type: ignore[misc]

    push_back = push  # a skipped request goes back under the key it was taken with

    def settle(self, dropped: list[tuple[int, Request]] | None = None) -> Entry | None:
        """The best entry, left on top: stale entries on the way are dropped (and listed as
        ``(ticket, request)`` in ``dropped``), live ones whose key grew pushed back under their current key. A
        current entry of a request that is not live (a cancelled rollout's) is returned as
        it is: its policy takes it and skips it."""
        heap, ticket_of, key_of = self.entries, self._ticket_of, self._key_of
        while heap:
            key, ticket, request = heap[0]
            if ticket_of(request) != ticket:
                heapq.heappop(heap)
                if dropped is not None:
                    dropped.append((ticket, request))
                continue
            if key_of is not None and is_live(request):
                current = key_of(request)
                if current != key:
                    heapq.heappop(heap)
                    heapq.heappush(heap, (current, ticket, request))
                    continue
            return heap[0]
        return None

    def pop(self) -> Entry | None:
        """``settle``'s entry, removed."""
        heap, ticket_of, key_of = self.entries, self._ticket_of, self._key_of
        while heap:
            entry = heapq.heappop(heap)
            key, ticket, request = entry
            if ticket_of(request) != ticket:
                continue  # served from another queue, or pushed again since
            if key_of is not None and is_live(request):
                current = key_of(request)
                if current != key:
                    heapq.heappush(heap, (current, ticket, request))
                    continue
            return entry
        return None

    def pop_top(self) -> Entry:
        """Remove the top entry (after ``settle`` left it there)."""
        return heapq.heappop(self.entries)

    def top(self) -> Entry:
        return self.entries[0]

    def head(self) -> Request | None:
        """The top request if it is current, live and keyed right (then ``pop`` returns
        it), else None; nothing changes."""
        if not self.entries:
            return None
        key, ticket, request = self.entries[0]
        if self._ticket_of(request) == ticket and is_live(request) and (
                self._key_of is None or self._key_of(request) == key):
            return request
        return None

    def upcoming(self, k: int) -> list[Request]:
        """The next ``k`` live requests in key order, without popping or touching the heap.
        A walk from the root in stored-key order, O((k + stale) log n): a stored key is
        never above the entry's current one (keys only grow), so a live entry, re-keyed,
        is next once its current key is no larger than the smallest stored key not yet
        visited."""
        heap, out = self.entries, []
        key_of = self._key_of or (lambda r: None)
        frontier = [(heap[0][0], heap[0][1], 0)] if heap else []  # (stored key, ticket, heap index)
        ready: list[tuple[int, int, Request]] = []  # (current key, ticket, request)
        while len(out) < k and (frontier or ready):
            if ready and (not frontier or ready[0][:2] <= frontier[0][:2]):
                out.append(heapq.heappop(ready)[2])
                continue
            stored, ticket, i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], heap[child][1], child))
            request = heap[i][2]
            if self._ticket_of(request) == ticket and is_live(request):
                current = key_of(request)
                heapq.heappush(ready, (stored if current is None else current, ticket, request))
        return out

    def compact(self) -> None:
        ticket_of = self._ticket_of
        self.entries = [e for e in self.entries if ticket_of(e[2]) == e[1]]
        heapq.heapify(self.entries)

    def rebuild(self, entries: Iterable[Entry]) -> None:
        self.entries = list(entries)
        heapq.heapify(self.entries)


__all__ = ["FifoQueue", "LazyHeap", "is_live"]
