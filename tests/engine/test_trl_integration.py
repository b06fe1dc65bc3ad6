"""TRL's GRPOTrainer training through Seer (integrations/trl.py) against one real vLLM engine.

A daemon of its own (one engine, float32 SmolLM2): these tests push new weights, which the
session daemon's reference comparisons must never see. One short training run (2 optimizer
steps, G=4, 16-token completions) is shared by the tests of this module.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
PROBE = [{"role": "user", "content": "What is 12 times 7? Give the answer after '####'."}]
# HF (eager attention) and vLLM's CPU kernels sum in different orders; float32 noise measured
# here is ~1e-5..1e-4 per token (docs/integrations.md). A wrong token, position or temperature
# is off by far more than this (>0.1).
LOGPROB_TOL = 2e-3


def load_example():
    spec = importlib.util.spec_from_file_location("trl_grpo_example", ROOT / "examples" / "trl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def length_reward(completions: list, **kwargs) -> list[float]:
    """Varies within every group (lengths differ), so every step has a non-zero gradient."""
    return [len(c[-1]["content"] if isinstance(c, list) else c) / 100.0 for c in completions]


@pytest.fixture(scope="module")
def trl_daemon(tmp_path_factory: pytest.TempPathFactory, model_dir):
    root = tmp_path_factory.mktemp("trl")
    config = root / "seer.toml"
    config.write_text('[model]\ndtype = "float32"\nmax_model_len = 512\n\n'
                      '[engines]\nbackend = "vllm"\ncount = 1\nkv_cache_gib = 1.0\n')
    daemon = Daemon(root / "run", config)
    daemon.start()
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def trained(trl_daemon):
    """Probe logprobs before, a 2-step GRPO run with Seer, probe logprobs after."""
    from seer.client import SamplingParams, SeerClient

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    example = load_example()
    trainer, seer, _ = example.build_trainer(rollout="seer", steps=2, group_size=4, prompts_per_step=1,
                                             max_completion_length=16, learning_rate=1e-4,
                                             run_dir=str(trl_daemon.run_dir), reward_funcs=length_reward)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    with SeerClient(run_dir=trl_daemon.run_dir, timeout_s=300) as client:
        before = client.rollout([{"messages": PROBE}], 1, sampling=greedy)
        trainer.train()
        after = client.rollout([{"messages": PROBE}], 1, sampling=greedy)
        status = client.status()
    yield {"trainer": trainer, "seer": seer, "before": before, "after": after, "status": status}
    seer.close()


def test_weights_version_increases_after_every_step(trained):
    """The initial push and each optimizer step load a new version; each rollout ran on the latest one."""
    sync, seer = trained["seer"].sync, trained["seer"]
    versions = [s.weights_version for s in sync.syncs]
    assert [s.global_step for s in sync.syncs] == [0, 1, 2]
    assert versions == sorted(set(versions)) and len(versions) == 3
    assert [r.weights_version for r in seer.rollouts] == versions[:2]  # step k generated with step k-1's push
    assert trained["status"].weights_version == versions[-1] == trained["after"].weights_version
    assert all(e.weights_version == versions[-1] for e in trained["status"].engines)


def test_engine_logprobs_of_a_fixed_probe_change_after_training(trained):
    """The engine really serves the trained weights: the probe's logprobs move (same greedy prefix compared)."""
    before = trained["before"].groups[0].samples[0]
    after = trained["after"].groups[0].samples[0]
    common = 0
    while common < min(len(before.token_ids), len(after.token_ids)) and \
            before.token_ids[common] == after.token_ids[common]:
        common += 1
    if common < len(before.token_ids):  # a different greedy token is itself a change
        assert before.token_ids != after.token_ids
        return
    diffs = [abs(a - b) for a, b in zip(before.logprobs, after.logprobs, strict=False)]
    assert max(diffs) > 1e-3, diffs


def test_seer_logprobs_match_the_trainers_forward_pass(trained, trl_daemon):
    """Seer's per-token logprobs equal TRL's own _get_per_token_logps of the same tokens (temperature 1)."""
    import torch

    from seer.integrations.trl import SeerRollout

    trainer = trained["trainer"]
    seer = SeerRollout(run_dir=str(trl_daemon.run_dir), timeout_s=300)
    try:
        trainer.model.eval()
        trainer.num_generations_eval = 4
        out = seer([PROBE] * 4, trainer)  # the adapter's own path: tokenize, group, roll out, slice
    finally:
        seer.close()
    worst = 0.0
    for prompt_ids, completion_ids, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"],
                                                    strict=True):
        ids = torch.tensor([prompt_ids + completion_ids])
        with torch.no_grad():
            trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, torch.ones_like(ids), len(completion_ids))
        diff = (trl_logps[0] - torch.tensor(logprobs)).abs().max().item()
        worst = max(worst, diff)
    print(f"max |seer - trl| logprob over {sum(map(len, out['completion_ids']))} tokens: {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_bad_input_raises_in_the_trainer_with_the_fix(trained, trl_daemon):
    """A batch that is not whole groups, a penalty Seer lacks, a foreign vocabulary and a weight file of
    another model each raise SeerIntegrationError naming the fix."""
    import torch

    from seer.integrations.batching import SeerIntegrationError
    from seer.integrations.trl import SeerRollout

    trainer = trained["trainer"]
    trainer.model.train()
    seer = SeerRollout(run_dir=str(trl_daemon.run_dir), timeout_s=300)
    try:
        with pytest.raises(SeerIntegrationError, match="3 rows, not a multiple of num_generations=4"):
            seer([PROBE] * 3, trainer)
        trainer.args.repetition_penalty = 1.3
        try:
            with pytest.raises(SeerIntegrationError, match="repetition_penalty=1.3.*set repetition_penalty=1.0"):
                seer([PROBE] * 4, trainer)
        finally:
            trainer.args.repetition_penalty = 1.0
        with pytest.raises(SeerIntegrationError, match="vocab_size=1000 but the Seer daemon serves"):
            seer.check_model(1000, 16)
        with pytest.raises(SeerIntegrationError, match="max_completion_length=512 leaves no room"):
            seer.check_model(trainer.model.config.vocab_size, 512)
        wrong = torch.nn.Linear(4, 3)  # another model's checkpoint: unknown tensors
        sync = seer.weight_sync()
        with pytest.raises(SeerIntegrationError, match="do not match the served model.*fix: the daemon must serve"):
            sync.push(wrong, 0)
        assert seer.client().status().weights_version == trained["status"].weights_version  # nothing loaded
        sync.on_train_end(None, None, None)  # removes its /dev/shm folder
    finally:
        seer.close()
