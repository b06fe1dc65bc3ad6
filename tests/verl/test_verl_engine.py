"""The veRL adapter with a real vLLM engine and the bundled SmolLM2: prompts tokenised by the
trainer's tokenizer, logprobs against the trainer's own forward pass, weights updates."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from tests.verl.conftest import SeerDaemon, write_config
from tests.verl.test_verl_manager import QUESTIONS, dataset_batch, gen_batch_of, verl_config

pytestmark = pytest.mark.engine

MODEL_DIR = Path(os.environ.get("SEER_CACHE_DIR", Path.home() / ".cache" / "seer")) / "models" / "SmolLM2-135M-Instruct"
N = 4


@pytest.fixture(scope="module")
def vllm_daemon(tmp_path_factory: pytest.TempPathFactory):
    if not (MODEL_DIR / ".seer-complete").exists():
        pytest.fail(f"the model is not prepared in {MODEL_DIR}; run `bash scripts/setup.sh` first")
    root = tmp_path_factory.mktemp("verl-vllm")
    config = write_config(root / "seer.toml", """
[model]
dtype = "float32"
max_model_len = 1024

[engines]
backend = "vllm"
count = 1
kv_cache_gib = 1.0
""")
    daemon = SeerDaemon(root / "run", config).start()
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def generated(vllm_daemon):
    """One veRL generation batch (2 prompts x n=4) through the manager, tokenizer loaded from model.path."""
    from verl.utils.import_utils import load_class_from_fqn

    config = verl_config({"run_dir": str(vllm_daemon.run_dir), "seed": 3}, n=N, prompt_length=128,
                         response_length=32)
    config.actor_rollout_ref.model.path = str(MODEL_DIR)
    cls = load_class_from_fqn(config.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    manager = cls.create(config=config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None)
    try:
        yield manager.generate_sequences(gen_batch_of(dataset_batch(QUESTIONS[:2])).repeat(N, interleave=True))
    finally:
        manager.close()


def test_prompts_are_the_trainers_chat_tokens(generated):
    """Each row's prompt is the model's chat template applied by the trainer's tokenizer (as veRL's agent loop tokenises)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    for row in range(2 * N):
        expected = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[row // N]}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
        prompt = generated.batch["prompts"][row]
        assert prompt[128 - len(expected):].tolist() == expected
        assert int(generated.batch["attention_mask"][row, :128].sum()) == len(expected)


def test_rollout_logprobs_match_the_trainers_forward_pass(generated):
    """rollout_log_probs equal the log-softmax of a float32 Hugging Face forward pass over the same tokens (the old-policy logprobs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    worst = 0.0
    for row in range(2 * N):
        mask = generated.batch["attention_mask"][row].bool()
        ids = generated.batch["input_ids"][row][mask].unsqueeze(0)
        length = int(generated.batch["response_mask"][row].sum())
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
        trainer = logprobs[-length:]
        seer = generated.batch["rollout_log_probs"][row, :length]
        worst = max(worst, float((trainer - seer).abs().max()))
    print(f"max |seer - trainer| logprob difference: {worst:.2e}")
    assert worst < 1e-3


def test_weights_from_the_checkpoint_engine_load_into_real_engines(vllm_daemon, tmp_path):
    """The model's own tensors sent through the seer backend load (version + 1); a tensor of the wrong shape is refused naming the fix."""
    from safetensors.torch import load_file
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from seer.integrations.verl.checkpoint import SeerWeightsError

    engine = CheckpointEngineRegistry.new("seer", is_master=True, bucket_size=1 << 20,
                                          run_dir=str(vllm_daemon.run_dir), weights_dir=str(tmp_path))
    state = load_file(str(MODEL_DIR / "model.safetensors"))
    metrics = asyncio.run(engine.send_weights(iter(state.items()), global_steps=1))
    assert metrics["seer/weights_version"] >= 1
    wrong = {name: (torch.zeros(3, 3) if i == 0 else t) for i, (name, t) in enumerate(state.items())}
    with pytest.raises(SeerWeightsError, match=r"could not load the trainer's weights of step 2.*"
                                               r"actor_rollout_ref\.model\.path.*same architecture"):
        asyncio.run(engine.send_weights(iter(wrong.items()), global_steps=2))
