"""How long the control plane's event loop stood still, and why.

Owns the loop's stall log. ``LoopWatch.run`` is a task that wakes every
``WATCH_INTERVAL_S``; when it wakes ``STALL_LOGGED_S`` or more late, the loop stood
still, and the ``Stall`` says what the loop's thread did meanwhile, from the kernel's own
accounts of that thread (``/proc/thread-self/schedstat``; elsewhere CPU time only):

* ``cpu_s``: time it ran on a CPU -- the daemon's own work (a long Python loop, a large
  encode, a garbage collection; ``gc_s`` is the collector's share, from ``gc.callbacks``);
* ``runq_s``: time it was ready to run but waited for a CPU -- the machine was starved
  (other processes took the cores), nothing the daemon can fix;
* the rest (``blocked_s``): it slept in the kernel -- a blocking system call (a file
  write on a slow disk), a page fault that waited for swap or disk (``major_faults``), or
  the process was stopped (SIGSTOP, a frozen cgroup).

``preempted`` counts the times the kernel took the CPU from the loop thread (involuntary
context switches): many, with a large ``runq_s``, is a machine shared with busier work.

``cause`` names the largest of the three. For a stall of the daemon's own work a thread
(``StackSampler``) samples the loop thread's Python stack every ``SAMPLE_INTERVAL_S`` while
the loop is late and ``where`` lists the most frequent innermost frames (a thread holding
the GIL in C code for the whole stall, a collection or one large encode, leaves no sample:
``where`` is then empty and ``gc_s`` or ``cpu_s`` tell which). Each stall is logged as
``loop_stalled`` (a warning from ``STALL_WARNED_S``); the server reports the worst in
``control_plane_stopped.max_loop_lag_ms``.
"""

from __future__ import annotations

import asyncio
import gc
import resource
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger()

# The watch task's period, and the lateness logged as a stall.
WATCH_INTERVAL_S = 0.02
STALL_LOGGED_S = 0.1
STALL_WARNED_S = 1.0
# How often the sampler looks at the loop thread's stack while the loop is late.
SAMPLE_INTERVAL_S = 0.005
# Frames named in ``Stall.where``.
WHERE_FRAMES = 3

_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def thread_times() -> tuple[float, float]:
    """(seconds this thread has run on a CPU, seconds it has waited on a run queue), from
    the kernel's schedstat; elsewhere (CPU time, 0)."""
    try:
        run_ns, wait_ns, _ = _SCHEDSTAT.read_text().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0


_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def thread_faults() -> tuple[int, int]:
    """(major page faults, involuntary context switches) of this thread so far."""
    usage = resource.getrusage(_RUSAGE)
    return usage.ru_majflt, usage.ru_nivcsw


class GcTimer:
    """Time spent in garbage collections (every generation), from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.longest_s = 0.0  # the longest single collection since ``take_longest``
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            took = time.perf_counter() - self._started
            self._started = 0.0
            self.total_s += took
            self.longest_s = max(self.longest_s, took)

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


class StackSampler:
    """A thread that, while the loop thread is late (no ``beat`` for ``STALL_LOGGED_S``),
    counts the innermost frames of its Python stack."""

    def __init__(self, thread_id: int, late_s: float = STALL_LOGGED_S) -> None:
        self.thread_id = thread_id
        self.late_s = late_s
        self.last_beat_s = time.monotonic()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="seer-loop-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self, now_s: float) -> None:
        self.last_beat_s = now_s

    def take(self) -> list[str]:
        """The most sampled frames since the last ``take`` ("where (count)"), and forget them."""
        with self._lock:
            top = [f"{where} ({n})" for where, n in self._counts.most_common(WHERE_FRAMES)]
            self._counts.clear()
        return top

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S if self._late() else self.late_s / 2):
            if self._late() and (where := self._sample()) is not None:
                with self._lock:
                    self._counts[where] += 1

    def _sample(self) -> str | None:
        """Where the loop thread is now. No frame may outlive this call: a frame holds its
        locals, and a sampled ``Scheduler.cancel`` kept a cancelled 200,000-sample rollout
        alive until the next stall."""
        frame = sys._current_frames().get(self.thread_id)
        try:
            return None if frame is None else describe(frame)
        finally:
            del frame

    def _late(self) -> bool:
        return time.monotonic() - self.last_beat_s > self.late_s


def describe(frame, depth: int = 3) -> str:  # noqa: ANN001 - a frame object
    """The innermost frame, then the innermost ``depth`` frames of Seer's own code around it
    (outward): 'send (socket.py:713) < _send_identity (server.py:289) < _deliver (server.py:260)'."""
    def name(f) -> str:  # noqa: ANN001
        return f"{f.f_code.co_name} ({Path(f.f_code.co_filename).name}:{f.f_lineno})"

    names = [name(frame)]
    f = frame.f_back if str(frame.f_globals.get("__name__", "")).startswith("seer.") else frame
    while f is not None and len(names) <= depth:
        if str(f.f_globals.get("__name__", "")).startswith("seer."):
            names.append(name(f))
        f = f.f_back
    return " < ".join(names)


@dataclass(frozen=True)
class Stall:
    stall_s: float  # how much later than asked the watch woke
    interval_s: float  # the wall time the CPU, run-queue and GC figures cover (the stall and the sleep before it)
    cpu_s: float
    runq_s: float
    gc_s: float
    gc_longest_s: float
    where: list[str] = field(default_factory=list)
    major_faults: int = 0
    preempted: int = 0

    @property
    def blocked_s(self) -> float:
        return max(0.0, self.interval_s - self.cpu_s - self.runq_s)

    @property
    def cause(self) -> str:
        """``own_work`` (the loop thread ran), ``starved`` (it waited for a CPU) or
        ``blocked`` (it slept in the kernel), whichever took most of the interval."""
        shares = {"own_work": self.cpu_s, "starved": self.runq_s, "blocked": self.blocked_s}
        return max(shares, key=shares.__getitem__)

    def fields(self) -> dict:
        """The ``loop_stalled`` event's fields."""
        ms = lambda s: round(s * 1000)  # noqa: E731
        return {"stall_ms": ms(self.stall_s), "cause": self.cause, "interval_ms": ms(self.interval_s),
                "cpu_ms": ms(self.cpu_s), "runq_ms": ms(self.runq_s), "blocked_ms": ms(self.blocked_s),
                "gc_ms": ms(self.gc_s), "gc_longest_ms": ms(self.gc_longest_s), "major_faults": self.major_faults,
                "preempted": self.preempted, "where": self.where}


def log_stall(stall: Stall) -> None:
    (log.warning if stall.stall_s >= STALL_WARNED_S else log.info)("loop_stalled", **stall.fields())


class LoopWatch:
    """The loop's stall log (module docstring). ``run`` is the task; ``on_stall`` gets each
    stall (default: logs it as ``loop_stalled``)."""

    def __init__(self, on_stall: Callable[[Stall], None] = log_stall, *, interval_s: float = WATCH_INTERVAL_S,
                 threshold_s: float = STALL_LOGGED_S, sample: bool = True) -> None:
        self.on_stall = on_stall
        self.interval_s = interval_s
        self.threshold_s = threshold_s
        self.sample = sample
        self.max_stall_s = 0.0
        self.gc = GcTimer()

    async def run(self) -> None:
        sampler = StackSampler(threading.get_ident(), self.threshold_s) if self.sample else None
        self.gc.install()
        if sampler is not None:
            sampler.start()
        try:
            last_s = time.monotonic()
            cpu0, runq0 = thread_times()
            faults0, switches0 = thread_faults()
            gc0 = self.gc.total_s
            self.gc.longest_s = 0.0
            while True:
                await asyncio.sleep(self.interval_s)
                now = time.monotonic()
                stall_s = now - last_s - self.interval_s
                self.max_stall_s = max(self.max_stall_s, stall_s)
                if stall_s >= self.threshold_s:
                    (cpu, runq), (faults, switches) = thread_times(), thread_faults()
                    self.on_stall(Stall(stall_s, now - last_s, cpu - cpu0, runq - runq0, self.gc.total_s - gc0,
                                        self.gc.longest_s, sampler.take() if sampler is not None else [],
                                        faults - faults0, switches - switches0))
                elif sampler is not None and stall_s > self.threshold_s / 2:
                    sampler.take()  # late, but not a stall: its samples describe nothing logged
                # The next interval starts now (after the report, whose logging is not a stall).
                last_s = time.monotonic()
                if sampler is not None:
                    sampler.beat(last_s)
                cpu0, runq0 = thread_times()
                faults0, switches0 = thread_faults()
                gc0 = self.gc.total_s
                self.gc.longest_s = 0.0
        finally:
            self.gc.remove()
            if sampler is not None:
                sampler.stop()
