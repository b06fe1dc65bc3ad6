"""When the control plane gives ended rollouts' memory back, tick by tick
(controlplane/memory.py, ``MemoryRelease``): drop the engines' in-flight logs when a
rollout ended; after large ones, a collection, trims on the next ticks and one
follow-up collection; the loop's standstill is reported each time."""

from __future__ import annotations

from structlog.testing import capture_logs

from seer.controlplane.memory import FOLLOW_UP_TRIMS, MemoryRelease, Released
from seer.controlplane.registry import Registry
from tests.unit.core_parts import Clock, admit, dispatch, make_core, start_rollout


class Work:
    """What the tick asked for: collections (each standing the loop still 0.25 s) and trims."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def release(self) -> Released:
        self.done.append("collect")
        return Released(rss_before_bytes=3 << 20, rss_after_bytes=1 << 20, num_collected=5, seconds=0.25)

    def trim(self) -> None:
        self.done.append("trim")


def memory(min_samples: int = 100) -> tuple[MemoryRelease, Work, list[float]]:
    work, stalls = Work(), []
    return MemoryRelease(Registry(), stalls.append, min_samples=min_samples, release=work.release,
                         trim=work.trim), work, stalls


def test_small_rollouts_that_end_are_left_to_the_collectors_own_schedule():
    """Fewer ended samples than the threshold: no collection, no trim."""
    release, work, stalls = memory()
    release.ends.started("a", 99)
    release.tick({"a"})
    release.tick(set())
    assert work.done == [] and stalls == []


def test_a_release_is_followed_by_trims_and_one_follow_up_collection():
    """Once enough samples ended: a collection now, a trim on each of the next ticks, and
    on the last of them a follow-up collection; then nothing until more rollouts end."""
    release, work, stalls = memory()
    release.ends.started("a", 100)
    with capture_logs() as logs:
        for _ in range(FOLLOW_UP_TRIMS + 3):
            release.tick(set())
    assert work.done == ["collect"] + ["trim"] * (FOLLOW_UP_TRIMS - 1) + ["collect"]
    assert [(e["event"], e["follow_up"], e["ms"], e["rss_after_mb"]) for e in logs] == [
        ("memory_released", False, 250, 1.0), ("memory_released", True, 250, 1.0)]
    assert stalls == [0.25, 0.25]  # held against no engine and no chunk


def test_a_release_of_rollouts_all_taken_apart_only_trims():
    """Every ended sample was in a rollout taken apart (reference counting freed it): the
    release trims and collects nothing, now or on the follow-up ticks, and says so; one
    rollout left cyclic brings the collection back."""
    from tests.unit.test_chunked_policies import rollout as make_rollout

    release, work, stalls = memory()
    release.ends.started("a", 100)
    release.dismantle(make_rollout("context", [[5] * 10] * 10))
    with capture_logs() as logs:
        for _ in range(FOLLOW_UP_TRIMS + 2):
            release.tick(set())
    assert work.done == ["trim"] * (FOLLOW_UP_TRIMS + 1)
    assert [(e["event"], e["collected"], e["num_collected"]) for e in logs] == [("memory_released", False, 0)]
    assert len(stalls) == 1 and release.dismantled_samples == 0
    release.ends.started("b", 100)
    release.tick(set())
    assert work.done[-1] == "collect"


def test_a_release_due_during_the_follow_ups_starts_them_again():
    """Another large rollout ends while trims are pending: that tick's trim, then a
    collection at once, and the follow-up count starts over."""
    release, work, _ = memory()
    release.ends.started("a", 100)
    release.ends.started("b", 100)
    release.tick({"b"})
    release.tick({"b"})
    release.tick(set())
    assert work.done == ["collect", "trim", "trim", "collect"] and release.trims_left == FOLLOW_UP_TRIMS


def test_a_cancelled_rollout_is_no_longer_held_by_the_engines_inflight_logs(tmp_path):
    """Its chunks left the engine, and the engine's change log kept them; after the next
    tick the log no longer holds them (readers rescan the in-flight map instead)."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 0)
    start_rollout(core, "r", group_size=2)
    core.memory.ends.started("r", 2)
    dispatch(core, clock)
    core.clients.cancel("r", "cancelled")
    inflight = core.registry.engines[0].inflight
    assert inflight.changes_since(0) is not None and len(inflight) == 0
    core.release_memory()
    assert inflight.changes_since(0) is None
