"""One KV pool per host in the scheduler core (controlplane/kvpool/table.py via the
scheduler's ``add_host_pool``, ``take_transfers``, ``transfer_finished``,
``transfer_abandoned``, ``remove_host_pool``).

No shared memory, no agents: pools are allocators with names, a "transfer" is a decision
the test answers. Engine 0 runs on host A (the control plane's own, ""), engine 1 on
host B, and ``placement = "migrate"`` sends every chunk to the other engine, so every
chunk after the first needs its KV from the other host.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from seer.config import SchedulerConfig
from seer.controlplane.kvpool.table import PoolBinding, Transfer
from seer.controlplane.scheduler import Dispatch, Scheduler
from seer.controlplane.state import Group, Request, RequestState, Rollout
from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import PoolAllocator
from seer.protocol import EngineCapabilities, SamplingParams, unpack_token_ids
from tests.unit.chunks import finished

BS = 16
CHUNK = 16
PROMPT = 17
GEOM = PoolGeometry(num_layers=2, num_kv_heads=1, head_size=8, block_size=BS, dtype="float32")
A, B = "", "host-b"


def caps() -> EngineCapabilities:
    return EngineCapabilities(backend="vllm", model="m", dtype="float32", max_model_len=4096, vocab_size=259,
                              kv_capacity_tokens=100_000, block_size=BS, kv_geometry=GEOM)


def pool(host: str, num_blocks: int = 64, agent: bool = True, name: str | None = None) -> PoolBinding:
    return PoolBinding(name=name or f"seer-kv-{host or 'a'}", allocator=PoolAllocator(num_blocks, BS),
                       fingerprint=GEOM.fingerprint, min_load_tokens=32, host_id=host,
                       transport="tcp" if agent else "", address=f"tcp://{host or 'a'}:1" if agent else "")


def scheduler(*, blocks_a: int = 64, blocks_b: int = 64, agent_b: bool = True, hosts=(A, B),
              placement: str = "migrate", cap: int = 1024, ahead: bool = True) -> Scheduler:
    config = SchedulerConfig(policy="divided", chunk_size_tokens=CHUNK, kv_admission_fraction=1.0,
                             placement=placement, max_chunks_per_engine=cap)
    sched = Scheduler(config, lambda: 0.0)
    for engine_id, host in enumerate(hosts):
        sched.engine_joined(engine_id, caps(), host_id=host)
    sched.add_host_pool(pool(A, blocks_a))
    sched.add_host_pool(pool(B, blocks_b, agent=agent_b))
    sched.kv.transfer_ahead = ahead  # kv_pool.transfer_prefetch (off by default; on here unless said)
    return sched


def rollout(num_requests: int, max_tokens: int = 64, rid: str = "r") -> Rollout:
    r = Rollout(rollout_id=rid, policy="divided", accepted_s=0.0)
    g = Group(group_id=f"{rid}/0", rollout=r, group_index=0, prompt_id="0")
    for i in range(num_requests):
        g.requests.append(Request(request_id=f"{rid}/0/{i}", group=g, sample_index=i, prompt_token_ids=[5] * PROMPT,
                                  sampling=SamplingParams(max_tokens=max_tokens, seed=1)))
    r.groups.append(g)
    return r


def finish(sched: Scheduler, d: Dispatch, true_len: int) -> int:
    """Finish a chunk as a vLLM engine with the Seer connector would (see test_scheduler_pool)."""
    context = len(unpack_token_ids(d.task.prompt_token_ids))
    left = true_len - d.request.num_generated_tokens
    n = min(d.task.sampling.max_tokens, left)
    kv = d.task.kv
    saved = context + n - 1 if kv is not None and kv.save and n == d.task.sampling.max_tokens else 0
    sched.chunk_finished(finished(d.engine_id, d.task.task_id, [7] * n, [-0.5] * n, "stop" if n == left else "length",
                         kv_saved_tokens=saved))
    return saved


def blocks(d: Dispatch) -> list[int]:
    assert d.task.kv is not None
    return unpack_token_ids(d.task.kv.pool_blocks)


def first_chunk_then_move(sched: Scheduler, r: Rollout) -> tuple[Dispatch, int, Transfer]:
    """Run the request's first chunk on engine 0 (host A); its second is placed on engine 1
    (host B) and waits for one transfer."""
    sched.submit(r)
    (d1,) = sched.schedule()
    assert d1.engine_id == 0
    saved = finish(sched, d1, 64)
    assert sched.schedule() == [], "the moved chunk must wait for its KV"
    (t,) = sched.take_transfers()
    assert sched.take_transfers() == []
    return d1, saved, t


# ---------------------------------------------------------------------- the transfer decision

def test_a_chunk_placed_on_another_host_waits_for_a_transfer_of_exactly_the_saved_blocks():
    """The transfer copies the blocks holding the saved tokens from A's pool into fresh
    blocks of B's pool, under the request's key and the current weights epoch."""
    sched = scheduler()
    r = rollout(1)
    d1, saved, t = first_chunk_then_move(sched, r)
    req = r.groups[0].requests[0]
    assert (t.src.host_id, t.dst.host_id) == (A, B)
    assert t.num_tokens == saved == PROMPT + CHUNK - 1
    assert t.src_blocks == blocks(d1)[:len(t.dst_blocks)]
    assert len(t.dst_blocks) == -(-saved // BS)
    assert t.key == d1.task.kv.key and t.kv_epoch == 0
    assert sched.kv.pools[B].allocator.blocks_of(t.key) == t.dst_blocks
    assert req.state is RequestState.RUNNING and req.engine_id == 1  # in flight, held on engine 1


def test_after_a_successful_transfer_the_chunk_loads_from_the_destination_pool():
    """PullDone ok: the chunk goes to engine 1 with a descriptor into B's pool (valid tokens
    = what A held, leading blocks = the copied ones, grown for its save) and A's blocks
    are free."""
    sched = scheduler()
    r = rollout(1)
    d1, saved, t = first_chunk_then_move(sched, r)
    done, (d2,) = sched.transfer_finished(t.transfer_id, ok=True)
    assert done is t and d2.engine_id == 1
    kv = d2.task.kv
    assert kv.pool_name == "seer-kv-host-b" and kv.valid_tokens == saved and kv.save
    assert blocks(d2)[:len(t.dst_blocks)] == t.dst_blocks
    assert sched.kv.pools[A].allocator.num_used == 0
    assert sched.transfer_finished(t.transfer_id, ok=True) == (None, [])  # a repeated answer is ignored


def test_a_failed_transfer_sends_the_chunk_with_re_prefill_and_frees_both_sides():
    """PullDone not ok: the chunk goes to B with nothing valid (it re-prefills) and saves
    afresh into B's pool; no block of A or of the failed copy stays owned."""
    sched = scheduler()
    r = rollout(1)
    _, _, t = first_chunk_then_move(sched, r)
    _, (d2,) = sched.transfer_finished(t.transfer_id, ok=False)
    assert d2.engine_id == 1 and d2.task.kv.valid_tokens == 0 and d2.task.kv.save
    assert d2.task.kv.pool_name == "seer-kv-host-b"
    assert sched.kv.pools[A].allocator.num_used == 0
    assert sched.kv.pools[B].allocator.blocks_of(d2.task.kv.key) == blocks(d2)


def test_a_full_destination_pool_sends_the_chunk_without_the_pool_and_keeps_the_kv_home():
    """No room on B: no transfer, the chunk runs there without descriptor (kv_pool_full),
    and A keeps the request's KV -- its next chunk, back on A, loads it."""
    sched = scheduler(blocks_b=1)
    r = rollout(1)
    sched.submit(r)
    (d1,) = sched.schedule()
    saved = finish(sched, d1, 64)
    (d2,) = sched.schedule()
    assert d2.engine_id == 1 and d2.task.kv is None and d2.kv_pool_full
    assert sched.take_transfers() == []
    assert sched.kv.pools[A].allocator.blocks_of(d1.task.kv.key) == blocks(d1)
    finish(sched, d2, 64)
    (d3,) = sched.schedule()
    assert d3.engine_id == 0 and d3.task.kv.valid_tokens == saved
    assert blocks(d3)[:len(blocks(d1))] == blocks(d1)


def test_a_host_without_an_agent_takes_no_part_in_transfers():
    """B's pool has no agent yet: the KV cannot move there, so the chunk re-prefills on B
    and the request's KV starts afresh in B's pool."""
    sched = scheduler(agent_b=False)
    r = rollout(1)
    sched.submit(r)
    (d1,) = sched.schedule()
    finish(sched, d1, 64)
    (d2,) = sched.schedule()
    assert sched.take_transfers() == []
    assert d2.engine_id == 1 and d2.task.kv.pool_name == "seer-kv-host-b" and d2.task.kv.valid_tokens == 0
    assert sched.kv.pools[A].allocator.num_used == 0


def test_engines_of_one_host_share_its_pool_without_transfers():
    """Two engines on host B and a pool there: chunks move between them through the pool
    (descriptors, no transfer), exactly as with one pool."""
    sched = scheduler(hosts=(B, B))
    r = rollout(1)
    sched.submit(r)
    log = []
    while not r.done:
        for d in sched.schedule():
            assert d.task.kv is not None and d.task.kv.pool_name == "seer-kv-host-b"
            log.append(d)
            finish(sched, d, 64)
        assert sched.take_transfers() == []
    assert [d.engine_id for d in log] == [0, 1, 0, 1]
    assert sched.kv.pools[B].allocator.num_used == 0


# ---------------------------------------------------------------------- giving up, losing things

def test_a_timed_out_transfer_sends_the_chunk_with_re_prefill_and_holds_its_blocks_until_the_answer():
    """transfer_abandoned: the chunk goes at once, under a fresh key; the blocks the late pull
    may still write stay owned by the old key until its PullDone, then are free."""
    sched = scheduler()
    r = rollout(1)
    d1, _, t = first_chunk_then_move(sched, r)
    (d2,) = sched.transfer_abandoned(t.transfer_id)
    assert d2.engine_id == 1 and d2.task.kv.valid_tokens == 0
    assert d2.task.kv.key != t.key
    held = sched.kv.pools[B].allocator.blocks_of(t.key)
    assert held == t.dst_blocks and not set(held) & set(blocks(d2))
    assert sched.transfer_abandoned(t.transfer_id) == []
    finish(sched, d2, 64)
    done, again = sched.transfer_finished(t.transfer_id, ok=True)  # the late answer
    assert done is t and again == []
    assert sched.kv.pools[B].allocator.blocks_of(t.key) == []
    assert sched.kv.pools[A].allocator.blocks_of(d1.task.kv.key) == []


def test_engine_lost_while_its_chunk_waits_the_transfer_still_moves_the_kv():
    """The engine of the waiting chunk is lost: the request is requeued; placed on the
    other engine of host B it waits for the same transfer, and goes when it lands."""
    sched = scheduler(hosts=(A, B, B))
    r = rollout(1)
    sched.submit(r)
    (d1,) = sched.schedule()
    saved = finish(sched, d1, 64)
    sched.schedule()
    (t,) = sched.take_transfers()
    waiting_engine = t.waiter[1]
    report = sched.engine_lost(waiting_engine)
    req = r.groups[0].requests[0]
    assert report.requeued == [req]
    sched.engine_lost(0)  # (idle) leaves the other engine of host B as the only place
    assert sched.schedule() == [] and sched.take_transfers() == []
    done, (d2,) = sched.transfer_finished(t.transfer_id, ok=True)
    assert d2.engine_id not in (0, waiting_engine) and d2.task.kv.valid_tokens == saved


def test_a_chunk_re_placed_away_from_its_moving_kv_re_prefills_and_the_transfer_lands():
    """Engine 1 is lost while its chunk waits; the request then runs on host A without the
    pool (its KV is on the way to B); the transfer's success makes B its home."""
    sched = scheduler()
    r = rollout(1)
    d1, saved, t = first_chunk_then_move(sched, r)
    sched.engine_lost(1)
    (d2,) = sched.schedule()
    assert d2.engine_id == 0 and d2.task.kv is None
    _, dispatched = sched.transfer_finished(t.transfer_id, ok=True)
    assert dispatched == []
    assert sched.kv.pools[A].allocator.num_used == 0
    assert sched.kv.pools[B].allocator.blocks_of(t.key) == t.dst_blocks


def test_cancel_while_a_transfer_is_in_flight_frees_everything_once_it_answers():
    sched = scheduler()
    r = rollout(1)
    _, _, t = first_chunk_then_move(sched, r)
    (abort,) = sched.cancel("r")
    assert abort.engine_id == 1
    assert sched.kv.pools[A].allocator.num_used == 0
    assert sched.kv.pools[B].allocator.blocks_of(t.key) == t.dst_blocks  # the pull may still write
    assert sched.transfer_finished(t.transfer_id, ok=True) == (t, [])
    assert sched.kv.pools[B].allocator.num_used == 0


def test_the_destination_pool_going_away_sends_the_waiting_chunk_without_the_pool():
    """B's agent is gone (remove_host_pool): the transfer ends as failed, the waiting chunk
    goes to engine 1 without a descriptor (no pool on B any more)."""
    sched = scheduler()
    r = rollout(1)
    _, _, t = first_chunk_then_move(sched, r)
    (d2,) = sched.remove_host_pool(B)
    assert d2.engine_id == 1 and d2.task.kv is None
    assert sched.kv.pools[A].allocator.num_used == 0
    assert sched.transfer_finished(t.transfer_id, ok=True) == (None, [])


def test_a_new_segment_for_a_host_loses_the_kv_that_was_at_home_there():
    """An agent that registers another segment for host A (restarted): requests whose KV
    lived in A's old pool have nothing valid any more."""
    sched = scheduler(placement="auto", hosts=(A,))
    r = rollout(1)
    sched.submit(r)
    (d1,) = sched.schedule()
    finish(sched, d1, 64)
    req = r.groups[0].requests[0]
    assert req.kv_valid_tokens > 0
    sched.add_host_pool(pool(A, name="seer-kv-a-restarted"))
    assert req.kv_valid_tokens == 0
    (d2,) = sched.schedule()
    assert d2.task.kv.pool_name == "seer-kv-a-restarted" and d2.task.kv.valid_tokens == 0


def test_weights_changed_gives_up_transfers_and_frees_all_but_blocks_a_pull_may_write():
    sched = scheduler()
    r = rollout(1)
    _, _, t = first_chunk_then_move(sched, r)
    (d2,) = sched.weights_changed()  # the waiting chunk goes, with re-prefill under the new epoch
    assert d2.engine_id == 1 and d2.task.kv.valid_tokens == 0 and d2.task.kv.weights_version == 1
    assert d2.task.kv.key != t.key
    assert sched.kv.pools[A].allocator.num_used == 0
    assert sched.kv.pools[B].allocator.blocks_of(t.key) == t.dst_blocks
    assert sched.transfer_finished(t.transfer_id, ok=True)[1] == []
    assert sched.kv.pools[B].allocator.blocks_of(t.key) == []


# ---------------------------------------------------------------------- moving KV ahead

def run_bounded(sched: Scheduler, n: int) -> tuple[Rollout, list[Transfer], list[Dispatch], dict[int, Dispatch]]:
    """``n`` requests through engines that hold one chunk each, chunks ending first sent
    first out; every pull answers (ok) right after it is decided. Also: each transfer's
    request's next chunk sent after it was decided."""
    r = rollout(n)
    sched.submit(r)
    running: list[Dispatch] = []
    sent: list[Dispatch] = []
    transfers: list[Transfer] = []
    next_chunk: dict[int, Dispatch] = {}
    for _ in range(2000):
        new = sched.schedule()
        for d in new:
            for t in transfers:
                if t.request is d.request and t.transfer_id not in next_chunk:
                    next_chunk[t.transfer_id] = d
        for t in sched.take_transfers():
            transfers.append(t)
            new += sched.transfer_finished(t.transfer_id, ok=True)[1]
            for d in new:
                if d.request is t.request:
                    next_chunk.setdefault(t.transfer_id, d)
        running += new
        sent += new
        if running:
            finish(sched, running.pop(0), 64)
        if r.done:
            return r, transfers, sent, next_chunk
    raise AssertionError("did not converge")


def test_kv_of_a_request_held_for_an_engine_on_another_host_moves_before_its_chunk_goes():
    """Bounded dispatch (one chunk per engine): the scheduler knows where a held request
    runs next, so its KV starts moving to that host at once, with no chunk waiting. When the
    engine frees up, the chunk goes with its KV already in that host's pool; fewer chunks
    wait for a pull than with the move made only when the chunk is sent."""
    sched = scheduler(cap=1)
    r, transfers, _, next_chunk = run_bounded(sched, 8)
    ahead = [t for t in transfers if t.ahead]
    assert ahead and sched.kv.num_transfers_ahead == len(ahead)
    for t in ahead:
        assert t.chunk_waits_since_s is None  # answered before its chunk was released
        d = next_chunk[t.transfer_id]
        assert d.task.kv.pool_name == t.dst.name and d.task.kv.valid_tokens == t.num_tokens
        assert blocks(d)[:len(t.dst_blocks)] == t.dst_blocks
    assert all(q.num_generated_tokens == 64 for q in r.groups[0].requests)
    off = scheduler(cap=1, ahead=False)
    _, off_transfers, _, _ = run_bounded(off, 8)
    assert not any(t.ahead for t in off_transfers)
    waited_on = sum(t.chunk_waits_since_s is not None for t in transfers)
    waited_off = sum(t.chunk_waits_since_s is not None for t in off_transfers)
    assert waited_on < waited_off, (waited_on, waited_off)


def test_a_chunk_released_while_its_kv_is_still_moving_waits_for_that_move_only():
    """The engine frees up before the pull of a held request's KV answers: the chunk waits
    for the transfer already under way (no second pull of the same KV) and goes when it ends."""
    sched = scheduler(cap=1)
    r = rollout(8)
    sched.submit(r)
    running: list[Dispatch] = sched.schedule()
    for _ in range(200):
        ahead = [t for t in sched.take_transfers() if t.ahead]
        if ahead:
            break
        finish(sched, running.pop(0), 64)
        running += sched.schedule()
    else:
        raise AssertionError("no move ahead happened")
    t = ahead[0]
    while t.waiter is None:  # finish chunks until its engine frees up and releases it
        finish(sched, running.pop(0), 64)
        running += sched.schedule()
        assert all(x.key != t.key for x in sched.take_transfers()), "a second pull of the same KV"
        assert all(d.request is not t.request for d in running)
    assert t.chunk_waits_since_s is not None
    _, (moved,) = sched.transfer_finished(t.transfer_id, ok=True)
    assert moved.request is t.request and moved.task.kv.pool_name == t.dst.name
    assert moved.task.kv.valid_tokens == t.num_tokens


def test_a_failed_move_ahead_leaves_the_kv_at_home_for_a_pull_when_the_chunk_goes():
    sched = scheduler(cap=1)
    r = rollout(8)
    sched.submit(r)
    running: list[Dispatch] = sched.schedule()
    pulls: list[Transfer] = []
    failed: Transfer | None = None
    for _ in range(2000):
        for t in sched.take_transfers():
            if t.ahead and failed is None:
                failed = t
                assert sched.transfer_finished(t.transfer_id, ok=False) == (t, [])  # no chunk waited
                assert sched.kv.pools[t.src.host_id].allocator.blocks_of(t.key)  # still at home
            else:
                pulls.append(t)
                running += sched.transfer_finished(t.transfer_id, ok=True)[1]
        if r.done:
            break
        finish(sched, running.pop(0), 64)
        running += sched.schedule()
    assert failed is not None and r.done
    again = next(t for t in pulls if t.request is failed.request and t.transfer_id > failed.transfer_id)
    assert again.num_tokens == failed.num_tokens  # the same KV, pulled again: nothing re-prefilled
    assert all(q.num_generated_tokens == 64 for q in r.groups[0].requests)


def test_no_move_ahead_into_a_pool_it_would_crowd():
    """A move ahead must leave a quarter of the destination pool free for the chunks in
    flight there to save into; with 14-block pools none starts (two would without that
    rule), and the rollout still ends."""
    sched = scheduler(cap=1, blocks_a=14, blocks_b=14)
    r, transfers, _, _ = run_bounded(sched, 8)
    assert transfers and not any(t.ahead for t in transfers)
    assert all(q.num_generated_tokens == 64 for q in r.groups[0].requests)


# ---------------------------------------------------------------------- property

@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_requests=st.integers(1, 10), pool_blocks=st.integers(2, 40),
       p_fail=st.sampled_from([0.0, 0.3, 1.0]), p_timeout=st.sampled_from([0.0, 0.2]),
       lose_engine=st.booleans(), cap=st.sampled_from([1, 2, 1024]), num_engines=st.sampled_from([2, 4]))
def test_random_transfer_outcomes_never_lose_or_duplicate_a_sample(seed, num_requests, pool_blocks, p_fail,
                                                                   p_timeout, lose_engine, cap, num_engines):
    """Whatever transfers do (succeed, fail, time out and answer late), whatever engine is
    lost: every request finishes exactly once with its full length, no pool block is ever
    owned twice or given to a chunk while a pull may write it, and all blocks come back.
    With a small ``cap`` requests are held for busy engines and their KV moves ahead."""
    rng = random.Random(seed)
    sched = scheduler(blocks_a=pool_blocks, blocks_b=pool_blocks, hosts=(A, B) * (num_engines // 2),
                      placement=rng.choice(["migrate", "auto"]), cap=cap)
    r = rollout(num_requests, max_tokens=64)
    sched.submit(r)
    lengths = {q.request_id: rng.randint(1, 64) for q in r.groups[0].requests}
    running: list[Dispatch] = []
    pending: list[Transfer] = []  # answered later
    late: list[Transfer] = []  # timed out, answer still due
    finished: list[str] = []
    lost = False
    for _ in range(5000):
        running += sched.schedule()
        pending += sched.take_transfers()
        _check_no_shared_blocks(sched, pending + late)
        if r.done and not pending and not late:
            break
        choice = rng.random()
        if lose_engine and not lost and choice < 0.05:
            lost = True
            sched.engine_lost(num_engines - 1)
            running = [d for d in running if d.engine_id != num_engines - 1]
        elif pending and choice < 0.5:
            t = pending.pop(rng.randrange(len(pending)))
            if rng.random() < p_timeout:
                running += sched.transfer_abandoned(t.transfer_id)
                late.append(t)
            else:
                running += sched.transfer_finished(t.transfer_id, ok=rng.random() >= p_fail)[1]
        elif late and choice < 0.6:
            t = late.pop(rng.randrange(len(late)))
            assert sched.transfer_finished(t.transfer_id, ok=rng.random() < 0.5)[1] == []
        elif running:
            d = running.pop(rng.randrange(len(running)))
            before = d.request.state
            finish(sched, d, lengths[d.request.request_id])
            if before is RequestState.RUNNING and d.request.state is RequestState.FINISHED:
                finished.append(d.request.request_id)
    else:
        raise AssertionError("did not converge")
    assert sorted(finished) == sorted(lengths)
    for q in r.groups[0].requests:
        assert q.num_generated_tokens == lengths[q.request_id]
    assert not sched.kv.transfers
    for p in sched.kv.pools.values():
        assert p.allocator.num_used == 0


def _check_no_shared_blocks(sched: Scheduler, open_transfers: list[Transfer]) -> None:
    for host, p in sched.kv.pools.items():
        seen: dict[int, int] = {}
        for key, owned in p.allocator._owned.items():  # noqa: SLF001 - the invariant is about ownership
            for b in owned:
                assert b not in seen, f"block {b} of {host!r} owned by keys {seen[b]} and {key}"
                seen[b] = key
        for t in open_transfers:
            if t.dst is p:
                for b in t.dst_blocks:
                    assert seen.get(b) == t.key, "a block a pull may write was handed to someone else"
