"""Oversized requests against a real daemon end in a SeerError with a message, and
`seerctl rollout` refuses them with exit 2 and one line (issue 14, defect 6).

write_sim_config sets server.max_request_bytes = 200000: a frame above it is refused
with frame_too_large; one above the socket's hard cap (twice that) is dropped unread
while the daemon keeps answering the rollout's heartbeats (the "140 MB prompt" case at
the default 64 MiB limit). The client knows the limit from the daemon's daemon.json and
refuses such requests itself, at once (issue 38); the daemon's own answers are checked
with a client told a larger limit (``max_request_bytes=``), as a tcp:// client without
daemon.json would be."""

from __future__ import annotations

import json
import time

import pytest

from seer.client import SeerClient, SeerInputError, SeerServiceError, SeerTimeoutError
from tests.daemon_helpers import seerctl


def test_a_request_beyond_the_hard_cap_times_out_with_a_message_not_an_assertion(sim_daemon):
    """A prompt beyond twice max_request_bytes: heartbeats are answered, the request never
    is; the client raises SeerTimeoutError saying so (it used to fail an assert on the Ack)."""
    with SeerClient(sim_daemon.address, timeout_s=3.0, heartbeat_interval_s=0.2, max_request_bytes=2**30) as client:
        with pytest.raises(SeerTimeoutError, match="answers heartbeats but did not accept"):
            client.rollout(["x" * 500_000], 1)
        assert client.status().rollouts == []


def test_a_request_above_the_limit_is_refused_with_frame_too_large(sim_daemon):
    """A prompt between max_request_bytes and the hard cap gets SeerServiceError frame_too_large."""
    with SeerClient(sim_daemon.address, timeout_s=10.0, max_request_bytes=2**30) as client:
        with pytest.raises(SeerServiceError) as info:
            client.rollout(["x" * 300_000], 1)
    assert info.value.code == "frame_too_large"


@pytest.mark.parametrize("size", [300_000, 500_000])
def test_the_client_refuses_an_over_size_request_at_once_with_the_clis_message(sim_daemon, size):
    """Told nothing, the client reads the limit from the daemon's daemon.json and refuses a
    request over it before sending, with the message `seerctl rollout` prints (it used to
    wait out its whole timeout for a request the daemon drops); the daemon saw nothing."""
    with SeerClient(sim_daemon.address, timeout_s=30.0) as client:
        t0 = time.monotonic()
        with pytest.raises(SeerInputError, match="more than server.max_request_bytes = 200000"):
            client.rollout(["x" * size], 1)
        assert time.monotonic() - t0 < 5
        assert client.status().rollouts == []


def test_seerctl_rollout_refuses_an_oversize_file_for_a_running_daemon_with_one_line(sim_daemon, tmp_path):
    """Against a running local daemon, the limit from daemon.json refuses the file up front: exit 2, one line."""
    prompts = tmp_path / "big.jsonl"
    prompts.write_text(json.dumps({"id": "big", "prompt": "x" * 500_000}) + "\n")
    proc = seerctl("rollout", "--run-dir", str(sim_daemon.run_dir), "--prompts", str(prompts),
                   "--out", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 2
    assert "server.max_request_bytes = 200000" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
