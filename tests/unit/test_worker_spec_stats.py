"""The engine worker's speculation_stats log: what speculative decoding did per interval."""

from __future__ import annotations

import structlog

from seer.config import SeerConfig
from seer.engines.worker import EngineWorker


class CountingBackend:
    """Only what _log_spec reads: vLLM's cumulative SD counters."""

    def __init__(self) -> None:
        self.counts = (0, 0, 0)

    def spec_counts(self) -> tuple[int, int, int]:
        return self.counts


def test_speculation_stats_reports_each_interval_and_stays_quiet_when_idle():
    backend = CountingBackend()
    worker = EngineWorker(3, "ipc:///nonexistent", SeerConfig(), backend)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        backend.counts = (10, 40, 12)  # 10 drafting row-steps, 40 drafts, 12 accepted
        worker._log_spec()
        worker._log_spec()  # nothing new: no event
        backend.counts = (14, 56, 24)
        worker._log_spec()
    events = [e for e in logs if e["event"] == "speculation_stats"]
    assert [(e["drafting_steps"], e["draft_tokens"], e["accepted_tokens"]) for e in events] == [(10, 40, 12), (4, 16, 12)]
    assert events[0]["acceptance"] == 0.3 and events[0]["tokens_per_drafting_step"] == 2.2
    assert events[1]["acceptance"] == 0.75 and events[1]["tokens_per_drafting_step"] == 4.0
    assert all(e["engine_id"] == 3 for e in events)
