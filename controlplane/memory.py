"""Giving memory back once large rollouts have ended.

Owns when the control plane collects and trims after rollouts leave the scheduler
(finished, cancelled or failed), and doing it.

A rollout's requests form one object graph (request -> group -> rollout -> every group ->
every request), so one stray reference to any of its requests keeps all of it alive: the
engines' in-flight change logs (``state.Inflight``, a few hundred entries per engine, kept
for the admission bookkeeping) hold the last requests that left each engine. So when a
rollout has left the scheduler the server drops those logs
(``Registry.drop_inflight_history``). The graph is cyclic, so only CPython's cyclic
collector frees it, and ``gc_tuning`` makes full collections rare (an idle daemon would
keep a cancelled million-sample rollout for good): once rollouts of at least
``RELEASE_MIN_SAMPLES`` samples in all have ended since the last release, the server runs
a full collection and asks glibc to hand free pages back to the system (``malloc_trim``),
and trims again on the next ``FOLLOW_UP_TRIMS`` ticks.
A full collection of a million-sample rollout takes seconds of the event loop; the
server tells the registry and the deadlines that the loop stood still, as for any stall.
``RolloutEnds`` is pure (what is live is passed in); ``release`` does the work.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Collection
from dataclasses import dataclass

# Samples of ended rollouts that warrant a full collection (below: left to the collector's
# own schedule; a full collection walks every live object, tens of ms per 100,000).
RELEASE_MIN_SAMPLES = 10_000


class RolloutEnds:
    """Which rollouts ended, and when a release is due. A rollout is known from the moment
    its request is taken in (``started``: its requests are built then, and a refusal or a
    cancel during the intake ends it too) until it is neither being taken in nor in the
    scheduler: so one that starts and ends between two looks is still counted."""

    def __init__(self, min_samples: int = RELEASE_MIN_SAMPLES) -> None:
        self.min_samples = min_samples
        self._samples: dict[str, int] = {}  # rollout id -> its samples (prompts x group size)
        self._pending_samples = 0  # samples of rollouts ended since the last release

    def __contains__(self, rollout_id: object) -> bool:
        """Is the rollout known and not yet seen to end?"""
        return rollout_id in self._samples

    def started(self, rollout_id: str, num_samples: int) -> None:
        """A rollout request is being taken in."""
        self._samples[rollout_id] = max(self._samples.get(rollout_id, 0), num_samples)

    def update(self, live: Collection[str]) -> tuple[int, bool]:
        """(rollouts that ended since the last call, whether a release is due now);
        ``live``: the ids being taken in or in the scheduler."""
        ended = [rollout_id for rollout_id in self._samples if rollout_id not in live]
        for rollout_id in ended:
            self._pending_samples += self._samples.pop(rollout_id)
        due = self._pending_samples >= self.min_samples
        if due:
            self._pending_samples = 0
        return len(ended), due


@dataclass(frozen=True)
class Released:
    rss_before_bytes: int
    rss_after_bytes: int
    num_collected: int
    seconds: float


# Ticks after a release that trim again: what the rollout's last chunks (aborted ones
# still coming back) held is freed after the collection, and only a trim returns it.
FOLLOW_UP_TRIMS = 6


def release() -> Released:
    """A full garbage collection, then ``trim``."""
    t0 = time.monotonic()
    before = rss_bytes()
    num_collected = gc.collect()
    trim()
    return Released(before, rss_bytes(), num_collected, time.monotonic() - t0)


def trim() -> None:
    """glibc's ``malloc_trim(0)``: free pages anywhere in the heap go back to the system
    (milliseconds); nothing where there is no glibc. With CPython's own allocator most
    objects live in 1 MiB arenas it keeps while any object in them lives; the daemon runs on
    the C allocator (``PYTHONMALLOC=malloc``, cli/main.py) so that this returns them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not readable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
