"""The simulator's KV pool tiers (sim/kv_tiers.py): what a chunk start pays for its KV."""

from __future__ import annotations

from seer.sim.kv_tiers import PoolTiers, TierConfig


def chunk(t: PoolTiers, key: str, ctx: int, now: float, end_ctx: int, finished: bool = False) -> tuple[int, float]:
    out = t.dispatch(key, ctx, now)
    t.returned(key, end_ctx, now + 1.0, finished)
    return out


def test_without_a_disk_a_chunk_that_does_not_fit_runs_without_saving_and_re_prefills_next_time():
    """DRAM for 100 tokens: b's chunk (60 tokens) does not fit next to a's waiting 60, so
    b's next chunk has no pool KV; a's does."""
    t = PoolTiers(TierConfig(dram_tokens=100))
    chunk(t, "a", 10, 0.0, 60)
    assert t.dispatch("b", 60, 1.0) == (0, 0.0) and t.num_refused == 1
    t.returned("b", 90, 2.0, False)
    assert t.dispatch("a", 60, 3.0) == (60, 0.0)
    t.returned("a", 70, 4.0, True)
    assert t.dispatch("b", 90, 5.0) == (0, 0.0)
    assert t.reprefill_tokens == 90


def test_with_a_disk_the_request_needed_last_is_spilled_and_its_read_is_on_the_critical_path():
    """With a disk (1 s per token): b's dispatch spills a (needed later) -- b waits 60 s for
    the write -- and a's next dispatch waits for its read."""
    t = PoolTiers(TierConfig(dram_tokens=100, disk=True, disk_s_per_token=1.0))
    chunk(t, "a", 10, 0.0, 60)
    pooled, wait = t.dispatch("b", 60, 1.0)
    assert (pooled, wait) == (0, 60.0)
    t.returned("b", 90, 62.0, True)
    pooled, wait = t.dispatch("a", 60, 100.0)
    assert pooled == 60 and wait == 60.0 and t.num_staged_on_path == 1


def test_prefetch_stages_the_soonest_needed_kv_ahead_so_its_chunk_does_not_wait():
    """With prefetch, a's KV comes back while b's chunk finishes; a dispatched after the
    stage ended waits for nothing."""
    t = PoolTiers(TierConfig(dram_tokens=100, disk=True, prefetch=True, disk_s_per_token=1.0))
    chunk(t, "a", 10, 0.0, 60)
    t.dispatch("b", 60, 1.0)  # spills a (60 s write)
    t.returned("b", 90, 62.0, True)  # room again: a is staged back (60 s read, from t=62)
    pooled, wait = t.dispatch("a", 60, 200.0)
    assert pooled == 60 and wait == 0.0 and t.num_prefetched == 1
    assert t.critical_s == 60.0  # only b's spill wait
