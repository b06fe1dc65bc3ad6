"""KV connector saves with speculative decoding (engines/kv_connector.py): a step verifies
1 + k tokens and emits 1 to 1 + k of them, so the chunk's last step is not known in
advance. Uses the fakes of tests/unit/test_kv_connector.py; the KV of position p is
written as the value p when its input token is final and as -1 when it is a draft that
the verifier rejects, so any rejected-draft KV that reaches a load shows up."""

from __future__ import annotations

import random

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tests.unit.test_kv_connector import (  # noqa: F401  (fixtures)
    BS,
    FakeRequest,
    admit,
    connectors,
    descriptor,
    kv_layers,
    output,
    pool,
    request,
    run_steps,
    vllm_config,
)

PROMPT_TOKENS, CHUNK_TOKENS, MAX_DRAFTS = 20, 16, 4


def _write(layers: dict[str, torch.Tensor], blocks: list[int], positions: range, value_of) -> None:
    for t in layers.values():
        for p in positions:
            t[blocks[p // BS], :, p % BS, :] = value_of(p)


def _run_with_drafts(sched, work, req: FakeRequest, layers, blocks: list[int], rng: random.Random) -> list[int]:
    """Prefill, then decode steps with k random drafts of which j are accepted; each step's
    KV is written before the worker's save runs, as in vLLM. Returns the steps that saved."""
    saved_steps = []
    step = 0
    while req.num_output_tokens < req.max_tokens:
        prefill = req.num_computed_tokens < req.num_tokens - 1
        k = 0 if prefill else rng.randint(0, MAX_DRAFTS)
        j = rng.randint(0, k)
        scheduled = req.num_tokens - req.num_computed_tokens + k
        meta = sched.build_connector_meta(output(**{req.request_id: scheduled}))
        start = req.num_computed_tokens
        good_until = req.num_tokens + j  # the input tokens of positions below this are final
        _write(layers, blocks, range(start, start + scheduled), lambda p: float(p) if p < good_until else -1.0)
        work.bind_connector_metadata(meta)
        work.start_load_kv(None)
        work.wait_for_save()
        work.clear_connector_metadata()
        if meta.saves:
            saved_steps.append(step)
        # vLLM's update_from_output: rejected drafts roll back, 1 + j tokens are emitted,
        # the output is trimmed at max_tokens.
        req.num_computed_tokens += scheduled - (k - j)
        emitted = min(1 + j, req.max_tokens - req.num_output_tokens)
        req.num_output_tokens += emitted
        req.num_tokens += emitted
        step += 1
    return saved_steps


@pytest.mark.parametrize("seed", range(6))
def test_with_drafts_the_pool_holds_exactly_the_accepted_kv_of_the_chunk(connectors, pool, seed):
    """Chunk 1 runs with random drafts and acceptances; it reports n - 1 = 35 tokens saved,
    and chunk 2 on another engine loads 35 tokens whose KV is the final tokens' (no -1)."""
    rng = random.Random(seed)
    pool_blocks = [5, 2, 7, 0]
    a_layers, b_layers = kv_layers(seed=None), kv_layers(seed=None)
    a_blocks, b_blocks = [3, 4, 6, 8], [10, 11, 12, 13]
    a_sched = connectors(KVConnectorRole.SCHEDULER, block_ids={"c1-aaaaaaaa": a_blocks})
    a_work = connectors(KVConnectorRole.WORKER, kv_caches=a_layers)
    chunk1 = request(descriptor(pool, pool_blocks, valid_tokens=0, save=True), num_tokens=PROMPT_TOKENS,
                     max_tokens=CHUNK_TOKENS, req_id="c1-aaaaaaaa")
    admit(a_sched, chunk1, 0)
    saved_steps = _run_with_drafts(a_sched, a_work, chunk1, a_layers, a_blocks, rng)
    saved = a_sched.request_finished(chunk1, a_blocks)[1]["seer_saved_tokens"]
    assert saved == PROMPT_TOKENS + CHUNK_TOKENS - 1
    assert saved_steps, "no step saved"

    b_sched = connectors(KVConnectorRole.SCHEDULER, block_ids={"c2-bbbbbbbb": b_blocks})
    b_work = connectors(KVConnectorRole.WORKER, kv_caches=b_layers)
    chunk2 = request(descriptor(pool, pool_blocks, valid_tokens=saved, save=False), num_tokens=saved + 1,
                     max_tokens=4, req_id="c2-bbbbbbbb")
    assert admit(b_sched, chunk2, 0) == saved
    run_steps(b_sched, chunk2, worker=b_work)
    for t in b_layers.values():
        for p in range(saved):
            assert torch.all(t[b_blocks[p // BS], :, p % BS, :] == float(p)), f"position {p} (seed {seed})"


def test_every_step_that_could_emit_the_last_token_saves(connectors, pool):
    """4 tokens left and 4 drafts scheduled: the step could finish the chunk, so it saves;
    1 draft with 4 left cannot, so it does not; without drafts only the final step saves."""
    sched = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": list(range(4))})
    req = request(descriptor(pool, [5, 2, 7, 0], valid_tokens=0, save=True), num_tokens=PROMPT_TOKENS,
                  max_tokens=CHUNK_TOKENS)
    admit(sched, req, 0)
    sched.build_connector_meta(output(**{req.request_id: PROMPT_TOKENS}))
    req.num_computed_tokens, req.num_output_tokens, req.num_tokens = 31, 12, 32  # 4 tokens left
    assert sched.build_connector_meta(output(**{req.request_id: 1 + 1})).saves == []
    assert len(sched.build_connector_meta(output(**{req.request_id: 1 + 3})).saves) == 1
    save = sched.build_connector_meta(output(**{req.request_id: 1 + 4})).saves
    # The previous save wrote positions 0..34; of them only those below the computed count
    # (31) are known good, so this one starts again at the block holding position 31.
    assert len(save) == 1 and save[0].first_index == 31 // BS


def test_a_finish_whose_last_step_did_not_save_reports_only_verified_tokens(connectors, pool):
    """Saved at a step with 4 drafts of which 1 was accepted (the chunk went on), then
    stopped early by a stop token: only positions verified after that save count."""
    sched = connectors(KVConnectorRole.SCHEDULER, block_ids={"t1-abcd1234": list(range(4))})
    req = request(descriptor(pool, [5, 2, 7, 0], valid_tokens=0, save=True), num_tokens=PROMPT_TOKENS,
                  max_tokens=CHUNK_TOKENS)
    admit(sched, req, 0)
    sched.build_connector_meta(output(**{req.request_id: PROMPT_TOKENS}))
    req.num_computed_tokens, req.num_output_tokens, req.num_tokens = 31, 12, 32
    assert sched.build_connector_meta(output(**{req.request_id: 5})).saves  # positions 31..35 written
    req.num_computed_tokens, req.num_output_tokens, req.num_tokens = 33, 14, 34  # 1 accepted + 1
    assert sched.build_connector_meta(output(**{req.request_id: 1})).saves == []  # 2 left, 0 drafts
    req.num_computed_tokens, req.num_output_tokens, req.num_tokens = 34, 15, 35  # stopped here
    assert sched.request_finished(req, [])[1]["seer_saved_tokens"] == 33
