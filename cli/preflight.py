"""What ``seerctl rollout`` checks before any process starts.

Owns the checks that need no engine, each refusing with one line that names the problem
and the fix (``InputError``, ``SeerInputError`` or ``ConfigError``: exit code 2):

- the request against the daemon's limits and its policy's needs: the daemon's own
  ``intake.check_request`` (prompt count, group size, sampling, policy, true lengths), so
  the refusal is the one the daemon would give; the oracle policies need ``--true-lengths``;
- its size: the client's ``check_request_size`` (the same message as ``SeerClient``);
- the ``--true-lengths`` file (``read_true_lengths``) and the output path (``check_out_path``);
- for an embedded daemon, the config (model folder, context length, socket paths:
  ``check_embedded_config``) and every prompt's length against ``model.max_model_len``
  (the daemon's ``intake.check_prompt``, with the daemon's tokenizer; a real model's
  tokenizer is loaded only when a prompt's bytes alone cannot settle it).

The limits come from the config for an embedded daemon and from ``daemon.json`` for one
that runs on the run dir (``DaemonLimits``); a daemon given by ``--address`` checks for
itself. Nothing here starts a process or creates a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec

from seer.client import check_request_size
from seer.config import ConfigError, SeerConfig
from seer.cli.rollout import InputError
from seer.protocol import Prompt, RolloutRequest, SamplingParams

# Tokens a tokenizer may add to a text beyond one per byte (BOS/EOS, a leading-space piece):
# a prompt of N bytes has at most N + TOKEN_SLACK tokens with any tokenizer whose tokens each
# cover at least one byte (byte-level BPE, SentencePiece with byte fallback).
TOKEN_SLACK = 8

# The ids the client sends are uuid4 hex strings: requests measured here have their size.
_ID = "0" * 32


@dataclass(frozen=True)
class DaemonLimits:
    """What a daemon accepts (``server.*`` limits) and the policy it runs by default."""

    max_request_bytes: int
    max_group_size: int
    max_prompts: int
    policy: str

    @classmethod
    def of_config(cls, config: SeerConfig) -> DaemonLimits:
        s = config.server
        return cls(s.max_request_bytes, s.max_group_size, s.max_prompts_per_rollout, config.scheduler.policy)

    @classmethod
    def of_info(cls, info: dict) -> DaemonLimits | None:
        """From a running daemon's ``daemon.json`` (``daemon.info_fields``); None if it lacks them."""
        try:
            return cls(int(info["max_request_bytes"]), int(info["max_group_size"]),
                       int(info["max_prompts_per_rollout"]), str(info["policy"]))
        except (KeyError, TypeError, ValueError):
            return None


def oracle_policies() -> frozenset[str]:
    from seer.controlplane.intake import ORACLE_POLICIES

    return ORACLE_POLICIES


def check_policy_needs(policy: str | None, true_lengths: list[list[int]] | None, prompts_file: str) -> None:
    """An oracle policy needs ``--true-lengths``; ``--true-lengths`` needs an oracle policy.
    ``policy``: the one the rollout will run (None: a remote daemon's default, unknown)."""
    oracles = oracle_policies()
    if policy in oracles and true_lengths is None:
        raise InputError(
            f"--policy {policy} orders samples by their true output lengths: give --true-lengths FILE (the --out "
            "file of benchmarks/rollout_policies.py, or the results of an earlier `seerctl rollout` of "
            f"{prompts_file} with the same --group-size, --max-tokens and --seed), or use a policy that learns "
            "lengths online, such as --policy context")
    if true_lengths is not None and policy is not None and policy not in oracles:
        raise InputError(f"--true-lengths is the input of the oracle policies ({', '.join(sorted(oracles))}) and "
                         f"policy {policy!r} does not use it; add --policy oracle or drop --true-lengths")


# Where each of the daemon's refusals comes from on the command line.
_FLAG_OF_CODE = {
    "too_many_prompts": "--prompts", "empty_rollout": "--prompts", "bad_group_size": "--group-size",
    "bad_sampling": "--max-tokens", "unknown_policy": "--policy", "bad_true_lengths": "--true-lengths",
    "needs_true_lengths": "--policy",
}


def rollout_request(prompts: list[Prompt], group_size: int, sampling: SamplingParams, policy: str | None,
                    true_lengths: list[list[int]] | None) -> RolloutRequest:
    """The request as the client will send it (same fields, ids of the same length)."""
    return RolloutRequest(call_id=_ID, rollout_id=_ID, prompts=prompts, group_size=group_size, sampling=sampling,
                          policy=policy, true_lengths=true_lengths)


def check_request(request: RolloutRequest, limits: DaemonLimits) -> None:
    """The daemon's request-wide checks against ``limits``, then the request's size."""
    from seer.controlplane.intake import Limits, RequestRejected
    from seer.controlplane.intake import check_request as daemon_check

    policy = request.policy or limits.policy
    # No stop token ids and speculative=True come from the CLI: vocabulary and drafting never refuse.
    wide = Limits(max_group_size=limits.max_group_size, max_prompts=limits.max_prompts, max_model_len=2**62,
                  vocab_size=2**62)
    try:
        daemon_check(request, wide, policy)
    except RequestRejected as exc:
        raise InputError(f"{_FLAG_OF_CODE.get(exc.code, 'rollout')}: {exc}") from None
    check_size(request, limits.max_request_bytes)


def check_size(request: RolloutRequest, max_request_bytes: int) -> None:
    """The client's own size check (``SeerInputError``, the same message as ``SeerClient``)."""
    check_request_size(len(msgspec.msgpack.encode(request)), max_request_bytes)


def check_embedded_config(config: SeerConfig, run_dir: Path, cache_dir: Path) -> str:
    """An embedded daemon's config problems, before it is spawned; returns the model path.
    The model folder (prepared, has config.json), ``model.max_model_len`` against the model,
    and the run dir's socket paths (``cli/daemon.py`` checks them again in the daemon)."""
    from seer.cli.daemon import DaemonError, addresses, resolve_model_path

    try:
        addresses(config, run_dir)
        return resolve_model_path(config, cache_dir)
    except DaemonError as exc:
        raise ConfigError(str(exc)) from None


def check_prompt_lengths(prompts: list[Prompt], sampling: SamplingParams, config: SeerConfig, model_path: str,
                         prompts_file: str) -> None:
    """Every prompt through the daemon's ``check_prompt`` with the daemon's tokenizer: fits
    ``model.max_model_len`` with ``max_tokens``, token ids in the vocabulary, not empty. With
    a real model, text prompts short enough to fit whatever the tokenizer does are passed
    without loading it (transformers takes seconds to import)."""
    from seer.controlplane.intake import Limits, RequestRejected, check_prompt
    from seer.controlplane.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

    max_model_len = config.model.max_model_len
    if config.engines.backend == "sim":
        tokenizer: Tokenizer = ByteTokenizer()
        unsettled = list(range(len(prompts)))
    else:
        unsettled = [i for i, p in enumerate(prompts) if not _fits_by_bytes(p, sampling.max_tokens, max_model_len)]
        if not unsettled:
            return
        try:
            tokenizer = HFTokenizer(model_path)
        except RuntimeError as exc:
            raise ConfigError(str(exc)) from None
    limits = Limits(max_group_size=config.server.max_group_size, max_prompts=config.server.max_prompts_per_rollout,
                    max_model_len=max_model_len, vocab_size=tokenizer.vocab_size)
    for index in unsettled:
        try:
            check_prompt(prompts[index], index, tokenizer, limits, sampling.max_tokens)
        except RequestRejected as exc:
            raise InputError(f"{prompts_file}: {exc}") from None


def _fits_by_bytes(prompt: Prompt, max_tokens: int, max_model_len: int) -> bool:
    """A plain text prompt so short that no tokenizer can make it too long (``TOKEN_SLACK``)."""
    if prompt.prompt is None or prompt.messages is not None or prompt.prompt_token_ids is not None:
        return False
    num_bytes = len(prompt.prompt.encode())
    return 0 < num_bytes and num_bytes + TOKEN_SLACK + max_tokens <= max_model_len


def check_out_path(out: Path) -> None:
    """The results file can be written: not a folder, and its folder exists and is writable
    or can be created (the nearest existing folder above it is probed with a temporary file,
    which also catches read-only file systems and /proc, where root passes permission checks)."""
    if out.is_dir():
        raise InputError(f"--out {out}: is a directory; give a file path for the results JSONL")
    folder = out.parent
    while not folder.exists():
        if folder.is_symlink():  # a dangling link: not a folder that can be created
            break
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"--out {out}: {folder} is not a folder; give a path in a writable folder")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".seer-out-check-")
    except OSError as exc:
        where = "its folder" if folder == out.parent else f"{folder}, where its folder would be created"
        raise InputError(f"--out {out}: cannot write in {where} ({exc.strerror}); give a path in a writable "
                         "folder") from None
    os.close(fd)
    os.unlink(probe)
    if out.exists() and not os.access(out, os.W_OK):
        raise InputError(f"--out {out}: the file exists and is not writable; give another path or fix its permissions")


def read_true_lengths(path: Path) -> list[list[int]]:
    """``[prompt][sample]`` output lengths from the ``--out`` file of
    ``benchmarks/rollout_policies.py`` (``{"runs": [{"lengths": [[...], ...]}, ...]}``, its
    first run, as that benchmark reads it) or from the results JSONL of an earlier ``seerctl
    rollout`` (one row per group: the lengths of its samples' ``token_ids``)."""
    where = f"--true-lengths {path}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{where}: is a directory, not a lengths file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{where}: cannot read it ({exc}); give the --out file of benchmarks/rollout_policies.py "
                         "or the results of an earlier `seerctl rollout`") from None
    formats = ("expected the --out file of benchmarks/rollout_policies.py ({\"runs\": [{\"lengths\": [[...]]}]}) "
               "or the results JSONL of an earlier `seerctl rollout`")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    try:
        if isinstance(data, dict) and "runs" in data:
            lengths = data["runs"][0]["lengths"]
        else:
            lengths = _lengths_of_results(text)
        return msgspec.convert(lengths, list[list[int]], strict=True)
    except (KeyError, IndexError, TypeError, ValueError, msgspec.ValidationError) as exc:
        raise InputError(f"{where}: not a lengths file ({type(exc).__name__}: {exc}); {formats}") from None


def _lengths_of_results(text: str) -> list[list[int]]:
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not rows:
        raise ValueError("the file is empty")
    by_group = sorted(rows, key=lambda row: row["group_index"])
    return [[len(s["token_ids"]) for s in sorted(row["samples"], key=lambda s: s["sample_index"])]
            for row in by_group]
