"""The loop's stall log (controlplane/loopwatch.py): a stall is found, measured, and told
apart -- the daemon's own work (CPU), machine starvation (waiting for a CPU) or a blocking
call (asleep in the kernel) -- with where the loop thread was while it lasted."""

from __future__ import annotations

import asyncio
import gc
import time

from seer.controlplane.loopwatch import LoopWatch, Stall, thread_times


def busy_python_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(100))


def watch_while(block) -> list[Stall]:  # noqa: ANN001
    stalls: list[Stall] = []

    async def go() -> None:
        watch = LoopWatch(stalls.append)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.1)
        block()
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert watch.max_stall_s >= max((s.stall_s for s in stalls), default=0.0)

    asyncio.run(go())
    return stalls


def test_the_classification_takes_the_largest_share():
    assert Stall(0.5, 0.52, cpu_s=0.4, runq_s=0.1, gc_s=0.0, gc_longest_s=0.0).cause == "own_work"
    assert Stall(0.5, 0.52, cpu_s=0.1, runq_s=0.4, gc_s=0.0, gc_longest_s=0.0).cause == "starved"
    stall = Stall(0.5, 0.52, cpu_s=0.01, runq_s=0.01, gc_s=0.0, gc_longest_s=0.0)
    assert stall.cause == "blocked" and stall.fields()["blocked_ms"] == 500


def test_thread_times_grow_with_work():
    cpu0, runq0 = thread_times()
    busy_python_loop(0.05)
    cpu1, runq1 = thread_times()
    assert cpu1 > cpu0 and runq1 >= runq0


def test_a_python_loop_that_holds_the_loop_is_logged_as_cpu_with_where_it_ran():
    (stall,) = watch_while(lambda: busy_python_loop(0.4))
    assert stall.stall_s >= 0.3
    assert stall.cause in ("own_work", "starved")  # "starved" only when the machine is loaded
    assert stall.cpu_s + stall.runq_s > stall.blocked_s
    assert any("busy_python_loop" in where for where in stall.where), stall.where


def test_a_blocking_call_is_logged_as_blocked():
    (stall,) = watch_while(lambda: time.sleep(0.4))
    assert stall.stall_s >= 0.3 and stall.cause == "blocked" and stall.cpu_s < 0.1


def test_a_garbage_collection_is_counted():
    def collect_a_lot() -> None:
        junk = [[i] for i in range(300_000)]
        for a, b in zip(junk, junk[1:]):
            a.append(b)
            b.append(a)
        del junk
        t = time.monotonic()
        gc.collect()
        busy_python_loop(max(0.0, 0.15 - (time.monotonic() - t)))

    stalls = watch_while(collect_a_lot)
    assert stalls and stalls[0].gc_s > 0


def test_the_sampler_keeps_no_frame_and_so_nothing_the_loop_held():
    """A stall sampled inside a function whose locals hold a large object: once the function
    returns the object is freed (a kept frame would hold it until the next stall)."""
    import weakref

    class Big:
        pass

    refs = []

    def holds_big_while_busy() -> None:
        big = Big()
        refs.append(weakref.ref(big))
        busy_python_loop(0.4)

    (stall,) = watch_while(holds_big_while_busy)
    assert any("busy_python_loop" in where for where in stall.where), stall.where  # sampled in there
    assert refs[0]() is None
