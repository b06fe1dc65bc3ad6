"""Rollout traces: every chunk of a rollout, rebuilt from the control plane's JSON log.

Owns the reading of ``controlplane.log`` (one JSON object per line, written by
``seer/logs.py``) back into chunk spans, migrations and rollout records, and the
summary ``seerctl trace`` prints: chunks, migrations (KV pool vs re-prefill), bytes
moved, preemptions, and per engine its chunks, tokens, busy time and idle share. It
also defines ``ChunkSpan``, the unit every timeline is drawn from — the simulator
records the same spans in virtual time. Pure: no sockets, no clock, no plotting.

Logs of older versions lack some events or fields (``chunk_migrated``, ``rollout_id``
on chunk events); a missing value is unknown (``None``), never zero. Migrations are
taken from ``chunk_migrated`` events; a chunk that ran on another engine than its
request's previous chunk with no such event is still counted, with an unknown mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

LOG_FILE = "controlplane.log"
ALL_ROLLOUTS = "all"


class TraceError(ValueError):
    """The log cannot be read or does not hold what was asked for."""


class ChunkSpan(msgspec.Struct):
    """One chunk on one engine, from dispatch to its end (seconds: epoch for real logs,
    virtual for the simulator)."""

    engine_id: int
    group_id: str
    request_id: str
    start_s: float
    end_s: float
    migrated: bool = False  # ran on another engine than the request's previous chunk
    task_id: int | None = None
    rollout_id: str | None = None
    num_tokens: int | None = None
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    outcome: str = "finished"  # finished | failed | lost | aborted | unfinished


class Migration(msgspec.Struct):
    request_id: str
    rollout_id: str | None
    time_s: float
    to_engine_id: int | None
    from_engine_id: int | None = None
    task_id: int | None = None
    mode: str | None = None  # "pool" | "reprefill"; None when only inferred from dispatches
    prefix_tokens: int | None = None
    kv_loaded_tokens: int | None = None
    num_bytes: int | None = None
    load_ms: float | None = None
    reprefill_tokens: int | None = None


class RolloutRecord(msgspec.Struct):
    rollout_id: str
    accepted_s: float | None = None
    ended_s: float | None = None
    outcome: str = "running"  # running | finished | aborted | failed
    policy: str | None = None
    num_samples_requested: int | None = None
    num_samples: int | None = None  # from rollout_finished
    num_output_tokens: int | None = None
    wall_time_s: float | None = None
    tail_time_s: float | None = None
    num_preemptions: int | None = None


class Trace(msgspec.Struct):
    spans: list[ChunkSpan]
    migrations: list[Migration]
    rollouts: dict[str, RolloutRecord]  # in the order they were accepted
    engine_alive: dict[int, list[tuple[float, float]]]  # engine -> (ready, lost or stopped) intervals
    num_bad_lines: int = 0
    transfers: list[dict[str, Any]] = []  # kv_transferred / kv_transfer_failed / kv_transfer_timed_out events


class EngineSummary(msgspec.Struct):
    engine_id: int
    num_chunks: int
    num_tokens: int
    busy_s: float  # union of the intervals with at least one chunk of the rollout in flight
    alive_s: float  # part of the rollout window the engine was up
    idle_pct: float | None  # 100 * (1 - busy / alive); None if the engine was never up in the window
    num_migrations_in: int


class TraceSummary(msgspec.Struct):
    rollout_ids: list[str]
    policies: list[str]
    start_s: float
    end_s: float
    duration_s: float
    num_requests: int
    num_chunks: int
    num_chunks_by_outcome: dict[str, int]
    num_output_tokens: int  # sum over finished chunks
    num_samples: int | None
    num_preemptions: int | None
    num_migrations: int
    num_pool_migrations: int
    num_reprefill_migrations: int
    num_unknown_migrations: int
    num_bytes_moved: int | None
    load_ms_total: float | None
    num_reprefill_tokens: int | None  # prefix tokens recomputed by engines a chunk migrated to
    engines: list[EngineSummary]
    # KV pulled between hosts' pools (kv_transferred) and pulls that failed or timed out.
    num_kv_transfers: int = 0
    num_kv_transfers_failed: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_ms_total: float = 0.0


def read_log(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Events of a run dir's ``controlplane.log`` (or of the given log file), and the
    number of lines that were not JSON objects (a crash can cut the last line)."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG_FILE
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}; pass a run dir holding {LOG_FILE} "
                         "(see `seerctl start --run-dir`) or the log file itself") from exc
    events, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            event = msgspec.json.decode(line)
        except msgspec.DecodeError:
            bad += 1
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
        else:
            bad += 1
    return events, bad


def _int(event: dict[str, Any], key: str) -> int | None:
    value = event.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(event: dict[str, Any], key: str) -> float | None:
    value = event.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _str(event: dict[str, Any], key: str) -> str | None:
    value = event.get(key)
    return value if isinstance(value, str) else None


def _timestamp(event: dict[str, Any]) -> float | None:
    raw = event.get("timestamp")
    if not isinstance(raw, str):
        return None
    try:
        return datetime.fromisoformat(raw).timestamp()
    except ValueError:
        return None


def _rollout_of(event: dict[str, Any]) -> str | None:
    # Group ids are "<rollout_id>/<group_index>", request ids "<group_id>/<sample_index>"
    # (controlplane/intake.py); logs older than the rollout_id field on chunk events carry them.
    rollout_id = _str(event, "rollout_id")
    if rollout_id is None and (group_id := _str(event, "group_id")) and "/" in group_id:
        rollout_id = group_id.rsplit("/", 1)[0]
    if rollout_id is None and (request_id := _str(event, "request_id")) and request_id.count("/") >= 2:
        rollout_id = request_id.rsplit("/", 2)[0]
    return rollout_id


class _Builder:
    """Replays the events in log order; task ids identify chunks within one daemon life."""

    def __init__(self) -> None:
        self.spans: list[ChunkSpan] = []
        self.pending: dict[int, ChunkSpan] = {}  # task_id -> chunk in flight
        self.previous_engine: dict[str, int] = {}  # request_id -> engine of its last chunk
        self.explicit: list[Migration] = []
        self.rollouts: dict[str, RolloutRecord] = {}
        self.alive: dict[int, list[tuple[float, float]]] = {}
        self.up_since: dict[int, float] = {}
        self.last_s = 0.0
        self.transfers: list[dict[str, Any]] = []

    def rollout(self, rollout_id: str) -> RolloutRecord:
        return self.rollouts.setdefault(rollout_id, RolloutRecord(rollout_id=rollout_id))

    def close_pending(self, now: float, outcome: str,
                      keep: Callable[[ChunkSpan], bool] = lambda span: False) -> None:
        for task_id, span in list(self.pending.items()):
            if not keep(span):
                span.end_s, span.outcome = max(now, span.start_s), outcome
                del self.pending[task_id]

    def engine_down(self, engine_id: int, now: float) -> None:
        if engine_id in self.up_since:
            self.alive.setdefault(engine_id, []).append((self.up_since.pop(engine_id), now))

    def new_span(self, ev: dict[str, Any], start_s: float) -> ChunkSpan | None:
        engine_id, request_id = _int(ev, "engine_id"), _str(ev, "request_id")
        if engine_id is None or request_id is None:
            return None
        previous = self.previous_engine.get(request_id)
        self.previous_engine[request_id] = engine_id
        span = ChunkSpan(engine_id=engine_id, group_id=_str(ev, "group_id") or request_id.rsplit("/", 1)[0],
                         request_id=request_id, start_s=start_s, end_s=start_s, task_id=_int(ev, "task_id"),
                         rollout_id=_rollout_of(ev), migrated=previous not in (None, engine_id),
                         outcome="unfinished")
        self.spans.append(span)
        return span

    def dispatch(self, ev: dict[str, Any], now: float) -> None:
        span = self.new_span(ev, now)
        if span is not None and span.task_id is not None:
            self.pending[span.task_id] = span

    def finish(self, ev: dict[str, Any], now: float) -> None:
        task_id = _int(ev, "task_id")
        span = self.pending.pop(task_id, None) if task_id is not None else None
        if span is None:  # dispatch not in the log: start from the engine's own latency
            span = self.new_span(ev, now - (_float(ev, "latency_ms") or 0.0) / 1000)
            if span is None:
                return
        span.end_s, span.outcome = now, "finished"
        span.num_tokens, span.num_cached_tokens = _int(ev, "num_tokens"), _int(ev, "num_cached_tokens")
        span.finish_reason = _str(ev, "finish_reason")

    def migrated(self, ev: dict[str, Any], now: float) -> None:
        request_id = _str(ev, "request_id")
        if request_id is None:
            return
        mode = _str(ev, "mode")
        self.explicit.append(Migration(
            request_id=request_id, rollout_id=_rollout_of(ev), time_s=now,
            to_engine_id=_int(ev, "to_engine_id"),
            from_engine_id=_int(ev, "from_engine_id"), task_id=_int(ev, "task_id"),
            mode=mode if mode in ("pool", "reprefill") else None, prefix_tokens=_int(ev, "prefix_tokens"),
            kv_loaded_tokens=_int(ev, "kv_loaded_tokens"), num_bytes=_int(ev, "num_bytes"),
            load_ms=_float(ev, "load_ms"), reprefill_tokens=_int(ev, "reprefill_tokens")))

    def feed(self, ev: dict[str, Any]) -> None:
        now = _timestamp(ev)
        if now is None:
            return
        self.last_s = max(self.last_s, now)
        name = ev["event"]
        if name == "chunk_dispatched":
            self.dispatch(ev, now)
        elif name == "chunk_finished":
            self.finish(ev, now)
        elif name == "chunk_migrated":
            self.migrated(ev, now)
        elif name in ("kv_transferred", "kv_transfer_failed", "kv_transfer_timed_out"):
            self.transfers.append(ev)
        elif name == "chunk_failed" and (task_id := _int(ev, "task_id")) in self.pending:
            span = self.pending.pop(task_id)  # type: ignore[arg-type]
            span.end_s, span.outcome = now, "failed"
        elif name == "engine_ready" and (engine_id := _int(ev, "engine_id")) is not None:
            self.up_since.setdefault(engine_id, now)
        elif name == "engine_lost" and (engine_id := _int(ev, "engine_id")) is not None:
            self.close_pending(now, "lost", keep=lambda span: span.engine_id != engine_id)
            self.engine_down(engine_id, now)
        elif name in ("control_plane_started", "control_plane_stopped"):
            # A new daemon life restarts task ids; whatever was in flight never ended in the log.
            self.close_pending(now, "unfinished")
            for engine_id in list(self.up_since):
                self.engine_down(engine_id, now)
        elif name == "rollout_accepted" and (rollout_id := _str(ev, "rollout_id")):
            record = self.rollout(rollout_id)
            record.accepted_s, record.policy = now, _str(ev, "policy")
            record.num_samples_requested = _int(ev, "num_samples")
        elif name == "rollout_finished" and (rollout_id := _str(ev, "rollout_id")):
            record = self.rollout(rollout_id)
            record.ended_s, record.outcome = now, "finished"
            record.policy = record.policy or _str(ev, "policy")
            record.num_samples = _int(ev, "num_samples")
            record.num_output_tokens = _int(ev, "num_output_tokens")
            record.wall_time_s, record.tail_time_s = _float(ev, "wall_time_s"), _float(ev, "tail_time_s")
            record.num_preemptions = _int(ev, "num_preemptions")
        elif name in ("rollout_aborted", "rollout_failed") and (rollout_id := _str(ev, "rollout_id")):
            record = self.rollout(rollout_id)
            record.ended_s, record.outcome = now, "aborted" if name == "rollout_aborted" else "failed"
            self.close_pending(now, "aborted", keep=lambda span: span.rollout_id != rollout_id)

    def migrations(self) -> list[Migration]:
        """Explicit migrations, plus one of unknown mode for each engine change none explains."""
        # Task ids restart with each daemon life; request ids carry the rollout's unique id.
        by_task = {(m.request_id, m.task_id) for m in self.explicit if m.task_id is not None}
        by_request: dict[tuple[str, int | None], list[Migration]] = {}
        for m in self.explicit:
            if m.task_id is None:
                by_request.setdefault((m.request_id, m.to_engine_id), []).append(m)
        inferred = []
        for span in self.spans:
            key = (span.request_id, span.engine_id)
            if (span.request_id, span.task_id) in by_task:
                span.migrated = True
            elif span.migrated and by_request.get(key):
                by_request[key].pop(0)
            elif span.migrated:
                inferred.append(Migration(request_id=span.request_id, rollout_id=span.rollout_id,
                                          time_s=span.start_s, to_engine_id=span.engine_id,
                                          task_id=span.task_id))
        return sorted(self.explicit + inferred, key=lambda m: m.time_s)


def build_trace(events: Iterable[dict[str, Any]], num_bad_lines: int = 0) -> Trace:
    """Chunk spans, migrations, rollouts and engine up-times from events in log order."""
    builder = _Builder()
    for event in events:
        builder.feed(event)
    builder.close_pending(builder.last_s, "unfinished")
    for engine_id in list(builder.up_since):
        builder.alive.setdefault(engine_id, []).append((builder.up_since.pop(engine_id), float("inf")))
    for span in builder.spans:
        if span.rollout_id is not None:
            builder.rollout(span.rollout_id)
    return Trace(spans=builder.spans, migrations=builder.migrations(), rollouts=builder.rollouts,
                 engine_alive=builder.alive, num_bad_lines=num_bad_lines, transfers=builder.transfers)


def select_rollouts(trace: Trace, wanted: str | None) -> list[str]:
    """``None``: the last rollout accepted; ``"all"``: every rollout; else the rollouts
    whose id starts with ``wanted`` (``seerctl status`` prints 8-character prefixes)."""
    ids = list(trace.rollouts)
    if not ids:
        raise TraceError("the log holds no rollout (no rollout_accepted or chunk events)")
    if wanted is None:
        accepted = [(r.accepted_s, r.rollout_id) for r in trace.rollouts.values() if r.accepted_s is not None]
        return [max(accepted)[1]] if accepted else ids[-1:]
    if wanted == ALL_ROLLOUTS:
        return ids
    matches = [i for i in ids if i.startswith(wanted)]
    if len(matches) != 1:
        found = "no rollout" if not matches else f"{len(matches)} rollouts"
        raise TraceError(f"{found} in the log match {wanted!r}; rollouts: {', '.join(ids)} "
                         f"(or '{ALL_ROLLOUTS}')")
    return matches


def union_length_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def summarize(trace: Trace, rollout_ids: list[str]) -> TraceSummary:
    """Summary of the chosen rollouts over their window (first accept to last end)."""
    chosen = set(rollout_ids)
    records = [trace.rollouts[i] for i in rollout_ids]
    spans = [s for s in trace.spans if s.rollout_id in chosen]
    migrations = [m for m in trace.migrations if m.rollout_id in chosen]
    transfers = [t for t in trace.transfers if t.get("rollout_id") in chosen]
    starts = [r.accepted_s for r in records if r.accepted_s is not None] + [s.start_s for s in spans]
    ends = [r.ended_s for r in records if r.ended_s is not None] + [s.end_s for s in spans]
    start, end = (min(starts), max(ends)) if starts and ends else (0.0, 0.0)

    engine_ids = {s.engine_id for s in spans} | {
        e for e, up in trace.engine_alive.items() if _clip(up, start, end)}
    engines = []
    for engine_id in sorted(engine_ids):
        mine = [s for s in spans if s.engine_id == engine_id]
        busy = union_length_s(_clip(((s.start_s, s.end_s) for s in mine), start, end))
        # An engine with chunks but no engine_ready in the log (cut log) counts as up all along.
        up = trace.engine_alive.get(engine_id, [(float("-inf"), float("inf"))])
        alive = union_length_s(_clip(up, start, end))
        engines.append(EngineSummary(
            engine_id=engine_id, num_chunks=len(mine), num_tokens=sum(s.num_tokens or 0 for s in mine),
            busy_s=busy, alive_s=alive, idle_pct=100.0 * (1 - busy / alive) if alive > 0 else None,
            num_migrations_in=sum(1 for m in migrations if m.to_engine_id == engine_id)))

    outcomes: dict[str, int] = {}
    for s in spans:
        outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
    explicit = [m for m in migrations if m.mode is not None]

    def total(values: list[Any]) -> Any:
        return sum(values) if values and all(v is not None for v in values) else None

    return TraceSummary(
        rollout_ids=rollout_ids, policies=sorted({r.policy for r in records if r.policy}),
        start_s=start, end_s=end, duration_s=end - start,
        num_requests=len({s.request_id for s in spans}), num_chunks=len(spans),
        num_chunks_by_outcome=outcomes,
        num_output_tokens=sum(s.num_tokens or 0 for s in spans if s.outcome == "finished"),
        num_samples=total([r.num_samples for r in records]),
        num_preemptions=total([r.num_preemptions for r in records]),
        num_migrations=len(migrations),
        num_pool_migrations=sum(1 for m in migrations if m.mode == "pool"),
        num_reprefill_migrations=sum(1 for m in migrations if m.mode == "reprefill"),
        num_unknown_migrations=sum(1 for m in migrations if m.mode is None),
        # Nothing moved is a known zero; migrations the log does not describe leave it unknown.
        num_bytes_moved=total([m.num_bytes for m in explicit]) if explicit else (None if migrations else 0),
        load_ms_total=total([m.load_ms for m in explicit]) if explicit else (None if migrations else 0.0),
        num_reprefill_tokens=total([m.reprefill_tokens for m in explicit]) if explicit else (
            None if migrations else 0),
        engines=engines,
        num_kv_transfers=sum(1 for t in transfers if t["event"] == "kv_transferred"),
        num_kv_transfers_failed=sum(1 for t in transfers if t["event"] != "kv_transferred"),
        kv_transfer_bytes=sum(_int(t, "num_bytes") or 0 for t in transfers if t["event"] == "kv_transferred"),
        kv_transfer_ms_total=sum(_float(t, "ms") or 0.0 for t in transfers if t["event"] == "kv_transferred"))
