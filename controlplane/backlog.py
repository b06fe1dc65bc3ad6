"""Accepted rollouts waiting to be admitted into the scheduler, and when to admit them.

Owns the admission window: a client may queue any number of rollouts (10,000 requests sent
at once), but the scheduler only holds what the engines can drain soon. Every rollout
that entered the scheduler costs the policies per-request state and, when it ends, a pass
over their queues (``ChunkedPolicy.rollout_ended`` is O(waiting requests)), so 10,000
one-sample rollouts taken in at once cost O(n^2) over the burst: the loop fell behind the
engines' results by tens of seconds (chunks passed their deadlines unread, both engines
were marked unhealthy) and only a few hundred rollouts finished before their clients'
timeout.

So an accepted rollout (every prompt checked, ``RolloutAccepted`` sent: ``intake.Checked``)
waits here, parked as its request and checked token ids, until the samples of admitted
rollouts not yet finished (``open_samples``) fall below the window (``window_samples``:
``ADMIT_SAMPLES_PER_ENGINE`` per ready engine). A rollout is admitted whole, however
large, whenever the window has room: the window bounds what is admitted beyond the
rollouts that fill it, never a rollout's size. Admission starts again only once the
open samples fall to ``ADMIT_LOW_WATER`` of the window, so rollouts are admitted in
batches and not one per finished sample.

Clients take turns: each has its own FIFO queue, and admission takes the head of each
client's queue in round-robin order, so a client queued behind another's 10,000 rollouts
is admitted at the next turn. Pure: ``ClientSessions`` (``sessions.py``) parks, admits
and counts; the server wakes admission when samples finish.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from seer.controlplane.intake import Checked
from seer.protocol import RolloutRequest

# Open (admitted, unfinished) samples the window allows per ready engine. Engines hold at
# most ``scheduler.max_chunks_per_engine`` chunks (1,024 by default) and batch far fewer
# (vLLM's max_num_seqs, 256 by default): this keeps every engine's batch full with a
# rollout's worth to spare, while the policies' per-rollout passes stay short.
ADMIT_SAMPLES_PER_ENGINE = 512
# Admission resumes once the open samples are at most this share of the window.
ADMIT_LOW_WATER = 0.75


@dataclass
class Parked:
    """An accepted rollout not yet in the scheduler."""

    identity: bytes
    req: RolloutRequest
    policy: str
    checked: Checked

    @property
    def num_samples(self) -> int:
        return len(self.checked.token_lists) * self.req.group_size


class Backlog:
    """Parked rollouts, one FIFO per client, taken in round-robin order. Removing one is
    O(1): its entry stays in its client's queue and is skipped when reached."""

    def __init__(self) -> None:
        self._queues: OrderedDict[bytes, deque[Parked]] = OrderedDict()  # client -> its parked rollouts
        self._parked: dict[str, Parked] = {}  # rollout id -> the parked rollout (the live entries)
        self.num_samples = 0  # samples of every parked rollout

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._parked

    def ids(self) -> list[str]:
        return list(self._parked)

    def park(self, parked: Parked) -> None:
        self._queues.setdefault(parked.identity, deque()).append(parked)
        self._parked[parked.req.rollout_id] = parked
        self.num_samples += parked.num_samples

    def pop(self) -> Parked | None:
        """The next rollout to admit: the head of the next client's queue (that client then
        goes to the back of the turn)."""
        while self._queues:
            identity, queue = next(iter(self._queues.items()))
            parked = queue.popleft()
            if queue:
                self._queues.move_to_end(identity)
            else:
                del self._queues[identity]
            if self._parked.get(parked.req.rollout_id) is parked:
                del self._parked[parked.req.rollout_id]
                self.num_samples -= parked.num_samples
                return parked
        return None

    def remove(self, rollout_id: str) -> Parked | None:
        """Take a parked rollout out (cancelled or failed before it was admitted)."""
        parked = self._parked.pop(rollout_id, None)
        if parked is not None:
            self.num_samples -= parked.num_samples
        return parked


def window_samples(num_ready_engines: int) -> int:
    """Open samples the scheduler may hold before admission waits."""
    return ADMIT_SAMPLES_PER_ENGINE * max(1, num_ready_engines)


def may_admit(open_samples: int, window: int, admitting: bool) -> bool:
    """Whether the next parked rollout may enter now: while the open samples are under the
    window (``admitting``: a batch of admissions is under way), or, to start a batch, at
    most ``ADMIT_LOW_WATER`` of it; always when nothing is open."""
    if open_samples <= 0:
        return True
    return open_samples < (window if admitting else ADMIT_LOW_WATER * window)
