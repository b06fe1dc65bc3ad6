"""``seerctl rollout``: read a JSONL prompt file, run one rollout, show progress, write
results, print a summary.

Prompt rows: ``{"id", "prompt"}``, ``{"id", "messages"}`` or ``{"id",
"prompt_token_ids"}``; any other keys (e.g. a reference ``answer``) are carried into
the output row under ``meta`` untouched. Output: one JSON line per group in prompt
order: ``{"id", "group_index", "meta", "samples": [...]}``.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from seer.auth import ClientKeys
from seer.client import AsyncSeerClient, RolloutResult
from seer.protocol import Prompt, SamplingParams

PROMPT_KEYS = ("id", "prompt", "messages", "prompt_token_ids")


class PromptFileError(ValueError):
    pass


def read_prompts(path: Path) -> tuple[list[Prompt], list[dict]]:
    prompts: list[Prompt] = []
    metas: list[dict] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise PromptFileError(f"{path}: no such prompt file") from None
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
            core["id"] = str(core["id"])
        try:
            prompts.append(msgspec.convert(core, Prompt))
        except msgspec.ValidationError as exc:
            raise PromptFileError(f"{path}:{lineno}: {exc}") from None
        metas.append({k: v for k, v in row.items() if k not in PROMPT_KEYS})
    if not prompts:
        raise PromptFileError(f"{path}: the file has no prompts")
    return prompts, metas


async def run_rollout(address: str, prompts: list[Prompt], group_size: int, sampling: SamplingParams,
                      policy: str | None, console: Console, timeout_s: float = 120.0,
                      keys: ClientKeys | None = None) -> RolloutResult:
    async with AsyncSeerClient(address, timeout_s=timeout_s, keys=keys) as client:
        stream = client.stream_rollout(prompts, group_size, sampling, policy=policy)
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
        return RolloutResult(rollout_id=stream.rollout_id, groups=groups, stats=stream.stats,
                             weights_version=stream.weights_version)


def write_results(path: Path, result: RolloutResult, metas: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for group in result.groups:
            row = {"id": group.prompt_id, "group_index": group.group_index, "meta": metas[group.group_index],
                   "weights_version": result.weights_version,
                   "samples": msgspec.to_builtins(group.samples)}
            f.write(json.dumps(row) + "\n")


def summary_table(result: RolloutResult) -> Table:
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
    for name, value in rows:
        table.add_row(name, value)
    return table


def rollout_main(address: str, prompts_file: Path, group_size: int, sampling: SamplingParams, policy: str | None,
                 out: Path, console: Console, keys: ClientKeys | None = None,
                 timeout_s: float = 120.0) -> RolloutResult:
    prompts, metas = read_prompts(prompts_file)
    import uvloop

    result = uvloop.run(run_rollout(address, prompts, group_size, sampling, policy, console, timeout_s, keys))
    write_results(out, result, metas)
    console.print(summary_table(result))
    console.print(f"results: {out}")
    return result


__all__ = ["PromptFileError", "read_prompts", "rollout_main", "summary_table", "write_results", "asyncio"]
