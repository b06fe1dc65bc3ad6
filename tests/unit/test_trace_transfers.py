"""``seerctl trace`` counts KV transfers between hosts' pools (kv_transferred,
kv_transfer_failed, kv_transfer_timed_out events of controlplane/kvpool/agents.py), per rollout."""

from __future__ import annotations

import json

from rich.console import Console

from seer.cli.trace import summary_tables
from seer.controlplane.trace import build_trace, summarize

T = "2026-11-30T00:00:0{}Z"


def ev(second: int, event: str, **fields: object) -> dict:
    return json.loads(json.dumps({**fields, "event": event, "timestamp": T.format(second)}))


def test_transfers_of_the_chosen_rollouts_are_counted_with_bytes_and_time():
    events = [
        ev(0, "rollout_accepted", rollout_id="r1", policy="divided", num_samples=1),
        ev(0, "rollout_accepted", rollout_id="r2", policy="divided", num_samples=1),
        ev(1, "kv_transferred", rollout_id="r1", from_host="a", to_host="b", num_bytes=1000, ms=2.5),
        ev(2, "kv_transferred", rollout_id="r1", from_host="b", to_host="a", num_bytes=3000, ms=1.0),
        ev(3, "kv_transfer_failed", rollout_id="r1", from_host="a", to_host="b", error="x"),
        ev(4, "kv_transfer_timed_out", rollout_id="r1", from_host="a", to_host="b"),
        ev(5, "kv_transferred", rollout_id="r2", from_host="a", to_host="b", num_bytes=7, ms=9.0),
    ]
    trace = build_trace(events)
    one = summarize(trace, ["r1"])
    assert (one.num_kv_transfers, one.num_kv_transfers_failed) == (2, 2)
    assert one.kv_transfer_bytes == 4000 and one.kv_transfer_ms_total == 3.5
    both = summarize(trace, ["r1", "r2"])
    assert (both.num_kv_transfers, both.kv_transfer_bytes) == (3, 4007)
    console = Console(record=True, width=160)
    for part in summary_tables(trace, one):
        console.print(part)
    text = console.export_text()
    assert "KV transfers between hosts" in text and "2 (0.0 MiB (4,000 B), 3.5 ms; failed or timed out 2)" in text


def test_a_log_without_transfers_counts_zero():
    trace = build_trace([ev(0, "rollout_accepted", rollout_id="r1", policy="group", num_samples=1)])
    s = summarize(trace, ["r1"])
    assert (s.num_kv_transfers, s.num_kv_transfers_failed, s.kv_transfer_bytes) == (0, 0, 0)
