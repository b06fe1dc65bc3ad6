"""The disk tier reads the policies' own queue order (controlplane/kvpool/tiers.py
``QueueOrder``; ``upcoming`` / ``needed_last`` of the chunked policies) and prefetches
down the queue after chunks are dispatched (``HostPoolTable.take_prefetch_ops``).

Pure core only: no files, no engines. The table is driven through its own calls
(``plan``, ``saved``, ``drop``) and the scheduler through ``schedule``/``chunk_finished``
with the byte model of test_scheduler_disk_tier.py standing for the pool and the disk.
"""

from __future__ import annotations

import pytest

from seer.controlplane.policies import make_policy
from seer.controlplane.kvpool.tiers import QueueOrder, Spill, Stage
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import Group, Request, Rollout
from seer.protocol import SamplingParams
from tests.unit.test_chunked_policies import rollout as length_rollout
from tests.unit.test_chunked_policies import run_chunk
from tests.unit.test_chunked_policies import scheduler as sim_scheduler
from tests.unit.test_scheduler_disk_tier import FakeBytes, small_engines
from tests.unit.test_scheduler_pool import GEOM, PROMPT, caps, finish, rollout, scheduler


# ---------------------------------------------------------------------- the policies' reading

@pytest.mark.parametrize("policy", ["divided", "context"])
def test_upcoming_is_the_order_assign_serves_and_needed_last_its_inverse(policy):
    """With room for everyone, ``upcoming(n)`` lists the waiting requests in exactly the
    order the next ``assign`` dispatches them, and ``needed_last`` is that order reversed;
    also after a round of chunks of different lengths (context: probes first, then by
    estimate -- not arrival order)."""
    sched = sim_scheduler(policy, engines=2, starvation_interval=0)
    r = length_rollout(policy, [[20, 40, 60], [64, 10, 30], [5, 50, 64]])
    sched.submit(r)
    pol = sched.policy(policy)
    for round_ in range(3):
        waiting = pol.upcoming(len(pol))
        assert len(waiting) == len(pol) and pol.upcoming(2) == waiting[:2]
        assert pol.needed_last(list(reversed(waiting))) == waiting[::-1]
        ds = sched.schedule()
        assert [d.request for d in ds] == waiting
        assert pol.needed_last(waiting) == [] and pol.upcoming(3) == []  # all running: none waits
        if policy == "context" and round_ == 0:
            assert waiting != sorted(waiting, key=lambda q: (q.group.group_index, q.sample_index))
        for d in ds:
            run_chunk(sched, d, d.request.oracle_length)


# ---------------------------------------------------------------------- the table, under `context`

def kv_state(policy: str = "context", *, depth: int = 0, share: float = 1.0) -> tuple[Scheduler, list[Request]]:
    """A one-engine scheduler with an 8-block pool full of the KV of samples 1-4 of one
    group (2 blocks each), all waiting in ``policy``'s queue; their chunks returned in
    the order 4, 3, 2, 1 (so return order -- the old rule -- says 1 is needed last, while
    the queue serves 1, 2, 3, 4). The prefetch window may fill ``share`` of the pool
    (these tests' tiny pool: all of it, unless a test says otherwise)."""
    sched = scheduler(policy, pool_blocks=8, engines={0: caps()}, starvation_interval=0)
    sched.kv.attach_disk(64, depth=depth)
    sched.kv.prefetch_pool_share = share
    r = rollout(policy, 7, max_tokens=256)
    sched.submit(r)
    reqs = r.groups[0].requests
    for i, q in enumerate(reqs[1:5], 1):
        plan = sched.kv.plan(q, 0, GEOM.fingerprint, PROMPT, 16, True, 0, 100 + i)
        assert plan.kv is not None and plan.kv.save
    for q in reversed(reqs[1:5]):
        sched.kv.saved(q, PROMPT + 15)
    assert sched.pool.allocator.num_free == 0
    return sched, reqs


def spills(ops: list) -> list[int]:
    return [op.key for op in ops if isinstance(op, Spill)]


def stages(ops: list) -> list[int]:
    return [op.key for op in ops if isinstance(op, Stage)]


def test_eviction_follows_the_policys_order_not_the_return_order():
    """A chunk that needs 4 more blocks spills the two waiting requests ``context`` will
    serve last (samples 4 then 3), not the two that returned last (1 and 2)."""
    sched, reqs = kv_state()
    plan = sched.kv.plan(reqs[5], 0, GEOM.fingerprint, PROMPT, 48, True, 0, 200)
    assert plan.kv is not None and plan.kv.save and not plan.pool_full
    assert spills(sched.kv.take_disk_ops()) == [reqs[4].kv_key, reqs[3].kv_key]


def test_prefetch_stages_the_on_disk_kv_the_policy_serves_first():
    """Samples 3 and 4 on disk, room for one of them: the prefetch stages 3 (served
    sooner by the queue, although 4 returned earlier) and leaves 4 on disk -- nothing
    waiting is spilled for it, everything else in DRAM is needed sooner."""
    sched, reqs = kv_state()
    sched.kv.plan(reqs[5], 0, GEOM.fingerprint, PROMPT, 48, True, 0, 200)
    sched.kv.take_disk_ops()
    sched.kv.drop(reqs[5])  # 4 blocks free
    sched.kv.plan(reqs[6], 0, GEOM.fingerprint, PROMPT, 16, True, 0, 201)  # 2 of them taken
    assert sched.kv.take_disk_ops() == []
    ops = sched.kv.take_prefetch_ops()
    assert stages(ops) == [reqs[3].kv_key] and spills(ops) == []
    assert all(op.prefetch for op in ops)
    assert reqs[4].kv_key in sched.kv._on_disk


def test_prefetch_makes_room_by_spilling_only_kv_needed_after_it():
    """Samples 3 and 4 on disk, room for one, the rest of the pool held by samples 1, 2
    (needed sooner) and 5 (needed later): the prefetch stages 3 into the free blocks,
    then spills 5 to stage 4 -- the queue's order decides who makes room. Samples 1
    and 2 stay."""
    sched, reqs = kv_state(depth=8)
    sched.kv.plan(reqs[5], 0, GEOM.fingerprint, PROMPT, 48, True, 0, 200)  # spills 4 and 3
    sched.kv.take_disk_ops()
    sched.kv.drop(reqs[5])
    ops = sched.kv.take_prefetch_ops()  # 4 blocks free: both come back
    assert stages(ops) == [reqs[3].kv_key, reqs[4].kv_key] and spills(ops) == []
    sched.kv.plan(reqs[6], 0, GEOM.fingerprint, PROMPT, 48, True, 0, 201)  # spills 4 and 3 again
    assert spills(sched.kv.take_disk_ops()) == [reqs[4].kv_key, reqs[3].kv_key]
    sched.kv.drop(reqs[6])  # 4 blocks free
    sched.kv.plan(reqs[5], 0, GEOM.fingerprint, PROMPT, 16, True, 0, 202)
    sched.kv.saved(reqs[5], PROMPT + 15)  # 2 of them taken by sample 5, needed after 3 and 4
    assert sched.kv.take_disk_ops() == []
    ops = sched.kv.take_prefetch_ops()
    assert [(type(op), op.key) for op in ops] == [(Stage, reqs[3].kv_key), (Spill, reqs[5].kv_key),
                                                  (Stage, reqs[4].kv_key)]


def test_prefetch_reaches_only_depth_requests_down_the_queue():
    """depth 2: the queue's next two (the probe and sample 1) have their KV in DRAM or
    none, so sample 3's on-disk KV stays there; the default depth (4 per engine) stages it."""
    for depth, staged in ((2, False), (0, True)):
        sched, reqs = kv_state(depth=depth)
        sched.kv.plan(reqs[5], 0, GEOM.fingerprint, PROMPT, 48, True, 0, 200)
        sched.kv.take_disk_ops()
        sched.kv.drop(reqs[5])
        assert (reqs[3].kv_key in stages(sched.kv.take_prefetch_ops())) is staged


def test_the_default_prefetch_depth_counts_live_engines_not_lost_ones():
    """The default depth is 4 per live engine. Lost engines stay in the scheduler's tables
    (the newest 32 of them, for status and late messages) but bring no waiting requests to
    prefetch for: after three of four engines are lost the window is back to 4."""
    sched = scheduler("context", engines={i: caps() for i in range(4)})
    assert sched.kv.num_live_engines == 4
    for engine_id in (1, 2, 3):
        sched.engine_lost(engine_id)
    assert len(sched.kv.engine_hosts) == 4 and sched.kv.num_live_engines == 1
    sched.engine_joined(4, caps())
    assert sched.kv.num_live_engines == 2


def test_a_request_placed_but_not_yet_sent_is_needed_before_the_whole_queue():
    """A waiting request its policy no longer holds (assigned, held for room) is never
    the first victim, even though return order would pick it."""
    sched, reqs = kv_state("divided")
    pol = sched.policy("divided")
    taken = pol._next()  # the probe, placed: out of the queue, still waiting
    assert taken is reqs[0]
    order = sched.kv.queue.soonest_first([reqs[4], reqs[1], reqs[0]])
    assert order == [reqs[0], reqs[1], reqs[4]]


def test_a_policy_that_cannot_tell_its_order_falls_back_to_return_order():
    """Requests of a policy that does not tell its order (``tells_order`` False, as the
    whole-sample ones): needed in the order their chunks returned, and all of them are
    due for prefetch."""
    sched, reqs = kv_state("divided")
    sched.kv.queue = QueueOrder({"divided": make_policy("request")})
    for q in (reqs[2], reqs[4], reqs[1]):
        sched.kv.saved(q, PROMPT + 15)
    assert sched.kv.queue.soonest_first([reqs[1], reqs[2], reqs[4]]) == [reqs[2], reqs[4], reqs[1]]
    assert sched.kv.queue.due([reqs[1], reqs[4]], 1) == [reqs[4], reqs[1]]


# ---------------------------------------------------------------------- prefetch off the dispatch path

def one_chunk_engines() -> dict:
    """Engines whose KV budget admits one chunk at a time each: ``small_engines`` hold
    three of this one-group rollout's chunks, whose prompt block they share."""
    import msgspec

    return {i: msgspec.structs.replace(caps(), kv_capacity_tokens=64) for i in (0, 1)}


def run_counting(policy: str, prefetch_after_dispatch: bool, pool_blocks: int = 24, depth: int = 2) -> dict:
    """A rollout of 8 x 96 tokens on two engines (one chunk in flight each) through a
    ``pool_blocks`` pool and a disk tier, ops run as the server runs them: those the
    sends wait for, then the prefetch -- after every chunk's return and, if
    ``prefetch_after_dispatch``, after every dispatch too. Counts the dispatches that
    load KV staged since the previous dispatches went out: their send waits for the
    stage (the disk read is on the critical path); a stage taken right after a dispatch
    runs while the chunks compute."""
    sched = scheduler(policy, pool_blocks=pool_blocks, engines=one_chunk_engines(), starvation_interval=0)
    sched.kv.attach_disk(64, depth=depth)
    r = rollout(policy, 8, max_tokens=96)
    sched.submit(r)
    fake = FakeBytes()
    since_sent: set[int] = set()  # keys staged since the last dispatches were sent

    def run_ops(ops: list) -> None:
        for op in ops:
            if isinstance(op, Spill):
                for b, s in zip(op.pool_blocks, op.slots):
                    fake.disk[s] = fake.pool.pop(b)
            else:
                for s, b in zip(op.slots, op.pool_blocks):
                    fake.pool[b] = fake.disk[s]
                since_sent.add(op.key)
            sched.kv.disk_op_done(op, len(op.slots))

    waited = loads = 0
    for _ in range(2000):
        ds = sched.schedule()
        run_ops(sched.kv.take_disk_ops())  # what these sends wait for
        for d in ds:
            fake.dispatched(d)
            if d.task.kv is not None and d.task.kv.valid_tokens:
                loads += 1
                waited += d.task.kv.key in since_sent
        if prefetch_after_dispatch:
            run_ops(sched.kv.take_prefetch_ops())  # in the background, while the chunks run
        since_sent.clear()
        if not ds and r.done:
            break
        for d in ds:
            fake.saved(d, finish(sched, d, 96))
            run_ops(sched.kv.take_disk_ops() + sched.kv.take_prefetch_ops())
    assert r.done and sched.pool.allocator.num_used == 0
    return {**sched.kv.disk_counts, "waited": waited, "loads": loads}


@pytest.mark.parametrize("policy", ["divided", "context"])
def test_prefetch_after_dispatch_takes_the_disk_reads_off_the_dispatch_path(policy):
    """Prefetching only when a chunk returns stages the next request's KV in the step
    that dispatches it (its send waits for the read); prefetching also after the
    dispatches stages the next requests' KV while the chunks run: no dispatch waits for
    a stage, and the KV still went to disk and back."""
    old = run_counting(policy, prefetch_after_dispatch=False)
    new = run_counting(policy, prefetch_after_dispatch=True)
    assert new["spilled_blocks"] > 0 and new["prefetched"] > 0 and new["lost"] == 0
    assert new["waited"] == 0 and new["staged_on_dispatch"] == 0
    assert old["waited"] > 0


def test_the_prefetch_window_fills_at_most_its_share_of_the_pool():
    """With the default share (half the pool), samples 1 and 2 (needed first, in DRAM)
    already hold 4 of the 8 blocks, so sample 3's on-disk KV is not staged even with
    room free: a window larger than the share made saves and prefetches spill each
    other's KV over and over on real engines. With the whole pool allowed it is staged."""
    for share, staged in ((0.5, False), (1.0, True)):
        sched, reqs = kv_state(depth=8, share=share)
        sched.kv.plan(reqs[5], 0, GEOM.fingerprint, PROMPT, 48, True, 0, 200)  # spills 4 and 3
        sched.kv.take_disk_ops()
        sched.kv.drop(reqs[5])  # 4 blocks free
        assert (reqs[3].kv_key in stages(sched.kv.take_prefetch_ops())) is staged


def test_held_requests_are_needed_in_the_order_they_were_placed():
    """Requests placed on an engine but held back (it is at max_chunks_per_engine) go out
    first come first served: they rank before the whole queue, in placement order -- not
    in whatever order the caller listed them."""
    order = QueueOrder()
    reqs = rollout("divided", 3).groups[0].requests
    for r in (reqs[2], reqs[0], reqs[1]):
        order.held(r)
    assert order.soonest_first(list(reqs)) == [reqs[2], reqs[0], reqs[1]]
    order.released(reqs[2])
    order.held(reqs[2])
    assert order.soonest_first(list(reqs)) == [reqs[0], reqs[1], reqs[2]]


@pytest.mark.parametrize("policy", ["divided", "context"])
def test_with_held_requests_each_waiting_kv_is_staged_back_once(policy):
    """One chunk in flight per engine (max_chunks_per_engine = 1), so the policy's later
    choices wait placed-and-held; every chunk moves, so every continuation loads its KV
    from a pool too small for the waiting ones: the prefetch stages each continuation's
    KV back at most once. Ranking held requests in arbitrary order made the prefetch
    stage one and spill the next, round after round (4x the stages on this rollout)."""
    sched = scheduler(policy, pool_blocks=40, placement="migrate", max_chunks_per_engine=1, starvation_interval=0)
    sched.kv.attach_disk(1024)
    r = Rollout(rollout_id="r", policy=policy, accepted_s=0.0)
    for gi in range(8):  # 8 prompts of 100 tokens x 2 samples: up to 10 blocks of KV each
        g = Group(group_id=f"r/{gi}", rollout=r, group_index=gi, prompt_id=str(gi))
        g.requests += [Request(request_id=f"r/{gi}/{i}", group=g, sample_index=i, prompt_token_ids=[5 + gi] * 100,
                               sampling=SamplingParams(max_tokens=48, seed=1)) for i in range(2)]
        r.groups.append(g)
    sched.submit(r)
    fake, inflight, continuations = FakeBytes(), [], 0
    for _ in range(2000):
        ds = sched.schedule()
        fake.run(sched)
        for d in ds:
            fake.dispatched(d)
            inflight.append(d)
            continuations += d.request.num_generated_tokens > 0
        if not inflight:
            break
        d = inflight.pop(0)  # the oldest chunk returns first
        fake.saved(d, finish(sched, d, 48))
        fake.run(sched)
    counts = sched.kv.disk_counts
    assert r.done and counts["lost"] == 0 and counts["spilled_blocks"] > 0
    assert counts["prefetched"] + counts["staged_on_dispatch"] <= continuations
