"""The veRL adapter against veRL 0.9.1's real classes (DataProto, the plugin loader, the
checkpoint-engine registry, load_class_from_fqn) and a real Seer daemon on simulated engines."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.model import compute_position_id_with_mask

from seer.integrations.verl import SeerAgentLoopManager, SeerRolloutError, SeerSettingsError, VerlBatchError
from seer.integrations.verl.batch import plan_groups

MANAGER = "seer.integrations.verl.SeerAgentLoopManager"
PROMPT_LENGTH, RESPONSE_LENGTH = 96, 24
QUESTIONS = ["What is 12 times 7?", "Name a color.", "Say hi.", "Count to three."]


class ByteChatTokenizer:
    """The simulated engines' vocabulary (UTF-8 bytes past three special ids, as Seer's
    ByteTokenizer), with the Hugging Face methods the manager calls."""

    pad_token_id, eos_token_id = 0, 2

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [1] + [b + 3 for b in text.encode()]


def verl_config(seer: dict, *, n: int = 4, **rollout: object):
    """The part of veRL's trainer config the manager and the checkpoint engine read."""
    return OmegaConf.create({
        "actor_rollout_ref": {
            "model": {"path": "unused-with-an-injected-tokenizer"},
            "rollout": {
                "n": n, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": True, "repetition_penalty": 1.0,
                "prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH, "ignore_eos": False,
                "calculate_log_probs": True, "multi_turn": {"enable": False},
                "val_kwargs": {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "do_sample": False},
                "agent": {"agent_loop_manager_class": MANAGER, "num_workers": 2},
                "checkpoint_engine": {"backend": "seer", "engine_kwargs": {"seer": seer}},
                **rollout,
            },
        },
        "data": {"apply_chat_template_kwargs": {}},
    })


def dataset_batch(questions: list[str]) -> DataProto:
    """A batch as veRL 0.9.1's RLHFDataset + the trainer's step make it: raw chat, reward
    columns, the dataset's dummy_tensor, and one uid per prompt."""
    batch = DataProto.from_single_dict({
        "dummy_tensor": torch.zeros((len(questions), 1), dtype=torch.uint8),
        "raw_prompt": np.array([[{"role": "user", "content": q}] for q in questions], dtype=object),
        "data_source": np.array(["math"] * len(questions), dtype=object),
        "reward_model": np.array([{"ground_truth": str(i)} for i in range(len(questions))], dtype=object),
        "extra_info": np.array([{} for _ in questions], dtype=object),
        "index": np.arange(len(questions)),
    })
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in questions], dtype=object)
    return batch


def gen_batch_of(batch: DataProto) -> DataProto:
    """RayPPOTrainer._get_gen_batch (veRL 0.9.1): pop every non-reward column, keep the reward ones in both."""
    reward_keys = {"data_source", "reward_model", "extra_info", "uid"} & batch.non_tensor_batch.keys()
    gen = batch.pop(batch_keys=[], non_tensor_batch_keys=list(set(batch.non_tensor_batch.keys()) - reward_keys))
    gen.non_tensor_batch.update(batch.non_tensor_batch)
    gen.meta_info["global_steps"] = 1
    return gen


def train_batch(questions: list[str]) -> DataProto:
    """The generation batch of a fresh dataset batch (before the trainer's repeat)."""
    return gen_batch_of(dataset_batch(questions))


def make_manager(config, **kwargs) -> SeerAgentLoopManager:
    """As ray_trainer.py does: load the class by its dotted path, then ``create`` with keywords."""
    cls = load_class_from_fqn(config.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    return cls.create(config=config, llm_client=None, teacher_client=None, tokenizer=ByteChatTokenizer(), **kwargs)


@pytest.fixture(scope="module")
def manager(sim_daemon):
    m = make_manager(verl_config({"run_dir": str(sim_daemon.run_dir), "seed": 7}), reward_loop_worker_handles=None)
    yield m
    m.close()


def test_import_verl_registers_the_seer_checkpoint_engine():
    """`import verl` loads the verl.plugins entry point, which registers backend `seer` in CheckpointEngineRegistry."""
    from importlib.metadata import entry_points

    from verl.checkpoint_engine import CheckpointEngineRegistry

    from seer.integrations.verl.checkpoint import SeerCheckpointEngine

    assert [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "seer"] == [
        "seer.integrations.verl.plugin"]
    assert CheckpointEngineRegistry.get("seer") is SeerCheckpointEngine
    engine = CheckpointEngineRegistry.new("seer", is_master=True, bucket_size=1 << 20, run_dir="/nonexistent")
    assert engine.build_topology(2, 4, [{}] * 6) == ({}, {})


def test_generate_sequences_returns_verl_shapes_in_group_order(manager):
    """One rollout per batch: rows keep the input order, each uid's n rows share its prompt, tensors are padded as veRL's agent loop pads them."""
    batch = dataset_batch(QUESTIONS)
    gen_batch = gen_batch_of(batch).repeat(repeat_times=4, interleave=True)
    out = manager.generate_sequences(gen_batch)
    rows = len(QUESTIONS) * 4
    tensors = out.batch
    assert tensors["prompts"].shape == (rows, PROMPT_LENGTH)
    assert tensors["responses"].shape == tensors["response_mask"].shape == tensors["rollout_log_probs"].shape == (
        rows, RESPONSE_LENGTH)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert tensors[key].shape == (rows, PROMPT_LENGTH + RESPONSE_LENGTH), key
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert tensors[key].dtype == torch.int64, key
    assert tensors["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(tensors["position_ids"], compute_position_id_with_mask(tensors["attention_mask"]))
    assert torch.equal(tensors["input_ids"], torch.cat([tensors["prompts"], tensors["responses"]], dim=1))
    tok = ByteChatTokenizer()
    for row in range(rows):
        question = QUESTIONS[row // 4]
        expected = tok.apply_chat_template([{"role": "user", "content": question}])
        prompt_mask = tensors["attention_mask"][row, :PROMPT_LENGTH]
        assert prompt_mask.tolist() == [0] * (PROMPT_LENGTH - len(expected)) + [1] * len(expected)  # left padded
        assert tensors["prompts"][row, PROMPT_LENGTH - len(expected):].tolist() == expected
        assert (tensors["prompts"][row, :PROMPT_LENGTH - len(expected)] == tok.pad_token_id).all()
        length = int(tensors["response_mask"][row].sum())
        assert length >= 1
        assert tensors["response_mask"][row].tolist() == [1] * length + [0] * (RESPONSE_LENGTH - length)  # right
        assert torch.equal(tensors["attention_mask"][row, PROMPT_LENGTH:], tensors["response_mask"][row])
        assert (tensors["responses"][row, length:] == tok.pad_token_id).all()
        assert (tensors["rollout_log_probs"][row, length:] == 0).all()
        assert (tensors["rollout_log_probs"][row, :length] <= 0).all()
    # siblings of a group are different samples (per-sample seeds), not copies
    first_group = {tuple(tensors["responses"][r].tolist()) for r in range(4)}
    assert len(first_group) > 1
    timing = out.meta_info["timing"]
    assert timing["seer/num_output_tokens"] == int(tensors["response_mask"].sum())
    assert all(isinstance(v, float) for v in timing.values())
    # the trainer's next lines: repeat the batch the same way and union it with the output
    merged = batch.repeat(repeat_times=4, interleave=True).union(out)
    assert list(merged.non_tensor_batch["uid"]) == list(gen_batch.non_tensor_batch["uid"])
    assert merged.non_tensor_batch["__num_turns__"].tolist() == [2] * rows


def test_same_seed_and_step_give_the_same_batch(manager):
    """With engine_kwargs.seer.seed, a step's rollout is reproducible (seed + global_steps)."""
    gen_batch = train_batch(QUESTIONS[:2]).repeat(repeat_times=4, interleave=True)
    first = manager.generate_sequences(gen_batch)
    second = manager.generate_sequences(gen_batch)
    assert torch.equal(first.batch["responses"], second.batch["responses"])


def test_validation_batch_padded_to_a_divisor_is_generated_row_by_row(manager):
    """A validation batch that veRL padded with repeated rows (breaking groups) is generated with one row per group, greedy."""
    batch = train_batch(QUESTIONS[:3])
    batch.meta_info = {"validate": True, "global_steps": 0}
    padded, pad_size = pad_dataproto_to_divisor(batch, 2)
    assert pad_size == 1
    out = manager.generate_sequences(padded)
    assert len(out) == 4
    out = unpad_dataproto(out, pad_size)
    assert len(out) == 3
    assert torch.equal(out.batch["responses"][0], manager.generate_sequences(padded).batch["responses"][3])  # greedy


def test_batch_not_a_multiple_of_n_is_refused_with_the_fix(manager):
    """10 rows with n=4: VerlBatchError naming the row count, rollout.n and repeat(interleave=True)."""
    gen_batch = train_batch(QUESTIONS).repeat(repeat_times=4, interleave=True).slice(0, 10)
    with pytest.raises(VerlBatchError, match=r"10 rows, not a multiple of actor_rollout_ref.rollout.n=4.*interleave"):
        manager.generate_sequences(gen_batch)


def test_uids_that_do_not_form_whole_groups_are_refused(manager):
    """Rows not in consecutive blocks of one uid (a stacked repeat), or one uid for two prompts, are refused with the fix."""
    stacked = train_batch(QUESTIONS).repeat(repeat_times=4, interleave=False)
    with pytest.raises(VerlBatchError, match=r"rows 0\.\.3 carry uids .*interleave=True"):
        manager.generate_sequences(stacked)
    shared = train_batch(QUESTIONS[:2])
    shared.non_tensor_batch["uid"] = np.array(["same", "same"], dtype=object)
    with pytest.raises(VerlBatchError, match=r"uid 'same' appears in rows 0\.\. and 4\.\."):
        manager.generate_sequences(shared.repeat(repeat_times=4, interleave=True))
    no_uid = train_batch(QUESTIONS[:1]).repeat(repeat_times=4, interleave=True)
    no_uid.non_tensor_batch.pop("uid")
    with pytest.raises(VerlBatchError, match=r"no non_tensor_batch\['uid'\]"):
        manager.generate_sequences(no_uid)


def test_plan_groups_maps_rows_to_groups():
    """Pure grouping: training blocks of n, validation falls back to single rows when groups are broken."""
    assert plan_groups(["a", "a", "b", "b"], 2, validate=False).groups == [[0, 1], [2, 3]]
    assert plan_groups(["a", "b", "a"], 1, validate=True).groups == [[0], [1], [2]]
    assert plan_groups(["a", "a", "b", "b", "a"], 2, validate=True).group_size == 1


def test_settings_seer_cannot_honour_are_refused_before_a_rollout(sim_daemon):
    """repetition_penalty, multi-turn and a group larger than the daemon allows each fail with the config key to change."""
    seer = {"run_dir": str(sim_daemon.run_dir)}
    batch = train_batch(QUESTIONS[:1])
    for rollout, n, pattern in [
        ({"repetition_penalty": 1.1}, 4, r"repetition_penalty=1\.1.*set actor_rollout_ref\.rollout\.repetition_penalty=1\.0"),
        ({"multi_turn": {"enable": True}}, 4, r"multi_turn\.enable=True"),
        ({}, 32, r"bad_group_size.*set actor_rollout_ref\.rollout\.n .*server\.max_group_size"),
    ]:
        m = make_manager(verl_config(seer, n=n, **rollout), reward_loop_worker_handles=None)
        try:
            with pytest.raises((VerlBatchError, SeerRolloutError), match=pattern):
                m.generate_sequences(batch.repeat(repeat_times=n, interleave=True))
        finally:
            m.close()
    with pytest.raises(SeerSettingsError, match=r"engine_kwargs\.seer.*unknown_key"):
        make_manager(verl_config({**seer, "unknown_key": 1}), reward_loop_worker_handles=None)


def test_daemon_down_fails_at_create_naming_the_fix(tmp_path):
    """No daemon: create() raises SeerRolloutError in the trainer's process, naming seerctl start / the address setting."""
    with pytest.raises(SeerRolloutError, match=r"no Seer daemon found in .*set actor_rollout_ref\.rollout\."
                                               r"checkpoint_engine\.engine_kwargs\.seer\.address or \.run_dir"):
        make_manager(verl_config({"run_dir": str(tmp_path / "nothing")}), reward_loop_worker_handles=None)
    address = f"ipc://{tmp_path}/no-daemon.sock"
    with pytest.raises(SeerRolloutError, match=r"did not answer.*seerctl start"):
        make_manager(verl_config({"address": address, "timeout_s": 2.0}), reward_loop_worker_handles=None)


class FakeRewardWorker:
    """veRL's RewardLoopWorker call shape: ``compute_score_batch.remote(DataProto) -> list[dict]``."""

    def __init__(self) -> None:
        self.rows_seen = 0
        worker = self

        class Method:
            @staticmethod
            def remote(data: DataProto) -> list[dict]:
                worker.rows_seen += len(data)
                assert "data_source" in data.non_tensor_batch and "responses" in data.batch.keys()
                return [{"reward_score": float(i % 2), "reward_extra_info": {"acc": float(i % 2)}}
                        for i in range(len(data))]

        self.compute_score_batch = Method()


def test_reward_workers_score_every_row(sim_daemon):
    """With veRL's reward-loop workers, rm_scores carries each row's score on its last response token."""
    workers = [FakeRewardWorker(), FakeRewardWorker()]
    m = make_manager(verl_config({"run_dir": str(sim_daemon.run_dir)}), reward_loop_worker_handles=workers)
    try:
        out = m.generate_sequences(train_batch(QUESTIONS[:2]).repeat(repeat_times=4, interleave=True))
    finally:
        m.close()
    assert sum(w.rows_seen for w in workers) == 8 and all(w.rows_seen for w in workers)
    scores = out.batch["rm_scores"]
    last = out.batch["response_mask"].sum(dim=1) - 1
    assert scores.sum(dim=1).tolist() == [scores[r, last[r]].item() for r in range(8)]
    assert out.meta_info["reward_extra_keys"] == ["acc"] and len(out.non_tensor_batch["acc"]) == 8


def test_checkpoint_engine_hands_weights_to_seer(sim_daemon, tmp_path):
    """send_weights on rank 0 writes a safetensors file, Seer's weights version goes up, the previous step's file is removed; other ranks send nothing."""
    from safetensors.torch import load_file
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from seer.client import SeerClient

    kwargs = {"run_dir": str(sim_daemon.run_dir), "weights_dir": str(tmp_path)}
    master = CheckpointEngineRegistry.new("seer", is_master=True, bucket_size=1 << 20, **kwargs)
    other = CheckpointEngineRegistry.new("seer", is_master=False, bucket_size=1 << 20, **kwargs)
    weights = {"model.embed_tokens.weight": torch.randn(8, 4), "lm_head.weight": torch.randn(8, 4)}

    def per_tensor():  # veRL's get_per_tensor_param is a generator of (name, tensor)
        yield from weights.items()

    with SeerClient(run_dir=sim_daemon.run_dir) as client:
        before = client.status().weights_version
    metrics = asyncio.run(master.send_weights(per_tensor(), global_steps=1))
    assert metrics["seer/weights_version"] == before + 1
    first = tmp_path / "seer-verl-step-1" / "model.safetensors"
    assert torch.equal(load_file(str(first))["lm_head.weight"], weights["lm_head.weight"])
    assert asyncio.run(other.send_weights(per_tensor(), global_steps=1)) == {}
    metrics = asyncio.run(master.send_weights(per_tensor(), global_steps=2))
    assert metrics["seer/weights_version"] == before + 2
    assert not first.parent.exists() and (tmp_path / "seer-verl-step-2" / "model.safetensors").exists()


def test_checkpoint_engine_with_daemon_down_names_the_fix(tmp_path):
    """send_weights with no daemon raises SeerWeightsError naming the setting to fix."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from seer.integrations.verl.checkpoint import SeerWeightsError

    engine = CheckpointEngineRegistry.new("seer", is_master=True, bucket_size=1,
                                          address=f"ipc://{tmp_path}/none.sock", timeout_s=2.0,
                                          weights_dir=str(tmp_path))
    with pytest.raises(SeerWeightsError, match=r"did not take the trainer's weights of step 3.*did not answer"):
        asyncio.run(engine.send_weights(iter([("w", torch.zeros(2))]), global_steps=3))


def test_receive_weights_yields_nothing():
    """veRL's rollout-side workers get no tensors from the seer backend (Seer's engines load the file)."""
    from seer.integrations.verl.checkpoint import SeerCheckpointEngine

    async def drain() -> list:
        return [item async for item in SeerCheckpointEngine(run_dir="/x").receive_weights(1)]

    assert asyncio.run(drain()) == []


def test_prompt_longer_than_prompt_length_is_refused(sim_daemon):
    """A prompt longer than rollout.prompt_length is refused with the data settings to change."""
    m = make_manager(verl_config({"run_dir": str(sim_daemon.run_dir)}, prompt_length=8), reward_loop_worker_handles=None)
    try:
        with pytest.raises(VerlBatchError, match=r"more than actor_rollout_ref\.rollout\.prompt_length=8.*"
                                                 r"filter_overlong_prompts"):
            m.generate_sequences(train_batch(QUESTIONS[:1]).repeat(repeat_times=4, interleave=True))
    finally:
        m.close()

