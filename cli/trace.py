"""``seerctl trace RUN_DIR``: what happened in a rollout, read from the run dir's logs.

Owns the command's output: a rich summary (chunks, migrations, bytes moved,
preemptions, one row per engine), ``--json`` for scripts, ``--plot`` for a timeline
PNG. The reconstruction itself is ``seer.controlplane.trace``; the drawing is
``seer.cli.plots``. Works on a live daemon's run dir too (it only reads the log).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from seer.controlplane.trace import (
    RolloutRecord,
    Trace,
    TraceError,
    TraceSummary,
    build_trace,
    read_log,
    select_rollouts,
    summarize,
)


def _known(value: object, fmt: str = "{}") -> str:
    return "unknown" if value is None else fmt.format(value)


def _bytes(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "unknown"
    return f"{num_bytes / 2**20:,.1f} MiB ({num_bytes:,} B)"


def _rollout_line(r: RolloutRecord) -> str:
    parts = [f"rollout {r.rollout_id} ({r.policy or 'policy unknown'}): {r.outcome}"]
    if r.num_samples is not None:
        parts.append(f"{r.num_samples} samples")
    elif r.num_samples_requested is not None:
        parts.append(f"{r.num_samples_requested} samples requested")
    if r.num_output_tokens is not None:
        parts.append(f"{r.num_output_tokens} output tokens")
    if r.wall_time_s is not None:
        parts.append(f"wall {r.wall_time_s:.2f} s")
    if r.tail_time_s is not None:
        parts.append(f"tail {r.tail_time_s:.2f} s")
    return ", ".join(parts)


def summary_tables(trace: Trace, summary: TraceSummary) -> list[Table | str]:
    """What the command prints, in order (rich renderables and lines)."""
    out: list[Table | str] = [_rollout_line(trace.rollouts[i]) for i in summary.rollout_ids]
    chunks = ", ".join(f"{n} {outcome}" for outcome, n in sorted(summary.num_chunks_by_outcome.items()))
    totals = Table("", "", title=f"window {summary.duration_s:.2f} s", show_header=False)
    totals.add_row("chunks", f"{summary.num_chunks} ({chunks or 'none'})")
    totals.add_row("requests", str(summary.num_requests))
    totals.add_row("samples", _known(summary.num_samples))
    totals.add_row("output tokens (finished chunks)", str(summary.num_output_tokens))
    s = summary
    totals.add_row("migrations", f"{s.num_migrations} (KV pool {s.num_pool_migrations}, "
                   f"re-prefill {s.num_reprefill_migrations}, not logged {s.num_unknown_migrations})")
    totals.add_row("KV bytes moved", _bytes(summary.num_bytes_moved))
    totals.add_row("KV load time, total", _known(summary.load_ms_total, "{:,.1f} ms"))
    totals.add_row("prefix tokens re-prefilled", _known(summary.num_reprefill_tokens))
    totals.add_row("KV transfers between hosts", f"{s.num_kv_transfers} ({_bytes(s.kv_transfer_bytes)}, "
                   f"{s.kv_transfer_ms_total:,.1f} ms; failed or timed out {s.num_kv_transfers_failed})")
    totals.add_row("preemptions", _known(summary.num_preemptions))
    out.append(totals)
    engines = Table(title="per engine")
    for column in ("engine", "chunks", "tokens", "busy s", "idle %", "migrations in"):
        engines.add_column(column, justify="right")
    for e in summary.engines:
        engines.add_row(str(e.engine_id), str(e.num_chunks), str(e.num_tokens), f"{e.busy_s:.2f}",
                        _known(e.idle_pct, "{:.1f}"), str(e.num_migrations_in))
    out.append(engines)
    if trace.num_bad_lines:
        out.append(f"{trace.num_bad_lines} log line(s) were not JSON events and were skipped")
    return out


def trace_command(args: argparse.Namespace) -> int:
    # Wide enough that the summary rows never wrap (as `seerctl bench` does for its table).
    console, err = Console(width=max(100, Console().width)), Console(stderr=True)
    if args.plot:
        from seer.cli.plots import plot_unavailable

        if problem := plot_unavailable():
            err.print(f"seerctl: {problem}", markup=False, highlight=False)
            return 1
    try:
        events, num_bad = read_log(Path(args.run_dir))
        trace = build_trace(events, num_bad)
        rollout_ids = select_rollouts(trace, args.rollout)
    except TraceError as exc:
        err.print(f"seerctl: {exc}", markup=False, highlight=False)
        return 1
    summary = summarize(trace, rollout_ids)
    if args.json:
        payload = {"summary": msgspec.to_builtins(summary),
                   "rollouts": [msgspec.to_builtins(trace.rollouts[i]) for i in rollout_ids],
                   "num_bad_lines": trace.num_bad_lines}
        print(json.dumps(payload, indent=2))
    else:
        for item in summary_tables(trace, summary):
            if isinstance(item, str):
                console.print(item, markup=False, highlight=False)
            else:
                console.print(item)
        others = [i for i in trace.rollouts if i not in rollout_ids]
        if others:
            console.print(f"{len(others)} other rollout(s) in this log; pick one with --rollout ID "
                          f"(a prefix is enough) or --rollout all", markup=False, highlight=False)
    if args.plot:
        from seer.cli.plots import save_trace_plot

        chosen = set(rollout_ids)
        save_trace_plot([s for s in trace.spans if s.rollout_id in chosen], summary, Path(args.plot))
        # With --json, stdout stays pure JSON.
        (err if args.json else console).print(f"timeline written to {args.plot}", markup=False,
                                              highlight=False)
    return 0
