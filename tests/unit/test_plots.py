"""Timelines and plots (cli/plots.py), `seerctl trace` end to end on a hand-written log,
simulator chunk spans, and that nothing but the plotting code needs matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from seer.cli.main import main
from seer.cli.plots import assign_lanes, save_bench_plot
from seer.config import SchedulerConfig
from seer.controlplane.trace import ChunkSpan
from seer.sim.engine_model import CostModel
from seer.sim.simulator import simulate
from seer.sim.workloads import paper_trace
from tests.unit.test_trace import DIVIDED_LOG

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def span(engine_id: int, start_s: float, end_s: float) -> ChunkSpan:
    return ChunkSpan(engine_id=engine_id, group_id="g", request_id="r", start_s=start_s, end_s=end_s)


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 2000


def test_overlapping_chunks_get_the_lowest_free_lane_per_engine():
    """[0,2] lane 0, [1,3] lane 1, [2,4] reuses lane 0 (freed at 2), [5,6] lane 0; another
    engine starts again at lane 0."""
    spans = [span(0, 2, 4), span(1, 0, 1), span(0, 0, 2), span(0, 5, 6), span(0, 1, 3)]
    lanes, num_lanes = assign_lanes(spans)
    assert lanes == [0, 0, 0, 0, 1]
    assert num_lanes == {0: 2, 1: 1}


def test_trace_command_prints_the_summary_and_writes_a_png(tmp_path, capsys):
    """seerctl trace RUN_DIR --plot writes a valid PNG and prints chunks and migrations."""
    (tmp_path / "controlplane.log").write_text("\n".join(DIVIDED_LOG) + "\n")
    png = tmp_path / "timeline.png"
    assert main(["trace", str(tmp_path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "6 (1 failed, 5 finished)" in out
    assert "2 (KV pool 1, re-prefill 0, not logged 1)" in out
    assert_png(png)


def test_trace_json_is_the_summary(tmp_path, capsys):
    """--json prints the same summary as data, with the rollout records."""
    (tmp_path / "controlplane.log").write_text("\n".join(DIVIDED_LOG) + "\n")
    assert main(["trace", str(tmp_path / "controlplane.log"), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["summary"]["num_chunks"] == 6
    assert [e["num_tokens"] for e in payload["summary"]["engines"]] == [22, 18]
    assert payload["rollouts"][0]["num_samples"] == 3


def test_trace_of_a_missing_run_dir_fails_with_a_message(tmp_path, capsys):
    """Exit code 1 and a message naming the missing log, no traceback."""
    assert main(["trace", str(tmp_path / "nope")]) == 1
    assert "controlplane.log" in capsys.readouterr().err


def test_simulator_spans_cover_every_chunk_and_mark_its_migrations(tmp_path):
    """SimResult.spans has one span per chunk, migrated exactly as often as the result's
    migration count, and bench's plot of two policies is a valid PNG."""
    trace = paper_trace("moonlight", scale=0.02, seed=0)
    results = [simulate(trace, policy, 4, CostModel.gpu_h800_like(), 50_000,
                        SchedulerConfig(policy=policy, chunk_size_tokens=256), 0)  # type: ignore[arg-type]
               for policy in ("group", "divided")]
    for result in results:
        assert len(result.spans) == result.num_chunks
        assert sum(s.migrated for s in result.spans) == result.num_migrations
        assert all(0 <= s.start_s <= s.end_s <= result.makespan_s for s in result.spans)
        assert sum(s.num_tokens for s in result.spans) == result.num_output_tokens
    assert results[1].num_chunks > results[1].num_requests  # divided really chunked
    png = tmp_path / "bench.png"
    save_bench_plot(results, png)
    assert_png(png)


BLOCKED = textwrap.dedent("""
    import importlib.abc, sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "matplotlib":
                raise ImportError("blocked for the test: " + name)

    sys.meta_path.insert(0, Blocker())
    import seer.client, seer.controlplane.server, seer.controlplane.trace, seer.sim.simulator, seer.cli.trace
    from seer.cli.main import main

    assert main(["trace", sys.argv[1]]) == 0
    sys.exit(main(["trace", sys.argv[1], "--plot", sys.argv[1] + "/x.png"]))
""")


def test_only_plots_need_matplotlib(tmp_path):
    """Without matplotlib the client, control plane, simulator and `seerctl trace` work;
    only --plot fails, with an install hint and exit code 1."""
    (tmp_path / "controlplane.log").write_text("\n".join(DIVIDED_LOG) + "\n")
    proc = subprocess.run([sys.executable, "-c", BLOCKED, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "seer-rollout[plot]" in proc.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv", [["bench", "--help"], ["trace", "--help"]])
def test_plot_option_is_offered(argv, capsys):
    """Both commands document --plot."""
    with pytest.raises(SystemExit):
        main(argv)
    assert "--plot" in capsys.readouterr().out
