"""The scheduler's host-KV-pool bookkeeping (controlplane/scheduler.py: ``add_host_pool``,
``_kv_descriptor``, ``weights_changed``, ``_release_kv``, ``chunk_finished(kv_saved_tokens)``).

No shared memory and no engine: the scheduler only sees a ``PoolBinding`` (name,
allocator, fingerprint), and a fake engine finishes chunks the way the vLLM connector
reports them -- a chunk that ends by length with ``save`` set leaves the KV of every
token but its last in the pool.
"""

from __future__ import annotations

import msgspec
import pytest

from seer.config import SchedulerConfig
from seer.controlplane import turns
from seer.controlplane.scheduler import Dispatch, PoolBinding, Scheduler
from seer.controlplane.state import Group, Request, RequestState, Rollout
from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import PoolAllocator
from seer.protocol import EngineCapabilities, SamplingParams, TrajectorySpec, unpack_token_ids
from tests.unit.chunks import finished

BS = 16  # tokens per pool block and per engine KV block
CHUNK = 16
PROMPT = 17  # context + CHUNK - 1 fills whole blocks: one token more would need another block
GEOM = PoolGeometry(num_layers=2, num_kv_heads=1, head_size=8, block_size=BS, dtype="float32")
POOL_NAME = "seer-kv-test-pool"  # never created: the scheduler only hands the name out


def caps(geometry: PoolGeometry | None = GEOM, max_model_len: int = 4096) -> EngineCapabilities:
    return EngineCapabilities(backend="vllm", model="m", dtype="float32", max_model_len=max_model_len,
                              vocab_size=259, kv_capacity_tokens=100_000, block_size=BS, kv_geometry=geometry)


def scheduler(policy: str = "divided", *, pool_blocks: int = 64,
              engines: dict[int, EngineCapabilities] | None = None, **cfg) -> Scheduler:
    cfg = {"chunk_size_tokens": CHUNK, "kv_admission_fraction": 1.0, **cfg}
    config = SchedulerConfig(policy=policy, **cfg)
    sched = Scheduler(config, lambda: 0.0)
    for engine_id, capabilities in (engines or {0: caps(), 1: caps()}).items():
        sched.engine_joined(engine_id, capabilities)
    sched.add_host_pool(PoolBinding(name=POOL_NAME, allocator=PoolAllocator(pool_blocks, BS),
                                  fingerprint=GEOM.fingerprint, min_load_tokens=32))
    return sched


def rollout(policy: str, num_requests: int, max_tokens: int = 64, rid: str = "r") -> Rollout:
    r = Rollout(rollout_id=rid, policy=policy, accepted_s=0.0)
    g = Group(group_id=f"{rid}/0", rollout=r, group_index=0, prompt_id="0")
    for i in range(num_requests):
        g.requests.append(Request(request_id=f"{rid}/0/{i}", group=g, sample_index=i,
                                  prompt_token_ids=[5] * PROMPT,
                                  sampling=SamplingParams(max_tokens=max_tokens, seed=1)))
    r.groups.append(g)
    return r


def blocks_needed(tokens: int) -> int:
    return -(-tokens // BS)


def finish(sched: Scheduler, d: Dispatch, true_len: int) -> int:
    """Finish a chunk as a vLLM engine with the Seer connector would; returns the
    kv_saved_tokens it reported."""
    req = d.request
    context = len(unpack_token_ids(d.task.prompt_token_ids))
    left = true_len - req.num_generated_tokens
    n = min(d.task.sampling.max_tokens, left)
    reason = "stop" if n == left else "length"
    # The connector saves at the step that samples the chunk's last token: only when the
    # chunk runs to its max_tokens, and never the last sampled token itself.
    kv = d.task.kv
    ran_to_budget = n == d.task.sampling.max_tokens
    saved = context + n - 1 if kv is not None and kv.save and ran_to_budget else 0
    sched.chunk_finished(finished(d.engine_id, d.task.task_id, [7] * n, [-0.5] * n, reason, kv_saved_tokens=saved))
    return saved


def drain(sched: Scheduler, r: Rollout, true_len: int, log: list[Dispatch] | None = None) -> None:
    for _ in range(1000):
        ds = sched.schedule()
        if not ds and r.done:
            return
        assert ds, "nothing dispatched while the rollout is unfinished"
        for d in ds:
            if log is not None:
                log.append(d)
            finish(sched, d, true_len)
    raise AssertionError("rollout did not finish")


def pool_blocks(d: Dispatch) -> list[int]:
    assert d.task.kv is not None
    return unpack_token_ids(d.task.kv.pool_blocks)


# ---------------------------------------------------------------------- descriptors

def test_a_chunk_that_will_continue_saves_into_blocks_for_context_plus_chunk_minus_one():
    """First chunk of a longer request: save=True, nothing valid yet, and enough pool blocks
    for the KV of every token the chunk feeds through the model."""
    sched = scheduler()
    r = rollout("divided", 2)
    sched.submit(r)
    ds = sched.schedule()
    assert len(ds) == 2
    keys, owned = set(), []
    for d in ds:
        kv = d.task.kv
        assert kv is not None and not d.kv_pool_full
        assert kv.save and kv.valid_tokens == 0 and kv.weights_version == 0
        assert kv.pool_name == POOL_NAME and kv.min_load_tokens == 32
        assert len(pool_blocks(d)) == blocks_needed(PROMPT + CHUNK - 1)
        assert sched.pool.allocator.blocks_of(kv.key) == pool_blocks(d)
        keys.add(kv.key)
        owned += pool_blocks(d)
    assert len(keys) == 2 and 0 not in keys
    assert len(set(owned)) == len(owned), "two requests share a pool block"


def test_later_chunks_load_what_the_previous_chunk_saved_from_the_same_leading_blocks():
    """After chunk_finished(kv_saved_tokens=n) the next chunk -- here forced onto the other
    engine -- gets valid_tokens=n, the same leading blocks, and more blocks while it
    continues; the last chunk gets save=False."""
    sched = scheduler(placement="migrate")
    r = rollout("divided", 1, max_tokens=64)
    sched.submit(r)
    (d,) = sched.schedule()
    seen = [d]
    saved = finish(sched, d, 64)
    assert saved == PROMPT + CHUNK - 1
    for _ in range(3):
        (nxt,) = sched.schedule()
        assert nxt.engine_id != d.engine_id  # migrated: only the pool holds its KV there
        kv = nxt.task.kv
        assert kv is not None and kv.key == d.task.kv.key
        assert kv.valid_tokens == saved
        assert pool_blocks(nxt)[:len(pool_blocks(d))] == pool_blocks(d)
        context = len(unpack_token_ids(nxt.task.prompt_token_ids))
        if nxt.request.remaining_tokens > CHUNK:
            assert kv.save and len(pool_blocks(nxt)) == blocks_needed(context + CHUNK - 1)
        seen.append(nxt)
        saved = finish(sched, nxt, 64)
        d = nxt
    assert [s.task.kv.save for s in seen] == [True, True, True, False]
    assert r.done and r.groups[0].requests[0].num_generated_tokens == 64


def test_the_chunk_that_reaches_max_model_len_does_not_save():
    """A chunk cut by the engine's max_model_len is the request's last: no save."""
    sched = scheduler(engines={0: caps(max_model_len=PROMPT + 2 * CHUNK)})
    r = rollout("divided", 1, max_tokens=64)
    sched.submit(r)
    (d1,) = sched.schedule()
    assert d1.task.kv.save
    finish(sched, d1, 64)
    (d2,) = sched.schedule()
    assert d2.task.kv is not None and not d2.task.kv.save and not d2.kv_pool_full
    assert d2.task.kv.valid_tokens == PROMPT + CHUNK - 1
    finish(sched, d2, 64)
    assert r.done and sched.pool.allocator.num_used == 0


def test_a_request_that_fits_in_one_chunk_gets_no_descriptor():
    """Nothing to save for later and nothing to load: the pool has no part in it."""
    sched = scheduler()
    r = rollout("divided", 2, max_tokens=CHUNK)
    sched.submit(r)
    ds = sched.schedule()
    assert len(ds) == 2 and all(d.task.kv is None and not d.kv_pool_full for d in ds)
    assert sched.pool.allocator.num_used == 0


def test_the_unchunked_group_policy_gets_no_descriptor():
    """The group baseline runs every request in one go: no descriptors, no pool blocks."""
    sched = scheduler("group")
    r = rollout("group", 4, max_tokens=64)
    sched.submit(r)
    log: list[Dispatch] = []
    drain(sched, r, 50, log)
    assert len(log) == 4 and all(d.task.kv is None for d in log)
    assert sched.pool.allocator.peak_used == 0


# ---------------------------------------------------------------------- release

def test_a_finished_request_gives_its_blocks_back_at_once():
    """The chunk that ends a request (EOS here) frees its blocks in chunk_finished itself;
    its sibling keeps its own."""
    sched = scheduler()
    r = rollout("divided", 2)
    sched.submit(r)
    a, b = sched.schedule()
    finish(sched, a, 64)
    finish(sched, b, 64)
    a2, b2 = sched.schedule()
    key_a, key_b = a2.task.kv.key, b2.task.kv.key
    held_b = list(sched.pool.allocator.blocks_of(key_b))
    finish(sched, a2, a2.request.num_generated_tokens + 5)  # EOS in its second chunk
    assert a2.request.state is RequestState.FINISHED and a2.request.finish_reason == "stop"
    assert sched.pool.allocator.blocks_of(key_a) == []
    assert a2.request.kv_valid_tokens == 0
    assert sched.pool.allocator.blocks_of(key_b) == held_b
    assert sched.pool.allocator.num_used == len(held_b)
    finish(sched, b2, 64)
    drain(sched, r, 64)
    assert sched.pool.allocator.num_used == 0


def test_a_cancelled_rollout_gives_back_the_blocks_of_running_and_waiting_requests():
    sched = scheduler()
    keep, drop = rollout("divided", 1, rid="keep"), rollout("divided", 2, rid="drop")
    sched.submit(keep)
    sched.submit(drop)
    ds = {d.request.request_id: d for d in sched.schedule()}
    finish(sched, ds["drop/0/0"], 64)  # now waiting between chunks, its KV in the pool
    keep_key = ds["keep/0/0"].task.kv.key
    kept = list(sched.pool.allocator.blocks_of(keep_key))
    aborts = sched.cancel("drop")
    assert [a.task_ids for a in aborts] == [[ds["drop/0/1"].task.task_id]]
    assert sched.pool.allocator.num_used == len(kept)
    assert sched.pool.allocator.blocks_of(keep_key) == kept
    assert all(q.kv_valid_tokens == 0 for q in drop.groups[0].requests)


def test_a_failed_chunk_keeps_the_kv_of_the_last_completed_chunk():
    """A chunk that fails goes back to the buffer; its next try loads the KV the previous
    chunk saved, from the same blocks."""
    sched = scheduler()
    r = rollout("divided", 1)
    sched.submit(r)
    (d1,) = sched.schedule()
    saved = finish(sched, d1, 64)
    (d2,) = sched.schedule()
    sched.chunk_failed(d2.engine_id, d2.task.task_id)
    (d3,) = sched.schedule()
    assert d3.task.kv.valid_tokens == saved
    assert pool_blocks(d3) == pool_blocks(d2)


# ---------------------------------------------------------------------- full pool

def test_a_full_pool_runs_the_chunk_without_saving_and_the_rollout_still_completes():
    """With room for only the first chunk's blocks, later continuing chunks get save=False
    and kv_pool_full=True, keep loading what the pool already holds, and the request ends
    with its full length; every block is back at the end."""
    sched = scheduler(pool_blocks=blocks_needed(PROMPT + CHUNK - 1))
    r = rollout("divided", 1, max_tokens=64)
    sched.submit(r)
    log: list[Dispatch] = []
    drain(sched, r, 64, log)
    assert [d.task.kv.save for d in log] == [True, False, False, False]
    assert [d.kv_pool_full for d in log] == [False, True, True, False]
    first_blocks = pool_blocks(log[0])
    for d in log[1:]:
        assert d.task.kv.valid_tokens == PROMPT + CHUNK - 1  # what chunk 1 saved
        assert pool_blocks(d) == first_blocks
    assert r.groups[0].requests[0].num_generated_tokens == 64 and r.done
    alloc = sched.pool.allocator
    assert alloc.num_refused == 2 and alloc.num_used == 0


def test_a_request_refused_by_a_full_pool_gets_no_blocks_and_another_keeps_its_own():
    sched = scheduler(pool_blocks=blocks_needed(PROMPT + CHUNK - 1))
    r = rollout("divided", 2, max_tokens=64)
    sched.submit(r)
    first, second = sched.schedule()
    assert first.task.kv.save and not first.kv_pool_full
    assert second.task.kv is not None and not second.task.kv.save and second.kv_pool_full
    assert pool_blocks(second) == []
    assert sched.pool.allocator.blocks_of(first.task.kv.key) == pool_blocks(first)
    finish(sched, first, 64)
    finish(sched, second, 64)
    drain(sched, r, 64)
    assert all(q.num_generated_tokens == 64 for q in r.groups[0].requests)
    assert sched.pool.allocator.num_used == 0


# ---------------------------------------------------------------------- weights and geometry

def test_weights_changed_frees_every_block_and_later_descriptors_carry_the_new_epoch():
    """After a weights update no descriptor claims KV saved under the old weights."""
    sched = scheduler()
    r = rollout("divided", 2)
    sched.submit(r)
    for d in sched.schedule():
        assert d.task.kv.weights_version == 0
        finish(sched, d, 64)
    assert sched.pool.allocator.num_used > 0
    sched.weights_changed()
    assert sched.pool.allocator.num_used == 0
    assert all(q.kv_valid_tokens == 0 for q in r.groups[0].requests)
    ds = sched.schedule()
    assert len(ds) == 2
    for d in ds:
        assert d.task.kv.weights_version == 1 and d.task.kv.valid_tokens == 0 and d.task.kv.save
    r2 = rollout("divided", 1, rid="r2")
    sched.weights_changed()
    sched.submit(r2)
    (d,) = sched.schedule()
    assert d.task.kv.weights_version == 2


@pytest.mark.parametrize("geometry", [
    msgspec.structs.replace(GEOM, block_size=2 * BS),
    msgspec.structs.replace(GEOM, dtype="bfloat16"),
    None,  # an engine that cannot use the pool (simulated, or pool off)
], ids=["other-block-size", "other-dtype", "no-geometry"])
def test_an_engine_whose_geometry_differs_gets_no_descriptor(geometry):
    """Blocks are exchanged only between engines with the pool's fingerprint: the other
    engine re-prefills, and the rollout still completes."""
    sched = scheduler(engines={0: caps(geometry)})
    r = rollout("divided", 2)
    sched.submit(r)
    log: list[Dispatch] = []
    drain(sched, r, 40, log)
    assert len(log) == 6 and all(d.task.kv is None and not d.kv_pool_full for d in log)
    assert sched.pool.allocator.peak_used == 0


def test_matching_and_mismatching_engines_side_by_side():
    """With one matching and one foreign engine, only chunks on the matching engine carry a
    descriptor."""
    sched = scheduler(engines={0: caps(), 1: caps(msgspec.structs.replace(GEOM, num_layers=3))})
    sched.submit(rollout("divided", 1, rid="a"))
    sched.submit(rollout("divided", 1, rid="b"))  # another group: no cache affinity to engine 0
    ds = sched.schedule()
    assert sorted(d.engine_id for d in ds) == [0, 1]
    for d in ds:
        assert (d.task.kv is not None) == (d.engine_id == 0)


def test_without_a_pool_no_chunk_carries_a_descriptor():
    config = SchedulerConfig(policy="divided", chunk_size_tokens=CHUNK, kv_admission_fraction=1.0)
    sched = Scheduler(config, lambda: 0.0)
    sched.engine_joined(0, caps())
    r = rollout("divided", 1)
    sched.submit(r)
    log: list[Dispatch] = []
    drain(sched, r, 64, log)
    assert len(log) == 4 and all(d.task.kv is None for d in log)


@pytest.mark.parametrize("policy", ["sticky", "request", "group", "divided", "context"])
def test_the_baselines_never_touch_the_pool_even_for_trajectories(policy):
    """The baselines run as users run them, their engines' own prefix cache only: a
    trajectory's turn (a chunk that continues after its tool answers) under ``sticky``,
    ``request`` or ``group`` neither saves to nor loads from the host pool, where Seer's
    chunked policies save it for the next turn."""
    sched = scheduler(policy)
    r = rollout(policy, 2, max_tokens=64)
    for q in r.groups[0].requests:
        q.trajectory = turns.new_trajectory(TrajectorySpec(max_turns=4), 4096)
    sched.submit(r)
    ds = sched.schedule()
    assert len(ds) == 2
    if policy in ("divided", "context"):
        assert all(d.task.kv is not None and d.task.kv.save for d in ds)
    else:
        assert all(d.task.kv is None for d in ds) and sched.pool.allocator.num_used == 0
