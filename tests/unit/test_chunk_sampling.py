"""What a chunk's vLLM request carries (engines/chunk_sampling.py): drafting chunks get
per-chunk seeds and, under grouped SD, the proposer's arguments; the others the sample's
seed and a position key, exactly as on an engine without speculative decoding."""

from __future__ import annotations

import pytest

from seer.engines.chunk_sampling import chunk_seed, drafts, sampling_extras, vllm_seed
from seer.engines.proposer import EXTRA_ARGS_KEY
from seer.engines.vllm_plugin import POSITION_KEY
from seer.protocol import ChunkTask, EngineSampling, pack_token_ids


def task(*, seed: int | None = 11, done: int = 40, draft: bool = True) -> ChunkTask:
    return ChunkTask(task_id=1, request_id="r/0/1", group_id="r/0", prompt_token_ids=pack_token_ids([1, 2, 3]),
                     sampling=EngineSampling(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, min_tokens=0,
                                                     seed=seed, stop=[], stop_token_ids=[], ignore_eos=False), num_generated_tokens=done, draft=draft)


@pytest.mark.parametrize(("method", "draft", "expected"), [
    (None, True, False), ("off", True, False), ("grouped", True, True), ("grouped", False, False),
    ("ngram", False, True), ("suffix", False, True), ("ngram", True, True),
])
def test_only_grouped_sd_honours_a_chunk_that_must_not_draft(method, draft, expected):
    """No SD never drafts; grouped drafts unless told not to; vLLM's drafters draft for every request."""
    assert drafts(task(draft=draft), method) is expected


@pytest.mark.parametrize("method", [None, "off"])
def test_without_sd_a_seeded_chunk_is_position_keyed_with_the_sample_seed(method):
    """No SD: the sample's seed, and the chunk's response offset as the position key."""
    t = task()
    assert vllm_seed(t, method) == 11
    assert sampling_extras(t, method) == {POSITION_KEY: 40}


def test_a_non_drafting_chunk_on_grouped_engines_is_treated_as_without_sd():
    """draft=False on grouped SD: same seed and extras as an engine without SD; no proposer args."""
    t = task(draft=False)
    assert vllm_seed(t, "grouped") == vllm_seed(t, None) == 11
    assert sampling_extras(t, "grouped") == sampling_extras(t, None) == {POSITION_KEY: 40}


def test_a_drafting_chunk_gets_its_own_seed_and_the_proposer_args_but_no_position_key():
    """Grouped SD, drafting: chunk_seed(seed, offset), the proposer's arguments, no position key."""
    t = task()
    assert vllm_seed(t, "grouped") == chunk_seed(11, 40) != 11
    extras = sampling_extras(t, "grouped")
    assert POSITION_KEY not in extras
    assert extras[EXTRA_ARGS_KEY]["group_id"] == "r/0" and extras[EXTRA_ARGS_KEY]["num_generated_tokens"] == 40


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_vllm_drafters_get_per_chunk_seeds_and_no_seer_keys(method):
    """ngram/suffix: per-chunk seeds whatever the chunk says, and no extra_args of Seer's."""
    t = task(draft=False)
    assert vllm_seed(t, method) == chunk_seed(11, 40)
    assert sampling_extras(t, method) == {}


def test_unseeded_chunks_carry_no_seed_and_no_position_key():
    """Without a seed there is nothing to key: seed None, no position key, whatever the method."""
    for method, draft in [(None, True), ("grouped", False), ("grouped", True)]:
        t = task(seed=None, draft=draft)
        assert vllm_seed(t, method) is None
        assert POSITION_KEY not in sampling_extras(t, method)


def test_the_first_chunk_keeps_the_sample_seed_later_ones_get_fresh_ones():
    """chunk_seed: offset 0 is the sample seed; other offsets give distinct 62-bit seeds."""
    assert chunk_seed(5, 0) == 5
    seeds = {chunk_seed(5, n) for n in range(1, 200)}
    assert len(seeds) == 199 and all(0 <= s < 2**62 for s in seeds)
