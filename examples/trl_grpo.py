"""TRL's GRPOTrainer fine-tunes the bundled SmolLM2-135M-Instruct (float32, on CPU) on
small-number addition (examples/arithmetic.py), with Seer generating every completion and
the weights pushed to Seer's engines through shared memory after every optimizer step.

    .venv/bin/python examples/trl_grpo.py --start-daemon --log run.jsonl

``--log FILE.jsonl`` writes one object per optimizer step (``step``, ``reward_mean``,
``step_s``, ``rollout_s``, ``weight_sync_s``, ...) and then one final object with
``eval_before`` / ``eval_after``: greedy accuracy on the held-out problems, from greedy
rollouts through Seer before the first step and after the last push.

``--env feedback``: every sample is a multi-turn trajectory through Seer (docs/client.md,
"Agentic rollouts"): a wrong answer is told so and may try again, up to 3 turns; the
environment's reward trains the model, TRL masks the feedback tokens out of the loss
(``env_mask``), and each step's log row has ``turns_per_sample``.

``--rollout trl`` runs the same training with TRL generating itself (``use_vllm=False``,
``model.generate``; its evaluation uses ``model.generate`` too). ``--turns DIR``: two runs
sharing DIR take turns step by step (benchmarks/trl_rollout_share.py runs Seer and TRL
that way, so both see the same machine load).

The lines a user adds to a TRL script are the three marked ``# Seer``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16
sys.path.insert(0, str(Path(__file__).parent))

import arithmetic  # noqa: E402  (examples/arithmetic.py: the task)

MODEL_DIR = Path(os.environ.get("SEER_CACHE_DIR", Path.home() / ".cache" / "seer")) / "models" / "SmolLM2-135M-Instruct"

DAEMON_CONFIG = """
[model]
dtype = "float32"
max_model_len = 1024

[engines]
backend = "vllm"
count = {engines}
kv_cache_gib = 1.0
# A machine shared with other jobs can stall a process for tens of seconds (swapping):
# an engine then waits for the control plane instead of exiting after the default 30 s.
heartbeat_timeout_s = 180.0

[scheduler]
policy = "request"
"""

# The default run (docs/integrations.md): settings chosen for this 2-core CPU's budget.
DEFAULTS = {"steps": 30, "group_size": 8, "prompts_per_step": 4, "max_completion_length": 16,
            "learning_rate": 2e-5, "temperature": 1.0}


class Turns:
    """Step-by-step turns between two runs sharing a folder: ``hold()`` waits until it is
    this run's turn (or the other run has finished), and passes the turn on when done."""

    def __init__(self, folder: str | None, me: str, other: str) -> None:
        self.folder = Path(folder) if folder else None
        self.me, self.other = me, other

    def _read(self) -> str:
        try:
            return (self.folder / "turn").read_text()
        except FileNotFoundError:
            return ""

    def _write(self, name: str) -> None:
        tmp = self.folder / f"turn.{self.me}"
        tmp.write_text(name)
        os.replace(tmp, self.folder / "turn")

    def _claim_first_turn(self) -> None:
        """The first run to get here takes the first turn (atomically: O_EXCL)."""
        try:
            fd = os.open(self.folder / "turn", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, self.me.encode())
        os.close(fd)

    @contextlib.contextmanager
    def hold(self):
        if self.folder is None:
            yield
            return
        self._claim_first_turn()
        while self._read() != self.me and not (self.folder / f"done-{self.other}").exists():
            time.sleep(0.05)
        try:
            yield
        finally:
            self._write(self.other)

    def finish(self) -> None:
        if self.folder is not None:
            (self.folder / f"done-{self.me}").touch()
            self._write(self.other)


class StepLog:
    """Per optimizer step: wall time, time in TRL's ``_generate`` (the rollout), the weight
    push (for Seer; it runs in ``on_step_end`` before this callback's), the step's reward."""

    def __init__(self, turns: Turns) -> None:
        self.steps: list[dict] = []
        self.turns = turns
        self._t0 = 0.0
        self._rollout_s = 0.0
        self._turn = None

    def wrap(self, trainer) -> None:
        inner = trainer._generate

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._rollout_s += time.perf_counter() - t

        trainer._generate = timed

    def callbacks(self, sync, seer=None):
        from transformers import TrainerCallback

        log = self

        class Begin(TrainerCallback):  # first in the list: the turn is taken before anything else runs
            def on_step_begin(self, args, state, control, **kwargs):
                log._turn = log.turns.hold()
                log._turn.__enter__()
                log._t0, log._rollout_s = time.perf_counter(), 0.0

        class End(TrainerCallback):  # last in the list: after SeerWeightSync's push
            def on_step_end(self, args, state, control, **kwargs):
                push = sync.syncs[-1] if sync is not None and sync.syncs else None
                log.steps.append({"step": state.global_step, "step_s": time.perf_counter() - log._t0,
                                  "rollout_s": log._rollout_s,
                                  "weight_sync_s": push.write_s + push.update_s if push else 0.0,
                                  "weight_write_s": push.write_s if push else 0.0,
                                  "weight_update_s": push.update_s if push else 0.0,
                                  "weights_version": push.weights_version if push else None,
                                  # Trajectories (--env feedback): model turns per sample this step.
                                  "turns_per_sample": (seer.rollouts[-1].num_turns / (
                                      seer.rollouts[-1].num_groups * args.num_generations))
                                  if seer is not None and seer.env is not None and seer.rollouts else None})
                log._turn.__exit__(None, None, None)

        return Begin(), End()


def dataset(rows: list[dict]):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])


def build_trainer(*, rollout: str, steps: int, group_size: int, prompts_per_step: int, max_completion_length: int,
                  seed: int = 0, address: str | None = None, run_dir: str | None = None,
                  model_dir: Path = MODEL_DIR, learning_rate: float = DEFAULTS["learning_rate"],
                  temperature: float = DEFAULTS["temperature"], reward_funcs=None, turns: Turns | None = None,
                  env: str | None = None):
    """A GRPOTrainer on CPU; with ``rollout="seer"`` Seer generates and receives every step's weights.
    ``env="feedback"``: every sample is a trajectory of up to 3 turns (the feedback environment
    of examples/arithmetic.py), rewarded by the environment."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from seer.integrations.trl import SeerRollout  # Seer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), max_steps=steps, learning_rate=learning_rate,
        lr_scheduler_type="constant", per_device_train_batch_size=prompts_per_step * group_size,
        num_generations=group_size, max_completion_length=max_completion_length, temperature=temperature,
        beta=0.0, use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1, report_to=[],
        save_strategy="no", seed=seed, use_vllm=False, disable_tqdm=True)
    seer = SeerRollout(address=address, run_dir=run_dir, timeout_s=300) if rollout == "seer" else None  # Seer
    if env == "feedback":
        from seer.protocol import TrajectorySpec

        if seer is None:
            raise SystemExit("--env feedback needs --rollout seer (TRL's own generation has no environment here)")
        seer.env, seer.trajectory = feedback_env(tokenizer), TrajectorySpec(max_turns=3)
        reward_funcs = reward_funcs or arithmetic.env_reward
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_funcs or arithmetic.reward,
                          args=config, train_dataset=dataset(arithmetic.load(arithmetic.TRAIN_FILE)),
                          rollout_func=seer,                                                     # Seer
                          callbacks=[seer.weight_sync()] if seer else [])                        # Seer
    log = StepLog(turns or Turns(None, rollout, ""))
    log.wrap(trainer)
    begin, end = log.callbacks(seer.sync if seer else None, seer)
    trainer.callback_handler.callbacks.insert(0, begin)
    trainer.add_callback(end)
    return trainer, seer, log


def feedback_env(tokenizer):
    """The feedback environment on the trainer's prompts (Seer gets them as token ids)."""
    def env(turn):
        question = tokenizer.decode(turn.prompt.prompt_token_ids or [])
        return arithmetic.feedback_reply(turn.text, arithmetic.answer_of(question))
    return env


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for r in rows]


def evaluate_seer(client, tokenizer, rows: list[dict], max_tokens: int) -> tuple[float, int]:
    """Held-out greedy accuracy from one greedy rollout through Seer; and its weights version."""
    from seer.protocol import SamplingParams

    result = client.rollout([{"prompt_token_ids": p} for p in prompt_ids(tokenizer, rows)], 1,
                            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    hits = [arithmetic.correct(g.samples[0].text, r["answer"]) for g, r in zip(result.groups, rows, strict=True)]
    return sum(hits) / len(hits), result.weights_version


def evaluate_hf(model, tokenizer, rows: list[dict], max_tokens: int, batch: int = 32) -> float:
    """Held-out greedy accuracy with ``model.generate`` (the ``--rollout trl`` run)."""
    import torch

    tokenizer.padding_side = "left"
    hits = []
    model.eval()
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        texts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
                 for r in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        for r, seq in zip(chunk, out[:, enc["input_ids"].shape[1]:], strict=True):
            hits.append(arithmetic.correct(tokenizer.decode(seq, skip_special_tokens=True), r["answer"]))
    model.train()
    return sum(hits) / len(hits)


def start_daemon(run_dir: Path, engines: int) -> None:
    config = run_dir.parent / "seer-trl.toml"
    config.write_text(DAEMON_CONFIG.format(engines=engines))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    # Owned by this process: killed by any signal (the OOM killer too), it takes the daemon,
    # its engines and its KV pool with it instead of leaving them running.
    subprocess.run([sys.executable, "-m", "seer.cli.main", "start", "--config", str(config), "--run-dir",
                    str(run_dir), "--owner-pid", str(os.getpid())], check=True, timeout=900, env=env)


def stop_daemon(run_dir: Path) -> None:
    subprocess.run([sys.executable, "-m", "seer.cli.main", "stop", "--run-dir", str(run_dir)], timeout=300)


def run(a: argparse.Namespace, run_dir: str | None) -> dict:
    from seer.client import SeerClient

    turns = Turns(a.turns, a.rollout, "trl" if a.rollout == "seer" else "seer")
    trainer, seer, log = build_trainer(rollout=a.rollout, steps=a.steps, group_size=a.group_size,
                                       prompts_per_step=a.prompts_per_step,
                                       max_completion_length=a.max_completion_length, seed=a.seed,
                                       address=a.address, run_dir=run_dir, learning_rate=a.learning_rate,
                                       temperature=a.temperature, turns=turns, env=a.env)
    held_out = arithmetic.load(arithmetic.EVAL_FILE)
    tokenizer = trainer.processing_class
    client = SeerClient(a.address, run_dir=run_dir, timeout_s=300) if a.rollout == "seer" else None
    final: dict = {"rollout": a.rollout, "num_eval": len(held_out)}
    try:
        with turns.hold():  # the daemon serves the checkpoint the trainer starts from
            final["eval_before"] = evaluate_seer(client, tokenizer, held_out, a.max_completion_length)[0] \
                if client else evaluate_hf(trainer.model, tokenizer, held_out, a.max_completion_length)
        t0 = time.perf_counter()
        trainer.train()
        final["train_s"] = time.perf_counter() - t0
        with turns.hold():
            if client:
                final["eval_after"], final["eval_weights_version"] = evaluate_seer(
                    client, tokenizer, held_out, a.max_completion_length)
            else:
                final["eval_after"] = evaluate_hf(trainer.model, tokenizer, held_out, a.max_completion_length)
    finally:
        turns.finish()
        if client:
            client.close()
        if seer:
            seer.close()
    rewards = {h["step"]: h["reward"] for h in trainer.state.log_history if "reward" in h}
    for row in log.steps:
        row["reward_mean"] = rewards.get(row["step"], float("nan"))
    if seer and seer.sync and seer.sync.syncs:
        first = seer.sync.syncs[0]
        final["initial_sync_s"] = first.write_s + first.update_s
    syncs = [r["weight_sync_s"] for r in log.steps if r["weights_version"] is not None]
    final["median_weight_sync_s"] = statistics.median(syncs) if syncs else None
    return {"steps": log.steps, "final": final}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollout", choices=["seer", "trl"], default="seer")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--group-size", type=int, default=DEFAULTS["group_size"])
    p.add_argument("--prompts-per-step", type=int, default=DEFAULTS["prompts_per_step"])
    p.add_argument("--max-completion-length", type=int, default=DEFAULTS["max_completion_length"])
    p.add_argument("--learning-rate", type=float, default=DEFAULTS["learning_rate"])
    p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None)
    p.add_argument("--run-dir", default=None, help="run dir of a running daemon (default ~/.seer/run)")
    p.add_argument("--start-daemon", action="store_true", help="start a daemon with --engines vLLM engines for "
                                                                "this run and stop it after (it also stops if this "
                                                                "process is killed)")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--log", default=None, help="JSONL: one object per step, then the final evaluation")
    p.add_argument("--turns", default=None, help="a folder shared with another run: take turns step by step")
    p.add_argument("--env", choices=["feedback"], default=None,
                   help="multi-turn trajectories: the feedback environment (wrong answers are told so and may "
                        "try again, up to 3 turns), rewarded by the environment")
    a = p.parse_args()

    run_dir, own_dir = a.run_dir, None
    if a.rollout == "seer" and a.start_daemon:
        own_dir = Path(tempfile.mkdtemp(prefix="seer-trl-daemon-"))
        run_dir = str(own_dir / "run")
        start_daemon(Path(run_dir), a.engines)
    try:
        result = run(a, run_dir)
    finally:
        if own_dir is not None:
            stop_daemon(Path(run_dir))
    steps, final = result["steps"], result["final"]
    print(f"{'step':>4} {'reward':>6} {'step s':>7} {'rollout s':>9} {'share':>6} {'sync s':>7} {'version':>7}")
    for r in steps:
        print(f"{r['step']:>4} {r['reward_mean']:>6.3f} {r['step_s']:>7.2f} {r['rollout_s']:>9.2f} "
              f"{r['rollout_s'] / r['step_s']:>6.1%} {r['weight_sync_s']:>7.3f} {str(r['weights_version']):>7}")
    first, last = steps[:5], steps[-5:]
    print(f"rollout={a.rollout}: reward first 5 steps {statistics.mean(r['reward_mean'] for r in first):.3f}, "
          f"last 5 {statistics.mean(r['reward_mean'] for r in last):.3f}; held-out greedy accuracy "
          f"{final['eval_before']:.3f} -> {final['eval_after']:.3f}; median weight sync "
          f"{final['median_weight_sync_s']}; training {final['train_s']:.0f} s")
    if a.log:
        with open(a.log, "w") as f:
            for r in steps:
                f.write(json.dumps(r) + "\n")
            f.write(json.dumps(final) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
