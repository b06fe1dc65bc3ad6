"""`seerctl trace` on the run dir of a real daemon (simulated engines) after a chunked rollout."""

from __future__ import annotations

import json

from seer.client import SamplingParams, SeerClient
from tests.daemon_helpers import Daemon, seerctl, write_sim_config


def test_trace_of_a_divided_rollout_counts_its_chunks_samples_and_migrations(tmp_path):
    """After a divided rollout (16-token chunks, each on another engine than the last) and
    a stop, the trace of the run dir reports the rollout's own chunk, sample, token and
    migration counts, every migration explained by a chunk_migrated event, and plots it."""
    config = write_sim_config(tmp_path / "sim.toml")
    config.write_text(config.read_text().replace("[scheduler]\n", '[scheduler]\nplacement = "migrate"\n'))
    daemon = Daemon(tmp_path / "run", config)
    daemon.start()
    try:
        with SeerClient(daemon.address) as client:
            result = client.rollout([f"question {i}" for i in range(3)], group_size=4, policy="divided",
                                    sampling=SamplingParams(max_tokens=48, seed=3))
    finally:
        daemon.stop()
    stats = result.stats
    samples = [s for g in result.groups for s in g.samples]
    assert stats.num_chunks > len(samples) == 12  # the rollout really ran in chunks

    proc = seerctl("trace", str(daemon.run_dir), "--json", "--plot", str(tmp_path / "timeline.png"))
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(proc.stdout)
    summary = trace["summary"]
    assert summary["rollout_ids"] == [result.rollout_id]
    assert summary["num_chunks"] == stats.num_chunks
    assert summary["num_chunks_by_outcome"] == {"finished": stats.num_chunks}
    assert summary["num_samples"] == summary["num_requests"] == 12
    assert summary["num_output_tokens"] == stats.num_output_tokens
    num_migrations = sum(len(s.engine_ids) - 1 for s in samples)
    assert summary["num_migrations"] == num_migrations > 0
    assert summary["num_pool_migrations"] + summary["num_reprefill_migrations"] == num_migrations
    assert summary["num_unknown_migrations"] == 0
    assert sum(e["num_chunks"] for e in summary["engines"]) == stats.num_chunks
    assert {str(e["engine_id"]): e["num_tokens"] for e in summary["engines"] if e["num_tokens"]} == \
        stats.per_engine_output_tokens
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = seerctl("trace", str(daemon.run_dir))
    assert table.returncode == 0, table.stderr
    assert f"{stats.num_chunks} ({stats.num_chunks} finished)" in table.stdout
    assert f"rollout {result.rollout_id} (divided): finished, 12 samples" in table.stdout
