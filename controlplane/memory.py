"""Giving memory back once large rollouts have ended.

Owns when the control plane collects and trims after rollouts leave the scheduler
(finished, cancelled or failed), and doing it.

A rollout's requests form one object graph (request -> group -> rollout -> every group ->
every request), so one stray reference to any of its requests keeps all of it alive: the
engines' in-flight change logs (``state.Inflight``, a few hundred entries per engine, kept
for the admission bookkeeping) hold the last requests that left each engine. So when a
rollout has left the scheduler those logs are dropped
(``Registry.drop_inflight_history``). The graph is cyclic: a rollout is taken apart at
its links down as soon as the scheduler forgets it, delivered, cancelled or failed
(``MemoryRelease.dismantle``), so reference counting frees it at once. What stays
cyclic (a rollout refused while it was being built, other garbage cycles) is left to
CPython's cyclic collector, and ``gc_tuning`` makes full collections rare (an idle
daemon would keep it for good): once as many samples of ended rollouts
as are still live (at most ``RELEASE_MIN_SAMPLES``, at least ``IDLE_MIN_SAMPLES``) have
ended since the last release (``RolloutEnds.update``), a full collection runs if any of
them was not taken apart, and glibc is asked to hand free pages back to the system
(``malloc_trim``) then and on the next ``FOLLOW_UP_TRIMS`` ticks (apart from the
collection: each holds the loop). A finished rollout is released as soon as it ends,
before the next one is built (the server, ``ClientSessions.ended_samples``); a cancelled
one at the next tick. A full collection walks every live object (tens of ms per 100,000)
and frees what it finds: seconds for a million-sample rollout left cyclic; the registry
and the deadlines are told that the loop stood still, as for any stall.
``RolloutEnds`` is pure (what is live is passed in); ``MemoryRelease`` decides, on each
of the server's ticks, what to drop, collect and trim, and logs ``memory_released``;
``collect`` (``release`` without the trim) and ``trim`` do the work.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import structlog

from seer.controlplane.registry import Registry
from seer.controlplane.state import Rollout

log = structlog.get_logger()

# Samples of ended rollouts that warrant a full collection (below: left to the collector's
# own schedule; a full collection walks every live object, tens of ms per 100,000).
RELEASE_MIN_SAMPLES = 10_000
# Ended samples that warrant one once no rollout is left (idle: between a trainer's steps, or
# for good). Below ``RELEASE_MIN_SAMPLES`` the ended rollouts' cycles otherwise waited for
# the next large rollout to end: an idle daemon kept up to 10,000 samples of them (~8 MiB of
# objects, ~20 MiB of RSS in the soak). Idle, a collection walks little.
IDLE_MIN_SAMPLES = 1_000


class RolloutEnds:
    """Which rollouts ended, and when a release is due. A rollout is known from the moment
    its request is taken in (``started``: its requests are built then, and a refusal or a
    cancel during the intake ends it too) until it is neither being taken in nor in the
    scheduler: so one that starts and ends between two looks is still counted."""

    def __init__(self, min_samples: int = RELEASE_MIN_SAMPLES, idle_min_samples: int = IDLE_MIN_SAMPLES) -> None:
        self.min_samples = min_samples
        self.idle_min_samples = min(idle_min_samples, min_samples)
        self._samples: dict[str, int] = {}  # rollout id -> its samples (prompts x group size)
        self._pending_samples = 0  # samples of rollouts ended since the last release
        self.released_samples = 0  # samples of the rollouts whose release ``update`` last said was due

    def __contains__(self, rollout_id: object) -> bool:
        """Is the rollout known and not yet seen to end?"""
        return rollout_id in self._samples

    def started(self, rollout_id: str, num_samples: int) -> None:
        """A rollout request is being taken in."""
        self._samples[rollout_id] = max(self._samples.get(rollout_id, 0), num_samples)

    def update(self, live: Collection[str]) -> tuple[int, bool]:
        """(rollouts that ended since the last call, whether a release is due now: as many
        samples ended as are still live, at least ``idle_min_samples`` and at most
        ``min_samples``); ``live``: the ids being taken in or in the scheduler.

        A full collection walks the live rollouts and frees the ended ones, and the freeing
        is most of it (57,000-78,000 objects tracked, 40,000-53,000 of them collected, in
        the soak): collecting once as many samples have ended as are live keeps each stall
        at about twice the freeing of the live samples, and the walks at most as costly as
        the freeing. With few samples live (four 800-sample rollouts) that is a release
        every ~3,200 ended samples, not every 10,000."""
        ended = [rollout_id for rollout_id in self._samples if rollout_id not in live]
        for rollout_id in ended:
            self._pending_samples += self._samples.pop(rollout_id)
        live_samples = sum(self._samples.values())
        due = self._pending_samples >= max(self.idle_min_samples, min(self.min_samples, live_samples))
        if due:
            self.released_samples, self._pending_samples = self._pending_samples, 0
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
# A release that collected at least this many objects per ended sample freed the ended
# rollouts (a request is one object and three lists, all in the rollout's cycles): the last
# follow-up tick then trims instead of collecting again. A collection walks every live
# object: after a 10,000-sample rollout, with the next one already running, the needless
# follow-up stood the loop still for 25-125 ms.
COLLECTED_PER_SAMPLE = 3


def release(trim_after: bool = True) -> Released:
    """A full garbage collection, then ``trim`` (unless not ``trim_after``)."""
    t0 = time.monotonic()
    before = rss_bytes()
    num_collected = gc.collect()
    if trim_after:
        trim()
    return Released(before, rss_bytes(), num_collected, time.monotonic() - t0)


def collect() -> Released:
    """``release`` without the trim: ``MemoryRelease`` trims on the next tick, so the loop
    stands still for each apart (on a loaded 2-core machine the trim after a 10,000-sample
    rollout took 40-70 ms on top of a 100-200 ms collection)."""
    return release(trim_after=False)


def trim() -> None:
    """glibc's ``malloc_trim(0)``: free pages anywhere in the heap go back to the system
    (milliseconds); nothing where there is no glibc. With CPython's own allocator most
    objects live in 1 MiB arenas it keeps while any object in them lives; the daemon runs on
    the C allocator (``PYTHONMALLOC=malloc``, cli/main.py) so that this returns them."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")  # once: each load builds cyclic ctypes objects
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not readable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


class MemoryRelease:
    """Gives the memory of ended rollouts back, one tick at a time: drops the references the
    engines' in-flight logs keep to them; after large ones, collects, then trims on the next
    ``FOLLOW_UP_TRIMS`` ticks (``memory_released`` reports the RSS before the first trim) and collects once more on the last (what
    still referred to the ended rollouts at the release has let go by then) unless the
    release already freed them (``COLLECTED_PER_SAMPLE``). When every ended rollout was
    taken apart (``dismantle``: reference counting freed it) a release trims and collects
    nothing (``collected`` false in ``memory_released``). The server also ticks it as
    soon as a large rollout ends (``ClientSessions.ended_samples``), before the next one is
    built: the collection then walks the ended rollout, not the next one too. The loop
    stands still meanwhile: ``stalled`` is told how long (seconds), so that time is held
    against no engine or chunk. ``release`` and ``trim`` are injected (tests count them)."""

    def __init__(self, registry: Registry, stalled: Callable[[float], None], *,
                 min_samples: int = RELEASE_MIN_SAMPLES, release: Callable[[], Released] = collect,
                 trim: Callable[[], None] = trim) -> None:
        self.registry = registry
        self.stalled = stalled
        self.ends = RolloutEnds(min_samples)  # when ended rollouts' memory is given back
        self._release = release
        self._trim = trim
        self.trims_left = 0  # ticks that trim again after a release
        self.follow_up = True  # whether the last follow-up tick collects (the release did not free enough)
        self.dismantled_samples = 0  # samples of rollouts taken apart (``dismantle``) since the last release

    def dismantle(self, rollout: Rollout) -> None:
        """Cut an ended rollout's graph at its links down (rollout -> groups -> requests):
        reference counting frees it now, a rollout at a time, and the next full collection
        only walks what is live (one that also freed the ended rollouts held the soak's loop
        for 20-160 ms). Only once the scheduler has forgotten it (delivered: ``forget``;
        cancelled or failed: ``cancel``, after which its aborted chunks come back as unknown
        tasks): nothing reads down from it any more; what still holds one of its requests
        keeps that request, its group and the rollout, no cycle among them."""
        self.dismantled_samples += rollout.num_samples
        for group in rollout.groups:
            group.requests = []
        rollout.groups = []

    def tick(self, live: Collection[str]) -> None:
        """``live``: the rollout ids being taken in or in the scheduler."""
        num_ended, due = self.ends.update(live)
        if num_ended:
            self.registry.drop_inflight_history()
        if self.trims_left:
            self.trims_left -= 1
            if self.trims_left or not self.follow_up:
                self._trim()
            else:
                # What still referred to the ended rollouts at the release (an aborted chunk's
                # result on its way, the client's stream closing) has let go by now.
                self._collect(follow_up=True)
        if due:
            self.trims_left = FOLLOW_UP_TRIMS
            # What was taken apart was freed when it was: only the rest waits for the collector.
            cyclic = max(0, self.ends.released_samples - self.dismantled_samples)
            self.dismantled_samples = 0
            if not cyclic:
                # Every ended rollout was taken apart: no collection walks the live rollouts
                # (in the soak each one stood the loop still for 10-100 ms); trims hand the
                # freed pages back, CPython's own collections find other cycles.
                self.follow_up = False
                self._log(self._trimmed(), follow_up=False, collected=False)
                return
            done = self._collect(follow_up=False)
            self.follow_up = done.num_collected < COLLECTED_PER_SAMPLE * cyclic

    def _trimmed(self) -> Released:
        t0, before = time.monotonic(), rss_bytes()
        self._trim()
        return Released(before, rss_bytes(), 0, time.monotonic() - t0)

    def _collect(self, follow_up: bool) -> Released:
        done = self._release()
        self._log(done, follow_up=follow_up, collected=True)
        return done

    def _log(self, done: Released, *, follow_up: bool, collected: bool) -> None:
        self.stalled(done.seconds)
        log.info("memory_released", rss_before_mb=round(done.rss_before_bytes / 2**20, 1),
                 rss_after_mb=round(done.rss_after_bytes / 2**20, 1), num_collected=done.num_collected,
                 ms=round(done.seconds * 1000), follow_up=follow_up, collected=collected)


_LIBC: ctypes.CDLL | None = None
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
