"""The trainer-batch <-> Seer-groups mapping of integrations/batching.py, without engines."""

from __future__ import annotations

import pytest

from seer.integrations.batching import (
    SeerIntegrationError,
    process_slice,
    rows_from_groups,
    sampling_from_settings,
    unique_groups,
)
from seer.protocol import GroupResult, SampleResult, TurnRecord


def sample(index: int, tokens: list[int]) -> SampleResult:
    return SampleResult(sample_index=index, token_ids=tokens, logprobs=[-0.5 * t for t in tokens], text="",
                        finish_reason="length", num_prompt_tokens=2, first_scheduled_s=0.0, finished_s=0.0,
                        engine_ids=[0])


def test_unique_groups_takes_one_prompt_per_group_of_g_identical_rows():
    """[p0]*G + [p1]*G becomes [p0, p1], in batch order."""
    rows = [[1, 2]] * 3 + [[7]] * 3
    assert unique_groups(rows, 3) == [[1, 2], [7]]


def test_the_same_prompt_twice_in_a_batch_stays_two_groups():
    """Two groups of the same prompt (a dataset with a duplicate row) are two groups, not merged."""
    assert unique_groups([[5]] * 4, 2) == [[5], [5]]


@pytest.mark.parametrize("num_rows", [0, 5, 7])
def test_a_batch_that_is_not_whole_groups_is_refused_with_the_fix(num_rows):
    """A batch size that is not a multiple of G names G and the setting to change."""
    with pytest.raises(SeerIntegrationError, match="not a multiple of num_generations=3.*generation batch size"):
        unique_groups([[1]] * num_rows, 3)


def test_a_group_holding_two_different_prompts_is_refused():
    """Rows of one G-block that differ (a shuffled batch) are refused, naming the rows."""
    with pytest.raises(SeerIntegrationError, match="rows 2 and 3 .* different prompts"):
        unique_groups([[1], [1], [2], [3]], 2)


def test_rows_from_groups_expands_in_row_order_and_keeps_logprobs_per_token():
    """Row i*G+j is sample j of group i; samples are ordered by sample_index even if they arrive out of order."""
    groups = [GroupResult(group_index=0, prompt_id="0", samples=[sample(1, [11, 12]), sample(0, [10])]),
              GroupResult(group_index=1, prompt_id="1", samples=[sample(0, [20]), sample(1, [21, 22, 23])])]
    out = rows_from_groups([[1, 2], [3]], groups, 2)
    assert out["prompt_ids"] == [[1, 2], [1, 2], [3], [3]]
    assert out["completion_ids"] == [[10], [11, 12], [20], [21, 22, 23]]
    assert out["logprobs"] == [[-5.0], [-5.5, -6.0], [-10.0], [-10.5, -11.0, -11.5]]


def test_trajectories_give_trl_their_env_mask_reward_and_turns():
    """A trajectory's loss mask becomes TRL's ``env_mask`` (appended tokens out of the loss),
    with its reward and turn count as extra fields; single-turn rollouts add none of them."""
    def traj(index: int, mask: list[int], reward: float | None) -> SampleResult:
        s = sample(index, list(range(len(mask))))
        s.loss_mask, s.reward = mask, reward
        s.turns = [TurnRecord(start=0, end=1, engine_ids=[0]), TurnRecord(start=3, end=4, engine_ids=[1])]
        return s
    groups = [GroupResult(group_index=0, prompt_id="0", samples=[traj(0, [1, 0, 0, 1], 1.0),
                                                                 traj(1, [1, 0, 0, 1], None)])]
    out = rows_from_groups([[1]], groups, 2)
    assert out["env_mask"] == [[1, 0, 0, 1], [1, 0, 0, 1]]
    assert out["env_reward"] == [1.0, None] and out["num_turns"] == [2, 2]
    single = rows_from_groups([[1]], [GroupResult(group_index=0, prompt_id="0", samples=[sample(0, [1]),
                                                                                        sample(1, [2])])], 2)
    assert set(single) == {"prompt_ids", "completion_ids", "logprobs"}


def test_rows_from_groups_refuses_a_short_group():
    """A group with fewer than G samples is an error, never silently fewer rows."""
    groups = [GroupResult(group_index=0, prompt_id="0", samples=[sample(0, [1])])]
    with pytest.raises(SeerIntegrationError, match="1 samples, expected group 0 with 2"):
        rows_from_groups([[1]], groups, 2)


def test_process_slices_cover_the_gathered_batch_once():
    """Each rank gets its own contiguous rows; together they are the whole batch, in rank order."""
    gathered = list(range(12))
    parts = [gathered[process_slice(rank, 4)] for rank in range(3)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_sampling_passes_temperature_top_p_top_k_and_length_through():
    """TRL's settings become Seer's; TRL's top_k=0 (off) becomes Seer's -1."""
    params = sampling_from_settings(temperature=0.7, top_p=0.9, top_k=0, max_completion_length=64, seed=3)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (0.7, 0.9, -1, 64, 3)
    assert sampling_from_settings(temperature=1.0, top_p=1.0, top_k=20, max_completion_length=8).top_k == 20


@pytest.mark.parametrize(("setting", "match"), [
    ({"repetition_penalty": 1.1}, "repetition_penalty=1.1.*set repetition_penalty=1.0"),
    ({"min_p": 0.05}, "min_p=0.05.*set min_p=None"),
    ({"generation_kwargs": {"typical_p": 0.9}}, "generation_kwargs=.*set generation_kwargs=None"),
    ({"max_completion_length": None}, "max_completion_length=None"),
    ({"top_p": 0.0}, "out of Seer's range.*top_p"),
    ({"temperature": -1.0}, "out of Seer's range.*temperature"),
])
def test_sampling_settings_seer_cannot_honour_are_refused_with_the_fix(setting, match):
    """Penalties, min_p, extra generation kwargs and out-of-range values raise, naming the setting and the fix."""
    settings = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_completion_length": 32, **setting}
    with pytest.raises(SeerIntegrationError, match=match):
        sampling_from_settings(**settings)


def test_a_daemon_that_is_down_raises_in_the_trainer_with_the_fix(tmp_path):
    """No daemon.json, or an address nobody answers: SeerIntegrationError saying how to start one."""
    from seer.integrations.trl import SeerRollout

    with pytest.raises(SeerIntegrationError, match="no Seer daemon found.*seerctl start"):
        SeerRollout(run_dir=str(tmp_path)).capabilities()
    seer = SeerRollout(address=f"ipc://{tmp_path}/nobody.sock", timeout_s=1.0)
    try:
        with pytest.raises(SeerIntegrationError, match="did not answer within 1 s: start it with `seerctl start"):
            seer.capabilities()
    finally:
        seer.close()
