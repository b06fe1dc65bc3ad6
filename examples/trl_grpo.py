"""TRL's GRPOTrainer fine-tunes the bundled SmolLM2-135M (float32, on CPU) on the example
math prompts, with Seer generating every completion and the weights pushed to Seer after
every optimizer step. The reward is 1 when the number after ``####`` equals the answer.

    .venv/bin/seerctl start --config seer.toml          # or --start-daemon below
    .venv/bin/python examples/trl_grpo.py --steps 5 --group-size 4

``--rollout trl`` runs the same training with TRL generating itself (``use_vllm=False``,
``model.generate``), for comparison; ``--json FILE`` writes the per-step timings
(benchmarks/trl_rollout_share.py runs both and prints the table).

The lines a user adds to a TRL script are the three marked ``# Seer``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16

MODEL_DIR = Path(os.environ.get("SEER_CACHE_DIR", Path.home() / ".cache" / "seer")) / "models" / "SmolLM2-135M-Instruct"
PROMPTS = Path(__file__).with_name("math_prompts.jsonl")
ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")

DAEMON_CONFIG = """
[model]
dtype = "float32"
max_model_len = 1024

[engines]
backend = "vllm"
count = {engines}
kv_cache_gib = 1.0
"""


def load_dataset(path: Path = PROMPTS):
    from datasets import Dataset

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])


def extract_answer(text: str) -> str | None:
    """The number after the last ``####``, without thousands separators; None if there is none."""
    found = ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def answer_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 when the completion's ``####`` answer equals the reference, 0.1 for a wrong number after
    ``####`` (the format, so a small model gets a gradient at all), else 0.0."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    found = [extract_answer(t) for t in texts]
    return [1.0 if f == str(a) else 0.1 if f is not None else 0.0 for f, a in zip(found, answer, strict=True)]


class StepTimer:
    """Wall time of each optimizer step and of the generation inside it (TRL's ``_generate``)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._t0 = 0.0
        self._generate_s = 0.0

    def wrap(self, trainer) -> None:
        inner = trainer._generate

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._generate_s += time.perf_counter() - t

        trainer._generate = timed

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._t0, timer._generate_s = time.perf_counter(), 0.0

            def on_step_end(self, args, state, control, **kwargs):  # runs after SeerWeightSync's (listed later)
                timer.steps.append({"step": state.global_step, "step_s": time.perf_counter() - timer._t0,
                                    "generate_s": timer._generate_s})

        return _Callback()


def build_trainer(*, rollout: str, steps: int, group_size: int, prompts_per_step: int, max_completion_length: int,
                  seed: int = 0, address: str | None = None, run_dir: str | None = None,
                  model_dir: Path = MODEL_DIR, learning_rate: float = 1e-5, reward_funcs=None):
    """A GRPOTrainer on CPU; with ``rollout="seer"`` Seer generates and receives every step's weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from seer.integrations.trl import SeerRollout  # Seer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), max_steps=steps, learning_rate=learning_rate,
        per_device_train_batch_size=prompts_per_step * group_size, num_generations=group_size,
        max_completion_length=max_completion_length, temperature=1.0, beta=0.0, use_cpu=True, bf16=False,
        logging_steps=1, report_to=[], save_strategy="no", seed=seed, use_vllm=False, disable_tqdm=True)
    seer = SeerRollout(address=address, run_dir=run_dir) if rollout == "seer" else None  # Seer
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_funcs or answer_reward, args=config,
                          train_dataset=load_dataset(), rollout_func=seer,                      # Seer
                          callbacks=[seer.weight_sync()] if seer else [])                      # Seer
    timer = StepTimer()
    timer.wrap(trainer)
    trainer.add_callback(timer.callback())  # after SeerWeightSync: a step's time includes its weight push
    return trainer, seer, timer


def start_daemon(run_dir: Path, engines: int) -> None:
    config = run_dir.parent / "seer-trl.toml"
    config.write_text(DAEMON_CONFIG.format(engines=engines))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    subprocess.run([sys.executable, "-m", "seer.cli.main", "start", "--config", str(config), "--run-dir",
                    str(run_dir)], check=True, timeout=900, env=env)


def stop_daemon(run_dir: Path) -> None:
    subprocess.run([sys.executable, "-m", "seer.cli.main", "stop", "--run-dir", str(run_dir)], timeout=300)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollout", choices=["seer", "trl"], default="seer")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None)
    p.add_argument("--run-dir", default=None, help="run dir of a running daemon (default ~/.seer/run)")
    p.add_argument("--start-daemon", action="store_true", help="start a daemon with --engines vLLM engines for "
                                                                "this run and stop it after")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--json", default=None, help="write per-step timings here")
    a = p.parse_args()

    run_dir = a.run_dir
    own_dir = None
    if a.rollout == "seer" and a.start_daemon:
        own_dir = Path(tempfile.mkdtemp(prefix="seer-trl-daemon-"))
        run_dir = str(own_dir / "run")
        start_daemon(Path(run_dir), a.engines)
    try:
        trainer, seer, timer = build_trainer(rollout=a.rollout, steps=a.steps, group_size=a.group_size,
                                             prompts_per_step=a.prompts_per_step,
                                             max_completion_length=a.max_completion_length, seed=a.seed,
                                             address=a.address, run_dir=run_dir)
        t0 = time.perf_counter()
        trainer.train()
        total_s = time.perf_counter() - t0
    finally:
        if own_dir is not None:
            stop_daemon(Path(run_dir))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    syncs = {s.global_step: s for s in seer.sync.syncs} if seer and seer.sync else {}
    rows = []
    for step in timer.steps:
        sync = syncs.get(step["step"])
        rows.append({**step, "sync_write_s": sync.write_s if sync else 0.0,
                     "sync_update_s": sync.update_s if sync else 0.0,
                     "weights_version": sync.weights_version if sync else None})
    print(f"{'step':>4} {'step s':>8} {'generate s':>10} {'share':>6} {'sync s':>7} {'w.version':>9} {'reward':>6}")
    for row, reward in zip(rows, rewards + [float('nan')] * len(rows), strict=False):
        sync_s = row["sync_write_s"] + row["sync_update_s"]
        print(f"{row['step']:>4} {row['step_s']:>8.2f} {row['generate_s']:>10.2f} "
              f"{row['generate_s'] / row['step_s']:>6.1%} {sync_s:>7.2f} {str(row['weights_version']):>9} "
              f"{reward:>6.3f}")
    print(f"rollout={a.rollout} steps={len(rows)} G={a.group_size} prompts/step={a.prompts_per_step} "
          f"max_completion_length={a.max_completion_length} total {total_s:.1f} s")
    if a.json:
        initial = seer.sync.syncs[0] if seer and seer.sync and seer.sync.syncs else None
        Path(a.json).write_text(json.dumps({
            "rollout": a.rollout, "steps": rows, "rewards": rewards, "total_s": total_s,
            "rollouts": [vars(r) for r in seer.rollouts] if seer else [],
            "initial_sync": vars(initial) if initial else None}, indent=1))
    if seer:
        seer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
