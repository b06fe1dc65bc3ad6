"""Weight updates on a real vLLM engine: the trainer's shared-memory segment through
vLLM's weight-transfer API (engines/weight_transfer.py), the bad inputs it refuses, and
what a failed update leaves. One engine in a subprocess (tests/engine/weight_sync_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_helpers import shm_entries

pytestmark = pytest.mark.engine

QUESTIONS = ["What is 12 times 7?", "Name three primary colors."]


@pytest.fixture(scope="module")
def report(model_dir: Path) -> dict:
    before = shm_entries()
    spec = {"model": str(model_dir), "questions": QUESTIONS, "repeats": 5, "in_flight_delay_s": 0.5}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("weight_sync_check.py"))],
                          input=json.dumps(spec), capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["leftover_segments"] = sorted(n for n in shm_entries() - before if n.startswith("seer-weights-"))
    print(json.dumps(result, indent=1))
    return result


def test_the_models_own_weights_through_shared_memory_change_nothing(report):
    """Loading the checkpoint's own tensors from a segment keeps the greedy tokens and their logprobs."""
    own = report["own"]
    assert all(own["same_tokens"])
    assert own["max_logprob_diff"] <= 1e-5
    assert own["num_bytes"] > 100e6  # the whole model travelled (SmolLM2-135M float32, tied head once)


def test_trained_weights_give_the_trainers_logprobs(report):
    """After a perturbed update the engine's logprobs equal a float32 HF forward pass of the same weights."""
    assert all(report["trained"]["changed"])
    assert report["trained"]["max_logprob_diff_vs_hf"] <= 2e-3


def test_an_update_during_a_request_never_mixes_weights(report):
    """A request generating when an update arrives finishes entirely on the old or the new weights."""
    assert report["in_flight"]["new_differs"]
    assert report["in_flight"]["old_or_new"]


def test_mismatched_or_rewritten_segments_are_refused_before_loading(report):
    """Missing, unknown and reshaped tensors and a rewritten segment are refused with the reason; output unchanged."""
    errors = report["refused"]["errors"]
    assert set(errors) == {"missing", "unknown", "reshaped", "stale"}
    assert "1 missing" in errors["missing"]
    assert "1 unknown ['model.extra.weight']" in errors["unknown"]
    assert "1 of another shape" in errors["reshaped"]
    assert "generation" in errors["stale"]
    assert report["refused"]["unchanged"]


def test_a_half_loaded_update_is_undone(report):
    """An update that fails after half its tensors reached the model: the engine reloads its served weights."""
    half = report["half_loaded"]
    assert "failed part way" in half["error"] and "injected failure" in half["error"]
    assert half["healthy"] and half["unchanged"]


def test_an_engine_that_cannot_undo_a_failed_update_stops_serving(report):
    """When the served weights are gone too, the engine is unhealthy and refuses work instead of serving a mix."""
    bad = report["unrecoverable"]
    assert "failed part way" in bad["error"] and "stops serving" in bad["error"]
    assert not bad["healthy"]
    assert "half loaded" in bad["generate"]


def test_the_checkpoint_path_still_loads_and_no_segment_is_left(report):
    """The file path reloads the checkpoint (same greedy output as at start); every segment was unlinked."""
    assert report["file"]["healthy"] and report["file"]["same_as_before"]
    assert report["leftover_segments"] == []
