"""The host pool's disk tier through the real server (controlplane/kvpool/disk.py, tiers.py,
dataplane/kvdisk.py): a pool far smaller than the rollout's KV working set, a real disk
tier file, and a same-host fake engine (tests/fake_hosts.py) that checks every loaded
block holds exactly the KV its tokens imply. Costs a few seconds.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from seer.client import SamplingParams, SeerClient
from seer.config import config_from_dict
from seer.controlplane.kvpool import segment as pool_module
from seer.controlplane.server import ControlPlane
from seer.controlplane.tokenizer import ByteTokenizer
from tests.daemon_helpers import wait_for
from tests.fake_hosts import GEOM, FakeKVEngine, reference

PROMPTS = ["alpha", "beta beta", "gamma gamma gamma", "delta"]
MAX_TOKENS = 96
# 24 blocks of 2 KiB: two requests in flight fit, the other six's KV does not.
POOL_GIB = 24 * GEOM.bytes_per_block / 2**30


def run(tmp_path: Path, disk_gib: float, policy: str = "divided") -> tuple[object, list[dict], FakeKVEngine]:
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    config = config_from_dict({
        "engines": {"backend": "vllm", "count": 1, "heartbeat_timeout_s": 60.0},
        "scheduler": {"policy": policy, "chunk_size_tokens": 16, "kv_admission_fraction": 1.0,
                      "max_chunks_per_engine": 2, "chunking": "always"},
        "kv_pool": {"pool_gib": POOL_GIB, "disk_path": str(disk), "disk_gib": disk_gib},
        "server": {"client_timeout_s": 60.0},
    })
    run_dir = tmp_path / f"run-{disk_gib}"
    run_dir.mkdir()
    cp = ControlPlane(config, client_address=f"ipc://{run_dir}/client.sock",
                      engine_address=f"ipc://{run_dir}/engine.sock", tokenizer=ByteTokenizer(), run_dir=run_dir)
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(cp.serve(on_ready=ready.set)), daemon=True)
    engine = None
    with capture_logs() as logs:
        thread.start()
        try:
            assert ready.wait(30)
            engine = FakeKVEngine(cp.engine_address, host_id="").start()
            wait_for(lambda: cp.scheduler.pool is not None, 30, "the control plane's pool")
            with SeerClient(cp.client_address, timeout_s=60) as client:
                result = client.rollout(PROMPTS, group_size=2, timeout_s=60, sampling=SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        finally:
            if engine is not None:
                engine.stop()
            loop.call_soon_threadsafe(cp.stop)
            thread.join(30)
    assert not list(disk.iterdir()), "the disk tier file outlived the daemon"
    return result, logs, engine


def check(result) -> None:
    tok = ByteTokenizer()
    for group in result.groups:
        expected = reference(tok.encode(PROMPTS[group.group_index]), MAX_TOKENS)
        assert [s.token_ids for s in group.samples] == [expected, expected]


@pytest.fixture(autouse=True)
def no_agent(monkeypatch):
    monkeypatch.setattr(pool_module, "agent_available", lambda: False)


@pytest.mark.parametrize("policy", ["divided", "context"])
def test_with_the_disk_tier_no_chunk_loses_its_kv_and_every_load_is_exact(tmp_path, policy):
    """8 samples x 6 chunks through a 24-block pool: with the disk tier, KV of waiting
    requests is spilled and staged back (mostly ahead of its turn, in the background),
    no chunk runs without saving (no kv_pool_full), and the engine found exactly the
    right bytes at every load -- under either policy's queue order."""
    result, logs, engine = run(tmp_path, disk_gib=0.01, policy=policy)
    check(result)
    assert not engine.errors, engine.errors
    events = [e["event"] for e in logs]
    assert "kv_disk_created" in events and "kv_pool_full" not in events and "kv_disk_lost" not in events
    staged = [e for e in logs if e["event"] == "kv_disk_staged"]
    assert events.count("kv_disk_spilled") > 0 and staged and any(e["prefetch"] for e in staged)
    assert not [e for e in logs if e["event"].endswith("_failed")]
    assert engine.loaded_tokens > 0


def test_without_the_disk_tier_the_same_rollout_re_prefills(tmp_path):
    """The baseline: the pool alone is too small, so chunks run without saving."""
    result, logs, engine = run(tmp_path, disk_gib=0.0)
    check(result)
    assert not engine.errors
    assert "kv_pool_full" in [e["event"] for e in logs]


def test_a_disk_too_small_to_help_means_re_prefill_with_exact_samples(tmp_path):
    """A 3-block disk tier cannot take every waiting request's KV: chunks run without
    saving (kv_pool_full) or find their KV could not come back (kv_disk_lost), and
    re-prefill; nothing wrong is ever loaded."""
    result, logs, engine = run(tmp_path, disk_gib=3 * GEOM.bytes_per_block / 2**30)
    check(result)
    assert not engine.errors, engine.errors
    assert {"kv_pool_full", "kv_disk_lost"} & {e["event"] for e in logs}
