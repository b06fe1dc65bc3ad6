"""The request buffer: every waiting request, in arrival order, grouped.

Arrival order is the order requests entered the buffer (submission, or return after a
chunk or an engine loss). Groups keep the order in which they first had a waiting
request. Operations are O(1) per request so paper-scale runs stay cheap.
"""

from __future__ import annotations

from collections.abc import Iterator

from seer.controlplane.state import Group, Request


class RequestBuffer:
    def __init__(self) -> None:
        # group_id -> (group, {request_id: request}); dicts keep insertion order.
        self._groups: dict[str, tuple[Group, dict[str, Request]]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, request: Request) -> None:
        group = request.group
        entry = self._groups.setdefault(group.group_id, (group, {}))
        if request.request_id not in entry[1]:
            entry[1][request.request_id] = request
            self._count += 1

    def remove(self, request: Request) -> None:
        entry = self._groups.get(request.group.group_id)
        if entry is None or request.request_id not in entry[1]:
            return
        del entry[1][request.request_id]
        self._count -= 1
        if not entry[1]:
            del self._groups[request.group.group_id]

    def __contains__(self, request: Request) -> bool:
        entry = self._groups.get(request.group.group_id)
        return entry is not None and request.request_id in entry[1]

    def by_group(self) -> Iterator[tuple[Group, list[Request]]]:
        """Snapshot of (group, waiting requests) in order; safe to mutate while iterating."""
        for group, requests in list(self._groups.values()):
            yield group, list(requests.values())

    def requests(self) -> Iterator[Request]:
        for _, requests in list(self._groups.values()):
            yield from list(requests.values())

    def drop_rollout(self, rollout_id: str) -> int:
        dropped = 0
        for gid in [gid for gid, (g, _) in self._groups.items() if g.rollout.rollout_id == rollout_id]:
            dropped += len(self._groups.pop(gid)[1])
        self._count -= dropped
        return dropped
