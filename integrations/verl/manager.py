"""Owns ``SeerAgentLoopManager``: veRL's agent-loop manager seam, generating with Seer.

veRL's trainer selects it with
``actor_rollout_ref.rollout.agent.agent_loop_manager_class=seer.integrations.verl.SeerAgentLoopManager``
and calls ``create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)`` once, then
``generate_sequences(gen_batch.repeat(rollout.n, interleave=True))`` every step (and for
validation with ``meta_info["validate"]``). One call is one Seer rollout with the whole batch
as groups of n; the result has the keys, shapes, padding and dtypes of veRL's own agent loop
(``batch.pad_outputs``). Every failure is raised here, in the trainer's process, as
``SeerRolloutError`` (daemon down, refused request) or ``VerlBatchError`` (the batch or the
config), with the fix in the message.

The Seer client runs on a thread of its own, so the manager works whether or not the
trainer's thread runs an event loop. torch, numpy and verl are imported inside methods.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Mapping
from typing import Any

from seer.client import ClientKeys, RolloutResult, SeerClient, SeerError, SeerServiceError, SeerTimeoutError

from .batch import ROLLOUT, VerlBatchError, pad_outputs, plan_groups, sampling_for
from .settings import CONFIG_PATH, SeerSettings, load_settings

MANAGER_PATH = "seer.integrations.verl.SeerAgentLoopManager"

# What to change in the trainer's config when the daemon refuses a request with this code.
FIXES = {
    "bad_group_size": f"set {ROLLOUT}.n (and val_kwargs.n) to at most the daemon's server.max_group_size",
    "prompt_too_long": f"prompt + {ROLLOUT}.response_length must fit Seer's model.max_model_len: lower "
                       f"data.max_prompt_length / {ROLLOUT}.response_length or raise model.max_model_len in seer.toml",
    "bad_sampling": f"fix {ROLLOUT}.temperature / top_p / top_k (or val_kwargs)",
    "bad_token_ids": "the trainer's tokenizer is not the tokenizer of the model Seer serves: point "
                     "actor_rollout_ref.model.path and Seer's model.path at the same model",
    "too_many_prompts": "lower data.train_batch_size (or raise the daemon's server.max_prompts)",
    "frame_too_large": "lower data.train_batch_size or raise the daemon's server.max_request_bytes",
    "unknown_policy": f"set {CONFIG_PATH}.policy to group, request, divided or context",
    "rollout_running": "another client's rollout is running on this daemon; give each trainer its own daemon",
    "no_engines": "the daemon has no live engine: check `seerctl status` and the daemon log",
}


class SeerRolloutError(RuntimeError):
    """Seer could not generate the batch (daemon down or request refused); the message names the fix."""


def explain(error: SeerError, settings: SeerSettings, address: str) -> str:
    """One message for the trainer's log: what failed and what to change."""
    if isinstance(error, SeerTimeoutError):
        where = f"--run-dir {settings.run_dir}" if settings.run_dir else ""
        return (f"the Seer daemon at {address} did not answer ({error}); start it (`seerctl start {where}`) or set "
                f"{CONFIG_PATH}.address / .run_dir to the running daemon")
    if isinstance(error, SeerServiceError):
        fix = FIXES.get(error.code, "see the daemon log (`seerctl status`)")
        return f"Seer refused the rollout: {error}; {fix}"
    return f"Seer failed: {error}; {CONFIG_PATH} must name a running daemon (address or run_dir)"


def open_client(settings: SeerSettings) -> SeerClient:
    """A SeerClient for the configured daemon, or SeerRolloutError naming the setting to fix."""
    try:
        keys = ClientKeys.from_dir(settings.keys_dir) if settings.keys_dir else None
        return SeerClient(settings.address, run_dir=settings.run_dir, timeout_s=settings.timeout_s, keys=keys)
    except SeerError as exc:
        raise SeerRolloutError(f"cannot open a Seer client: {exc}; set {CONFIG_PATH}.address or .run_dir to the "
                               "running daemon (`seerctl start` writes daemon.json into its run dir)") from None


class SeerAgentLoopManager:
    """veRL's agent-loop manager interface (``create`` + ``generate_sequences``) over a Seer daemon."""

    def __init__(self, config: Any, llm_client: Any = None, teacher_client: Any = None,
                 reward_loop_worker_handles: list[Any] | None = None, *, tokenizer: Any = None) -> None:
        if teacher_client:
            raise VerlBatchError("distillation (a teacher client) is not supported by the Seer agent-loop manager; "
                                 f"drop distillation or {ROLLOUT}.agent.agent_loop_manager_class")
        self.config = config
        self.rollout_config = config.actor_rollout_ref.rollout
        engine_kwargs = self.rollout_config.get("checkpoint_engine", {}).get("engine_kwargs", {}) or {}
        self.settings = load_settings(engine_kwargs.get("seer"))
        self.reward_loop_worker_handles = reward_loop_worker_handles
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer(config)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id  # veRL's hf_tokenizer does the same
        self.chat_template_kwargs = dict(config.get("data", {}).get("apply_chat_template_kwargs", None) or {})
        # SeerClient runs its own event loop: give it a thread so a trainer thread with a
        # running loop (Ray's async actors) can call the manager too.
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="seer-client")
        self._client: SeerClient = self._on_thread(lambda: open_client(self.settings))
        self.address = self._client.address

    @classmethod
    def create(cls, config: Any, llm_client: Any = None, teacher_client: Any = None,
               reward_loop_worker_handles: list[Any] | None = None, **kwargs: Any) -> SeerAgentLoopManager:
        """veRL's constructor seam: builds the manager and checks the daemon answers (fail at start, not at step 1)."""
        manager = cls(config, llm_client, teacher_client, reward_loop_worker_handles, **kwargs)
        try:
            manager.check_daemon()
        except BaseException:
            manager.close()  # an unclosed client's ZeroMQ context would block the trainer when collected
            raise
        return manager

    # ------------------------------------------------------------------ daemon calls
    def _on_thread(self, call: Callable[[], Any]) -> Any:
        return self._thread.submit(call).result()

    def _call(self, call: Callable[[SeerClient], Any]) -> Any:
        try:
            return self._on_thread(lambda: call(self._client))
        except SeerError as exc:
            raise SeerRolloutError(explain(exc, self.settings, self.address)) from None

    def check_daemon(self) -> None:
        """SeerRolloutError unless the daemon answers and has at least one engine."""
        status = self._call(lambda c: c.status())
        if not status.engines:
            raise SeerRolloutError(f"the Seer daemon at {self.address} has no engines; {FIXES['no_engines']}")

    def close(self) -> None:
        self._on_thread(self._client.close)
        self._thread.shutdown()

    # ------------------------------------------------------------------ the seam
    def generate_sequences(self, prompts: Any) -> Any:
        """One Seer rollout for the batch; a DataProto in the input's row order (see the module doc)."""
        import numpy as np
        from verl.protocol import DataProto

        meta = prompts.meta_info or {}
        validate = bool(meta.get("validate", False))
        if "__do_sample__" in prompts.non_tensor_batch:
            raise VerlBatchError("the batch mixes sampled and greedy rows (__do_sample__, algorithm.adv_estimator="
                                 "remax); the Seer agent-loop manager does not support REMAX: use grpo/rloo")
        n, sampling = sampling_for(self.rollout_config, validate=validate, seed=self._seed(meta))
        plan = plan_groups(prompts.non_tensor_batch.get("uid"), n, validate=validate)
        raw_prompts = prompts.non_tensor_batch.get("raw_prompt")
        if raw_prompts is None:
            raise VerlBatchError("the batch has no non_tensor_batch['raw_prompt'] (the chat messages); set "
                                 "data.return_raw_chat=True")
        prompt_ids = [self._encode(raw_prompts[group[0]], group[0]) for group in plan.groups]
        started = time.perf_counter()
        result: RolloutResult = self._call(lambda c: c.rollout(
            [{"id": str(i), "prompt_token_ids": ids} for i, ids in enumerate(prompt_ids)], plan.group_size,
            sampling, policy=self.settings.policy, timeout_s=self.settings.rollout_timeout_s))
        wall_s = time.perf_counter() - started

        num_rows = len(prompts)
        rows_prompt: list[list[int]] = [[] for _ in range(num_rows)]
        rows_tokens: list[list[int]] = [[] for _ in range(num_rows)]
        rows_logprobs: list[list[float]] = [[] for _ in range(num_rows)]
        durations_s = [0.0] * num_rows
        for group in result.groups:
            rows = plan.groups[group.group_index]
            for sample in group.samples:
                row = rows[sample.sample_index]
                rows_prompt[row] = prompt_ids[group.group_index]
                rows_tokens[row] = sample.token_ids
                rows_logprobs[row] = sample.logprobs
                durations_s[row] = sample.finished_s
        tensors = pad_outputs(rows_prompt, rows_tokens, rows_logprobs, pad_token_id=self.pad_token_id,
                              prompt_length=int(self.rollout_config.prompt_length),
                              response_length=int(self.rollout_config.response_length))

        non_tensor: dict[str, Any] = {"__num_turns__": np.full(num_rows, 2, dtype=np.int32)}  # as veRL's single turn
        if self.reward_loop_worker_handles is None:
            non_tensor.update(prompts.non_tensor_batch)
        for key in ("turn_scores", "tool_rewards"):
            non_tensor[key] = _object_column([[] for _ in range(num_rows)])
        for key in ("min_global_steps", "max_global_steps", "extras"):
            non_tensor[key] = _object_column([None] * num_rows)
        output = DataProto.from_dict(tensors=tensors, non_tensors=non_tensor)
        if self.reward_loop_worker_handles:
            self._add_rewards(output, prompts)
        output.meta_info["timing"] = _timing(result, durations_s, wall_s)
        return output

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _load_tokenizer(config: Any) -> Any:
        """The actor's tokenizer, as veRL loads it (``model.tokenizer_path`` or ``model.path``)."""
        from transformers import AutoTokenizer

        model = config.actor_rollout_ref.model
        path = model.get("tokenizer_path", None) or model.path
        try:
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(model.get("trust_remote_code", False)))
        except (OSError, ValueError) as exc:
            raise VerlBatchError(f"cannot load the tokenizer of actor_rollout_ref.model.path={path!r} ({exc}); the "
                                 "manager tokenises prompts with the actor's tokenizer, which must be the tokenizer "
                                 "of the model Seer serves") from None

    def _seed(self, meta: Mapping[str, Any]) -> int | None:
        if self.settings.seed is None:
            return None
        return self.settings.seed + max(0, int(meta.get("global_steps", 0) or 0))

    def _encode(self, messages: Any, row: int) -> list[int]:
        try:
            encoded = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                         **self.chat_template_kwargs)
        except (TypeError, ValueError, KeyError) as exc:
            raise VerlBatchError(f"row {row}: raw_prompt is not a chat the tokenizer can render ({exc}); veRL's "
                                 "dataset gives a list of {'role', 'content'} messages") from None
        if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
            encoded = encoded["input_ids"]
        return [int(t) for t in encoded]

    def _add_rewards(self, output: Any, prompts: Any) -> None:
        """Scores from veRL's reward-loop workers (as veRL's agent loop streams them): ``rm_scores``
        on each response's last token, the extra infos as non-tensor columns."""
        import torch
        from verl.protocol import DataProto

        rows = DataProto(batch=output.batch, non_tensor_batch={**prompts.non_tensor_batch,
                                                               "__num_turns__": output.non_tensor_batch["__num_turns__"]})
        handles = self.reward_loop_worker_handles
        chunks = rows.chunk(min(len(handles), len(rows)))
        results: list[dict] = []
        for part in [_resolve(h.compute_score_batch.remote(chunk)) for h, chunk in zip(handles, chunks)]:
            results.extend(part)
        prompt_length = output.batch["prompts"].size(1)
        last = output.batch["attention_mask"][:, prompt_length:].sum(dim=1) - 1
        rm_scores = torch.zeros_like(output.batch["response_mask"], dtype=torch.float32)
        rm_scores[torch.arange(len(results)), last] = torch.tensor([r["reward_score"] for r in results],
                                                                  dtype=torch.float32)
        output.batch["rm_scores"] = rm_scores
        infos = [r.get("reward_extra_info", {}) or {} for r in results]
        keys = list(infos[0].keys()) if infos else []
        for key in keys:
            output.non_tensor_batch[key] = _object_column([info.get(key) for info in infos])
        output.meta_info["reward_extra_keys"] = keys


def _object_column(values: list[Any]) -> Any:
    import numpy as np

    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def _resolve(value: Any) -> list[dict]:
    """A Ray ObjectRef's value (veRL's reward workers are Ray actors), or the value itself."""
    if isinstance(value, list):
        return value
    import ray

    return ray.get(value)


def _timing(result: RolloutResult, durations_s: list[float], wall_s: float) -> dict[str, float]:
    """meta_info["timing"]: veRL's agent-loop keys where Seer has the same quantity, plus Seer's own."""
    stats = result.stats
    return {
        "agent_loop/generate_sequences/min": min(durations_s),
        "agent_loop/generate_sequences/max": max(durations_s),
        "agent_loop/generate_sequences/mean": sum(durations_s) / len(durations_s),
        "agent_loop/num_preempted/max": float(stats.num_preemptions),
        "seer/rollout_s": wall_s,
        "seer/tail_s": stats.tail_time_s,
        "seer/throughput_tokens_per_s": stats.throughput_tokens_per_s,
        "seer/num_output_tokens": float(stats.num_output_tokens),
        "seer/num_chunks": float(stats.num_chunks),
        "seer/weights_version": float(result.weights_version),
    }
