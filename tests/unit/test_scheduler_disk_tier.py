"""The host pool's disk tier in the scheduler core (controlplane/kvpool/tiers.py, table.py).

No files and no engine: a fake byte model stands for the pool and the disk (each block
or slot holds the (key, block index) it was written for); it runs the core's Spill and
Stage ops in order before the chunks decided after them, as the server does, and checks
every load against what it must hold.
"""

from __future__ import annotations

from seer.controlplane.kvpool.tiers import Spill, Stage, pick_victims
from seer.controlplane.scheduler import Dispatch, Scheduler
from seer.protocol import unpack_token_ids
from tests.unit.test_scheduler_pool import BS, caps, finish, rollout, scheduler

POOL = 16  # blocks: two requests in flight (one per engine, by KV admission) always fit


def small_engines() -> dict:
    """Engines whose KV budget admits one 96-token request at a time each."""
    import msgspec

    return {i: msgspec.structs.replace(caps(), kv_capacity_tokens=130) for i in (0, 1)}


class FakeBytes:
    def __init__(self) -> None:
        self.pool: dict[int, tuple[int, int]] = {}
        self.disk: dict[int, tuple[int, int]] = {}
        self.loads = 0

    def run(self, sched: Scheduler) -> None:
        for op in sched.kv.take_disk_ops() + sched.kv.take_prefetch_ops():
            if isinstance(op, Spill):
                for i, (b, s) in enumerate(zip(op.pool_blocks, op.slots)):
                    assert self.pool.get(b) == (op.key, i), "spilled a block that does not hold the request's KV"
                    self.disk[s] = self.pool.pop(b)
            else:
                assert isinstance(op, Stage)
                for i, (s, b) in enumerate(zip(op.slots, op.pool_blocks)):
                    assert self.disk.get(s) == (op.key, i), "staged a slot that does not hold the request's KV"
                    self.pool[b] = self.disk[s]
            sched.kv.disk_op_done(op, len(op.slots))

    def dispatched(self, d: Dispatch) -> None:
        kv = d.task.kv
        if kv is None or not kv.valid_tokens:
            return
        blocks = unpack_token_ids(kv.pool_blocks)
        for i in range(-(-kv.valid_tokens // BS)):
            assert self.pool.get(blocks[i]) == (kv.key, i), f"chunk would load block {i} of the wrong KV"
        self.loads += 1

    def saved(self, d: Dispatch, saved: int) -> None:
        if saved:
            blocks = unpack_token_ids(d.task.kv.pool_blocks)
            for i in range(-(-saved // BS)):
                self.pool[blocks[i]] = (d.task.kv.key, i)


def run_rollout(sched: Scheduler, num_requests: int, max_tokens: int, true_len: int) -> tuple[FakeBytes, list]:
    r = rollout("divided", num_requests, max_tokens=max_tokens)
    sched.submit(r)
    fake, log = FakeBytes(), []
    for _ in range(2000):
        ds = sched.schedule()
        fake.run(sched)  # before any chunk decided after the ops is sent
        if not ds and r.done:
            break
        assert ds
        for d in ds:
            fake.dispatched(d)
            log.append(d)
            fake.saved(d, finish(sched, d, true_len))
            fake.run(sched)
    assert r.done and all(q.num_generated_tokens == true_len for q in r.groups[0].requests)
    return fake, log


def test_with_a_disk_tier_no_chunk_runs_without_saving_and_every_load_is_the_right_kv():
    """8 requests of 96 tokens need up to 7 blocks each; the pool has 16 (enough for the
    two in flight, not for the 6 waiting). With 64 disk slots the KV of waiting requests
    goes to disk and comes back: no kv_pool_full, every chunk loads exactly its own KV."""
    sched = scheduler(pool_blocks=POOL, engines=small_engines())
    sched.kv.attach_disk(64)
    fake, log = run_rollout(sched, 8, 96, 96)
    assert not any(d.kv_pool_full or d.kv_lost for d in log)
    assert sched.kv.disk_counts["spilled_blocks"] > 0 and sched.kv.disk_counts["staged_blocks"] > 0
    assert fake.loads == sum(1 for d in log if d.task.kv is not None and d.task.kv.valid_tokens)
    assert sched.pool.allocator.num_used == 0 and sched.kv.disk.num_free == 64


def test_without_a_disk_tier_the_same_rollout_runs_chunks_without_saving():
    """The baseline of the test above: the pool alone is too small."""
    sched = scheduler(pool_blocks=POOL, engines=small_engines())
    _, log = run_rollout(sched, 8, 96, 96)
    assert any(d.kv_pool_full for d in log)


def test_a_full_disk_falls_back_to_running_without_saving_and_loses_nothing():
    """Two disk slots cannot take a request's KV: chunks run without saving (re-prefill
    next time, logged as kv_pool_full), every sample completes, every load is right."""
    sched = scheduler(pool_blocks=POOL, engines=small_engines())
    sched.kv.attach_disk(2)
    _, log = run_rollout(sched, 8, 96, 96)
    assert any(d.kv_pool_full or d.kv_lost for d in log)
    assert sched.kv.disk_counts["disk_full"] > 0


def test_failed_spills_cost_re_prefill_never_another_requests_kv():
    """Every spill fails (nothing reaches the disk): stages then find no valid slot and
    leave their blocks invalid, so a chunk's pool blocks hold its own KV or nothing (the
    engine recomputes from the first invalid block) -- never another request's; every
    sample completes."""
    sched = scheduler(pool_blocks=POOL, engines=small_engines())
    sched.kv.attach_disk(64)
    r = rollout("divided", 8, max_tokens=96)
    sched.submit(r)
    pool: dict[int, tuple[int, int] | None] = {}
    failed = 0

    def run_ops() -> None:
        nonlocal failed
        for op in sched.kv.take_disk_ops():
            if isinstance(op, Spill):
                for b in op.pool_blocks:
                    pool.pop(b, None)
                sched.kv.disk_op_done(op, 0)
                failed += 1
            else:
                for b in op.pool_blocks:
                    pool[b] = None  # invalidated, nothing valid read back
                sched.kv.disk_op_done(op, 0)

    for _ in range(2000):
        ds = sched.schedule()
        run_ops()
        if not ds and r.done:
            break
        for d in ds:
            kv = d.task.kv
            if kv is not None:
                blocks = unpack_token_ids(kv.pool_blocks)
                for i in range(-(-kv.valid_tokens // BS)):
                    assert pool.get(blocks[i]) in ((kv.key, i), None)
            saved = finish(sched, d, 96)
            if saved:
                for i in range(-(-saved // BS)):
                    pool[unpack_token_ids(kv.pool_blocks)[i]] = (kv.key, i)
            run_ops()
    assert r.done and failed and all(q.num_generated_tokens == 96 for q in r.groups[0].requests)
    assert sched.kv.disk_counts["failed"] >= failed


def test_victims_are_taken_in_the_given_needed_last_order_until_enough_blocks_are_free():
    """pick_victims walks the needed-last order and stops once enough blocks are free;
    nothing is evicted when all candidates together are not enough."""
    assert pick_victims({1: 2, 2: 2, 3: 2}, 3, [2, 1, 3]) == [2, 1]
    assert pick_victims({1: 2, 2: 2}, 5, [1, 2]) is None
    assert pick_victims({1: 2}, 0, [1]) == []


def test_without_prefetch_every_stage_is_on_the_dispatch_path():
    """disk_prefetch = false: KV comes back from disk only when its chunk is dispatched."""
    sched = scheduler(pool_blocks=POOL, engines=small_engines())
    sched.kv.attach_disk(64, prefetch=False)
    run_rollout(sched, 8, 96, 96)
    counts = sched.kv.disk_counts
    assert counts["prefetched"] == 0 and counts["staged_on_dispatch"] > 0
