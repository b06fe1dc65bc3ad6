"""``seerctl rollout``: read a JSONL prompt file, run one rollout, show progress, write
results, print a summary.

Prompt rows: ``{"id", "prompt"}``, ``{"id", "messages"}`` or ``{"id",
"prompt_token_ids"}``; any other keys (e.g. a reference ``answer``) are carried into
the output row under ``meta`` untouched. ``id`` is optional; when present it must be a
string or an integer (used as its decimal string): ``null``, booleans, floats, lists
and objects are refused, since turning them into text (``"None"``) would silently
give several prompts the same meaningless id. Without ``id`` a prompt is known by its
position (0-based, blank lines not counted). Output: one JSON line per group in prompt
order: ``{"id", "group_index", "meta", "samples": [...]}``.

Everything is checked before anything starts (``read_prompts``, ``check_inputs`` and
``cli/preflight.py``): a bad file, flag or config never costs an engine start.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from seer.auth import ClientKeys
from seer.client import AsyncSeerClient, RolloutResult, SeerError, SeerInputError, check_encodable
from seer.config import SchedulerConfig
from seer.protocol import EngineCapabilities, Prompt, SamplingParams
from seer.sim.estimate import BaselineEstimate, against_baseline

PROMPT_KEYS = ("id", "prompt", "messages", "prompt_token_ids")


class InputError(ValueError):
    """A bad flag or input file of ``seerctl rollout`` (exit code 2, one line)."""


class PromptFileError(InputError):
    pass


def read_prompts(path: Path) -> tuple[list[Prompt], list[dict]]:
    """Parse and check every row (JSON, keys, types, id, and that it can be sent: no
    integer beyond 64 bits, no lone surrogate); PromptFileError names file and line."""
    prompts: list[Prompt] = []
    metas: list[dict] = []
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except FileNotFoundError:
        raise PromptFileError(f"{path}: no such prompt file") from None
    except IsADirectoryError:
        raise PromptFileError(f"{path}: is a directory, not a JSONL prompt file") from None
    except PermissionError:
        raise PromptFileError(f"{path}: not readable (permission denied)") from None
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{path}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                              "save the file as UTF-8") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise PromptFileError(f"{path}:{lineno}: each line must be a JSON object")
        core = {k: row[k] for k in PROMPT_KEYS if k in row}
        if "id" in core:
            core["id"] = _prompt_id(core["id"], f"{path}:{lineno}")
        try:
            prompt = msgspec.convert(core, Prompt)
            check_encodable(prompt, "prompt")
        except msgspec.ValidationError as exc:
            raise PromptFileError(f"{path}:{lineno}: {exc}") from None
        except SeerInputError as exc:
            raise PromptFileError(f"{path}:{lineno}: {exc}") from None
        prompts.append(prompt)
        metas.append({k: v for k, v in row.items() if k not in PROMPT_KEYS})
    if not prompts:
        raise PromptFileError(f"{path}: the file has no prompts")
    return prompts, metas


def _prompt_id(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    shown = "null" if value is None else json.dumps(value)[:40]
    raise PromptFileError(f"{where}: \"id\" is {shown}; an id must be a string or an integer "
                          "(leave the key out to identify the prompt by its position)")


def check_inputs(group_size: int, sampling: SamplingParams, policy: str | None, timeout_s: float) -> None:
    """Check the rollout's flags as the daemon would, before anything is started;
    PromptFileError-style one-line messages (raised as InputError). The checks against a
    daemon's limits, the policy's needs and the files are ``cli/preflight.py``'s."""
    if group_size < 1:
        raise InputError(f"--group-size {group_size}: must be at least 1")
    try:
        msgspec.convert(msgspec.to_builtins(sampling), SamplingParams)
        check_encodable(sampling, "sampling")
    except msgspec.ValidationError as exc:
        field = str(exc).rsplit("$.", 1)[-1].replace("_", "-") if "$." in str(exc) else ""
        raise InputError(f"--{field or 'sampling'}: {exc}") from None
    except SeerInputError as exc:
        raise InputError(str(exc)) from None
    if policy is not None:
        from seer.controlplane.policies import POLICIES

        if policy not in POLICIES:
            raise InputError(f"--policy {policy!r}: unknown; available: {', '.join(sorted(POLICIES))}")
    if not timeout_s > 0:
        raise InputError(f"--timeout {timeout_s}: must be a positive number of seconds")


async def run_rollout(address: str, prompts: list[Prompt], group_size: int, sampling: SamplingParams,
                      policy: str | None, console: Console, timeout_s: float = 120.0,
                      keys: ClientKeys | None = None, with_engines: bool = False,
                      true_lengths: list[list[int]] | None = None) -> tuple[RolloutResult, list[EngineCapabilities]]:
    """Run the rollout with a progress bar. Returns the result and, with ``with_engines``,
    the capabilities of the daemon's engines read after the rollout (for the estimate;
    empty if the status call fails: the samples are what counts)."""
    async with AsyncSeerClient(address, timeout_s=timeout_s, keys=keys) as client:
        stream = client.stream_rollout(prompts, group_size, sampling, policy=policy, true_lengths=true_lengths)
        groups = []
        tokens = 0
        t0 = time.monotonic()
        columns = [TextColumn("[bold]rollout"), BarColumn(), MofNCompleteColumn(), TextColumn("groups"),
                   TextColumn("{task.fields[tps]:>8.1f} tok/s"), TimeElapsedColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("rollout", total=len(prompts), tps=0.0)
            async for group in stream:
                groups.append(group)
                tokens += sum(len(s.token_ids) for s in group.samples)
                progress.update(task, advance=1, tps=tokens / max(1e-9, time.monotonic() - t0))
        groups.sort(key=lambda g: g.group_index)
        assert stream.stats is not None
        result = RolloutResult(rollout_id=stream.rollout_id, groups=groups, stats=stream.stats,
                               weights_version=stream.weights_version)
        engines: list[EngineCapabilities] = []
        if with_engines:
            try:
                engines = [e.capabilities for e in (await client.status()).engines if e.capabilities is not None]
            except (SeerError, TimeoutError, OSError):
                pass
        return result, engines


class ResultsNotWritten(SeerError):
    """``--out`` could not be written after the rollout (it was checked before): the results
    went to another file, which the message names (exit code 1)."""


def write_results(path: Path, result: RolloutResult, metas: list[dict]) -> Path:
    """Write the results to ``path``; if that fails (the folder vanished, the disk filled up
    since the check), to a file in the temporary folder, then raise ``ResultsNotWritten``
    naming both: the samples of a finished rollout are never lost. Returns the path written."""
    rows = [json.dumps({"id": group.prompt_id, "group_index": group.group_index, "meta": metas[group.group_index],
                        "weights_version": result.weights_version,
                        "samples": msgspec.to_builtins(group.samples)}) + "\n" for group in result.groups]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.writelines(rows)
        return path
    except OSError as exc:
        fd, fallback = tempfile.mkstemp(prefix=f"seer-rollout-{result.rollout_id[:8]}-", suffix=".jsonl")
        with os.fdopen(fd, "w") as f:
            f.writelines(rows)
        raise ResultsNotWritten(f"could not write the results to {path} ({exc.strerror or exc}); they are in "
                                f"{fallback}") from None


def summary_table(result: RolloutResult, estimate: BaselineEstimate | None = None) -> Table:
    s = result.stats
    table = Table(title=f"rollout {result.rollout_id[:8]} — policy {s.policy}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("groups", f"{s.num_groups}"),
        ("samples", f"{s.num_samples}"),
        ("output tokens", f"{s.num_output_tokens}"),
        ("wall time", f"{s.wall_time_s:.2f} s"),
        ("throughput", f"{s.throughput_tokens_per_s:.1f} tok/s"),
        ("tail time (90 % -> 100 % of samples)", f"{s.tail_time_s:.2f} s"),
        ("preemptions", f"{s.num_preemptions}"),
        ("chunks", f"{s.num_chunks}"),
    ]
    rows += [(f"engine {e} output tokens", f"{n}") for e, n in s.per_engine_output_tokens.items()]
    if estimate is not None:
        rows.append((f"vs {estimate.baseline} (estimate: simulator replaying these lengths, "
                     f"{estimate.cost_model} cost model)", f"{estimate.ratio:.2f}x"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def rollout_main(address: str, prompts_file: Path | tuple[list[Prompt], list[dict]], group_size: int,
                 sampling: SamplingParams, policy: str | None, out: Path, console: Console,
                 keys: ClientKeys | None = None, timeout_s: float = 120.0,
                 scheduler: SchedulerConfig | None = None,
                 true_lengths: list[list[int]] | None = None) -> RolloutResult:
    """``prompts_file``: a JSONL path, or what ``read_prompts`` returned for it.
    ``scheduler``: the scheduler settings to replay the rollout with for the summary's
    baseline estimate (``seer.sim.estimate``); None: no estimate. ``true_lengths``: the
    oracle policies' input (``--true-lengths``)."""
    prompts, metas = read_prompts(prompts_file) if isinstance(prompts_file, Path) else prompts_file
    import uvloop

    result, engines = uvloop.run(run_rollout(address, prompts, group_size, sampling, policy, console, timeout_s,
                                             keys, with_engines=scheduler is not None, true_lengths=true_lengths))
    try:
        write_results(out, result, metas)
    finally:  # the summary also when the results went elsewhere (ResultsNotWritten)
        estimate = None
        if scheduler is not None and engines:
            estimate = against_baseline(result, num_engines=len(engines), max_tokens=sampling.max_tokens,
                                        kv_capacity_tokens=min(e.kv_capacity_tokens for e in engines),
                                        scheduler=scheduler)
        console.print(summary_table(result, estimate))
    console.print(f"results: {out}")
    return result


__all__ = ["InputError", "PromptFileError", "ResultsNotWritten", "check_inputs", "read_prompts", "rollout_main",
           "summary_table", "write_results", "asyncio"]
