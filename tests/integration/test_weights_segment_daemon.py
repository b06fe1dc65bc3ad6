"""update_weights from a trainer's shared-memory segment, through a real daemon with
simulated engines: the version fence and the refusals (the loading itself is
tests/engine/test_weight_sync.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from seer.client import SamplingParams, SeerClient, SeerServiceError
from seer.weights_segment import SegmentWriter


@pytest.fixture
def writer():
    w = SegmentWriter(prefix=f"seer-test-daemon-{os.getpid()}")
    yield w
    w.close()


def weights(seed: int):
    a = np.random.default_rng(seed).standard_normal(16, dtype=np.float32)
    return [("w", "F32", (16,), memoryview(a))]


def test_a_segment_update_bumps_the_version_every_engine_and_rollout_reports(sim_daemon, writer):
    """Each accepted segment is a new version; status, every engine and the next rollout report it."""
    with SeerClient(sim_daemon.address) as client:
        before = client.status().weights_version
        first = client.update_weights(writer.write(weights(1)))
        writer.accepted()
        second = client.update_weights(writer.write(weights(2)))
        writer.accepted()
        assert (first, second) == (before + 1, before + 2)
        status = client.status()
        assert status.weights_version == second and all(e.weights_version == second for e in status.engines)
        assert client.rollout(["after"], 2, SamplingParams(max_tokens=4)).weights_version == second


def test_a_segment_rewritten_before_the_update_is_refused_and_the_version_stays(sim_daemon, writer):
    """A source whose segment already holds a later write fails the update; the service keeps its version."""
    with SeerClient(sim_daemon.address) as client:
        before = client.status().weights_version
        stale = writer.write(weights(1))
        writer.write(weights(2))  # the trainer wrote again into the same segment
        with pytest.raises(SeerServiceError) as info:
            client.update_weights(stale)
        assert info.value.code == "weights_update_failed" and "generation" in info.value.message
        assert client.status().weights_version == before


def test_a_missing_segment_is_refused_before_any_engine_is_asked(sim_daemon):
    """A segment that does not exist on the daemon's host is bad_weights_path, naming the source."""
    with SeerClient(sim_daemon.address) as client:
        with pytest.raises(SeerServiceError) as info:
            client.update_weights("shm://seer-no-such-segment?generation=3")
        assert info.value.code == "bad_weights_path" and "seer-no-such-segment" in info.value.message
