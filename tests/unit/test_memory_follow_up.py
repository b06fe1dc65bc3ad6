"""The follow-up collection after a memory release (controlplane/memory.py) runs only when
the release did not free the ended rollouts: a full collection walks every live object,
and after a 10,000-sample rollout, with the next one already running, a needless one
stood the loop still for 25-125 ms."""

from __future__ import annotations

from seer.controlplane.memory import COLLECTED_PER_SAMPLE, FOLLOW_UP_TRIMS, MemoryRelease, Released
from seer.controlplane.registry import Registry


def ticks(num_collected: int, samples: int = 100) -> list[str]:
    done: list[str] = []

    def release() -> Released:
        done.append("collect")
        return Released(rss_before_bytes=0, rss_after_bytes=0, num_collected=num_collected, seconds=0.0)

    memory = MemoryRelease(Registry(), lambda s: None, min_samples=samples, release=release,
                           trim=lambda: done.append("trim"))
    memory.ends.started("a", samples)
    for _ in range(FOLLOW_UP_TRIMS + 2):
        memory.tick(set())
    return done


def test_a_release_that_freed_the_rollouts_is_followed_by_trims_only():
    assert ticks(num_collected=COLLECTED_PER_SAMPLE * 100) == ["collect"] + ["trim"] * FOLLOW_UP_TRIMS


def test_a_release_that_freed_too_little_collects_again_on_the_last_follow_up():
    assert ticks(num_collected=COLLECTED_PER_SAMPLE * 100 - 1) == (
        ["collect"] + ["trim"] * (FOLLOW_UP_TRIMS - 1) + ["collect"])
