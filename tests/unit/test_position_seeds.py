"""Position-keyed seeded sampling (engines/vllm_plugin.py, feature 2): the generator of a
keyed request is re-seeded from (seed, absolute response position) before every step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from seer.engines.vllm_plugin import POSITION_KEY, position_seed, rekey_generators


def _runner(rows):
    """A stand-in for vLLM's model runner with the fields ``rekey_generators`` reads:
    rows are (req_id, seed, extra_args, num_prompt_tokens, num_tokens_no_spec)."""
    generators = {i: torch.Generator() for i, row in enumerate(rows) if row[1] is not None}
    batch = SimpleNamespace(
        generators=generators,
        req_ids=[row[0] for row in rows],
        num_prompt_tokens=np.array([row[3] for row in rows]),
        num_tokens_no_spec=np.array([row[4] for row in rows]),
    )
    requests = {row[0]: SimpleNamespace(sampling_params=SimpleNamespace(seed=row[1], extra_args=row[2]))
                for row in rows}
    return SimpleNamespace(input_batch=batch, requests=requests)


def test_position_seed_is_a_pure_function_of_seed_and_position():
    """Same (seed, position) -> same seed; neighbours in either coordinate differ; 63 bits."""
    seeds = {position_seed(s, p) for s in range(20) for p in range(200)}
    assert len(seeds) == 20 * 200
    assert position_seed(7, 33) == position_seed(7, 33)
    assert all(0 <= s < 2**63 for s in seeds)


def test_a_chunk_draws_what_the_one_shot_request_draws_at_the_same_position():
    """A chunk starting at response offset 17 that has generated 3 tokens draws the same
    noise as a one-shot request that has generated 20."""
    one_shot = _runner([("a", 99, {POSITION_KEY: 0}, 10, 30)])
    chunk = _runner([("b", 99, {POSITION_KEY: 17}, 27, 30)])
    assert rekey_generators(one_shot) == rekey_generators(chunk) == 1
    draw = lambda r: torch.rand(4, generator=r.input_batch.generators[0])  # noqa: E731
    assert torch.equal(draw(one_shot), draw(chunk))


def test_only_keyed_seeded_requests_are_rekeyed():
    """Unseeded requests and requests without the key keep vLLM's own stream."""
    runner = _runner([("keyed", 5, {POSITION_KEY: 0}, 4, 4), ("plain", 5, None, 4, 4),
                      ("other-extra", 5, {"x": 1}, 4, 4), ("unseeded", None, {POSITION_KEY: 0}, 4, 4)])
    before = {i: g.get_state().clone() for i, g in runner.input_batch.generators.items()}
    assert rekey_generators(runner) == 1
    after = {i: g.get_state() for i, g in runner.input_batch.generators.items()}
    assert not torch.equal(before[0], after[0])
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])


def test_in_a_speculative_step_only_keyed_rows_without_drafts_are_rekeyed():
    """A keyed row with drafts this step keeps its stream; keyed rows with none are re-keyed."""
    runner = _runner([("drafted", 5, {POSITION_KEY: 0}, 4, 6), ("plain", 7, {POSITION_KEY: 3}, 4, 6)])
    before = {i: g.get_state().clone() for i, g in runner.input_batch.generators.items()}
    assert rekey_generators(runner, num_draft_tokens=[2, 0]) == 1
    after = {i: g.get_state() for i, g in runner.input_batch.generators.items()}
    assert torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])
