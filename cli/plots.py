"""PNG plots for ``seerctl trace --plot`` and ``seerctl bench --plot``.

Owns the one timeline drawing both commands share (engines on the y axis, time on x,
one bar per chunk coloured by group, migrations marked) and the two figures built
around it. matplotlib is an optional dependency (the ``plot`` extra): it is imported
only inside the drawing functions, so the control plane, the client and every other
command work without it. Figures are rendered with the Agg canvas straight to a file —
no pyplot, no display, no global backend state.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seer.controlplane.trace import ChunkSpan, TraceSummary

if TYPE_CHECKING:
    from seer.sim.simulator import SimResult

ROW_HEIGHT = 0.8  # of an engine's row; the rest is the gap to the next engine
MAX_BENCH_TIMELINES = 5
_GROUP_COLOURS = "tab20"  # 20 colours: 10 hues x (dark, light)
MISSING = "plots need matplotlib: pip install 'seer-rollout[plot]' (scripts/setup.sh installs it)"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(MISSING) from exc
    return matplotlib


def plot_unavailable() -> str | None:
    """Why plots cannot be drawn here, or None: lets commands fail before long work."""
    try:
        _matplotlib()
    except PlotUnavailable as exc:
        return str(exc)
    return None


def assign_lanes(spans: Sequence[ChunkSpan]) -> tuple[list[int], dict[int, int]]:
    """Lane of each span within its engine's row, and the number of lanes per engine.

    Chunks that overlap in time on one engine go to different lanes: each takes the
    lowest lane free at its start, so an engine with k chunks in flight uses k lanes.
    """
    lanes = [0] * len(spans)
    order = sorted(range(len(spans)), key=lambda i: (spans[i].engine_id, spans[i].start_s, spans[i].end_s))
    num_lanes: dict[int, int] = {}
    busy: list[tuple[float, int]] = []  # (end, lane) of chunks in flight on the current engine
    free: list[int] = []
    engine = None
    for i in order:
        span = spans[i]
        if span.engine_id != engine:
            engine, busy, free = span.engine_id, [], []
            num_lanes[engine] = 0
        while busy and busy[0][0] <= span.start_s:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane = num_lanes[engine]
            num_lanes[engine] += 1
        heapq.heappush(busy, (span.end_s, lane))
        lanes[i] = lane
    return lanes, num_lanes


def draw_timeline(ax: Any, spans: Sequence[ChunkSpan], origin_s: float = 0.0,
                  engine_ids: Sequence[int] | None = None, title: str | None = None) -> None:
    """Draw chunk spans on ``ax``: one row per engine (top = lowest id), one lane per
    concurrent chunk, colour by group (in order of first dispatch), a tick at the start
    of every chunk that migrated."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    mpl = _matplotlib()
    engines = sorted(set(engine_ids or ()) | {s.engine_id for s in spans})
    row = {e: len(engines) - 1 - k for k, e in enumerate(engines)}
    lanes, num_lanes = assign_lanes(spans)
    group_index: dict[str, int] = {}
    for span in sorted(spans, key=lambda s: s.start_s):
        group_index.setdefault(span.group_id, len(group_index))
    palette = mpl.colormaps[_GROUP_COLOURS]

    n = len(spans)
    x0 = np.fromiter((s.start_s - origin_s for s in spans), float, n)
    x1 = np.fromiter((s.end_s - origin_s for s in spans), float, n)
    height = np.fromiter((ROW_HEIGHT / num_lanes[s.engine_id] for s in spans), float, n)
    y0 = np.fromiter((row[s.engine_id] for s in spans), float, n) + np.asarray(lanes, float) * height
    y1 = y0 + height * 0.9  # a hairline between lanes keeps neighbours apart
    verts = np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y1], 1),
                      np.stack([x0, y1], 1)], 1)
    # tab20 pairs a dark and a light shade of each hue: neighbouring groups get different hues.
    shade = np.fromiter((group_index[s.group_id] for s in spans), int, n)
    colours = palette((shade % 10) * 2 + (shade // 10) % 2)
    # The edge keeps a chunk in a one-of-hundreds lane visible as a line.
    ax.add_collection(PolyCollection(verts, facecolors=colours, edgecolors=colours, linewidths=0.4))

    moved = [i for i, s in enumerate(spans) if s.migrated]
    if moved:
        ax.scatter(x0[moved], (y0[moved] + y1[moved]) / 2, marker="|", s=40, c="black", linewidths=1.0,
                   label=f"migration ({len(moved)})", zorder=3)
        ax.legend(loc="upper right", fontsize="small")
    ax.set_yticks([row[e] + ROW_HEIGHT / 2 for e in engines], [f"engine {e}" for e in engines])
    ax.set_ylim(-1 + ROW_HEIGHT, len(engines))
    ax.set_xlim(0, max(float(x1.max()) if n else 0.0, 1e-9) * 1.01)
    ax.set_xlabel("seconds since rollout start")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize="medium")


def _figure(width_in: float, height_in: float) -> Any:
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _timeline_height_in(num_engines: int) -> float:
    # ~1/3 inch per engine row, squeezed past 24 engines so paper-scale figures stay printable
    return max(2.0, min(0.35 * num_engines, 8.0 + 0.1 * num_engines) + 1.0)


def save_trace_plot(spans: Sequence[ChunkSpan], summary: TraceSummary, path: Path) -> None:
    """``seerctl trace --plot``: the rollout's timeline over its window."""
    engine_ids = [e.engine_id for e in summary.engines]
    figure = _figure(12, _timeline_height_in(len(engine_ids)) + 0.5)
    ax = figure.add_subplot()
    rollouts = ", ".join(r[:8] for r in summary.rollout_ids)
    policies = ", ".join(summary.policies) or "policy unknown"
    draw_timeline(ax, spans, origin_s=summary.start_s, engine_ids=engine_ids,
                  title=f"rollout {rollouts} ({policies}): {summary.num_chunks} chunks, "
                        f"{summary.num_migrations} migrations; colour = group")
    figure.savefig(path, dpi=120)


def save_bench_plot(results: Sequence[SimResult], path: Path,
                    max_timelines: int = MAX_BENCH_TIMELINES) -> None:
    """``seerctl bench --plot``: throughput and tail-time bars per policy, then the
    simulated per-engine timelines of the first ``max_timelines`` policies on one time axis."""
    shown = list(results)[:max_timelines]
    num_engines = max(r.num_engines for r in results)
    height = _timeline_height_in(num_engines)
    figure = _figure(12, 3.0 + height * len(shown))
    grid = figure.add_gridspec(1 + len(shown), 2, height_ratios=[3.0] + [height] * len(shown))
    names = [r.policy for r in results]
    bars = [(figure.add_subplot(grid[0, 0]), [r.throughput_tokens_per_s for r in results],
             "output tokens / s"),
            (figure.add_subplot(grid[0, 1]), [r.tail_time_s for r in results],
             "tail time, s (last 10 % of samples)")]
    for ax, values, label in bars:
        ax.bar(names, values, color="tab:blue")
        ax.set_title(label, fontsize="medium")
        for k, value in enumerate(values):
            ax.annotate(f"{value:,.0f}", (k, value), ha="center", va="bottom", fontsize="small")
        ax.margins(y=0.15)
    first = None
    for k, result in enumerate(shown):
        ax = figure.add_subplot(grid[1 + k, :], sharex=first)
        first = first or ax
        draw_timeline(ax, result.spans, engine_ids=range(result.num_engines),
                      title=f"{result.policy}: makespan {result.makespan_s:,.0f} s, "
                            f"{result.num_chunks} chunks, "
                            f"{result.num_preemptions} preemptions (simulated; colour = group)")
    if first is not None:  # each timeline set its own limit; the shared axis must fit the longest
        first.set_xlim(0, max(r.makespan_s for r in shown) * 1.01 or 1.0)
    if len(results) > len(shown):
        figure.suptitle(f"timelines of the first {len(shown)} of {len(results)} policies", fontsize="small")
    figure.savefig(path, dpi=100)
