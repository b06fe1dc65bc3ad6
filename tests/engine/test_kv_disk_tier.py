"""The host pool's disk tier under a real-vLLM daemon: a pool too small for the rollout's
KV, a disk tier too small for all of it (disk-full events), every chunk moved to the
other engine; greedy float32 samples equal one-shot ``LLM.generate`` token for token.

Own daemon (two vLLM engines, float32 SmolLM2, chunks of 16, at most one chunk in flight
per engine so the other requests wait with their KV in the pool or on disk). Costs the
two engine start-ups (~1-3 min on a loaded 2-core machine) plus a 64-token rollout of 6
samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seer.client import SamplingParams, SeerClient
from tests.daemon_helpers import Daemon
from tests.engine.conftest import vllm_config

pytestmark = pytest.mark.engine

BLOCK = 32 * 46080  # bytes of one pool block of SmolLM2 float32 KV (32 tokens)


@pytest.fixture(scope="module")
def disk_daemon(tmp_path_factory: pytest.TempPathFactory, all_references):
    """Depends on the references so vLLM's reference run is over before these engines start."""
    root = tmp_path_factory.mktemp("vllm-disk")
    (root / "kvdisk").mkdir()
    config = root / "seer.toml"
    # Pool: 10 blocks (two chunks in flight need up to 2 x 4); disk: 6 blocks, less than
    # the waiting requests' KV, so some spills are refused (kv_pool_full: re-prefill).
    vllm_config(config, extra=f"""
[scheduler]
policy = "divided"
chunk_size_tokens = 16
placement = "migrate"
max_chunks_per_engine = 1

[kv_pool]
pool_gib = {10.5 * BLOCK / 2**30!r}
min_load_tokens = 1
disk_path = "kvdisk"
disk_gib = {6.5 * BLOCK / 2**30!r}
""")
    daemon = Daemon(root / "run", config)
    daemon.start()
    yield daemon
    daemon.stop()
    assert not list((root / "kvdisk").iterdir()), "the disk tier file outlived the daemon"


def test_samples_through_the_disk_tier_and_a_full_disk_equal_vllm_generate(disk_daemon, migration_prompts,
                                                                           migration_reference):
    """3 prompts x 2 samples, 64 greedy tokens: KV is spilled to and staged from disk,
    some chunks find pool and disk full and re-prefill (kv_pool_full / kv_disk_lost),
    and every sample equals one-shot LLM.generate."""
    with SeerClient(disk_daemon.address, timeout_s=600) as client:
        result = client.rollout([{"prompt_token_ids": p} for p in migration_prompts], group_size=2,
                                sampling=SamplingParams(temperature=0.0, max_tokens=64), policy="divided")
    for group, ref in zip(result.groups, migration_reference):
        for sample in group.samples:
            assert sample.token_ids == ref["token_ids"], f"prompt {group.prompt_id} sample {sample.sample_index}"
    lines = (Path(disk_daemon.run_dir) / "controlplane.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    names = [e["event"] for e in events]
    assert "kv_disk_created" in names
    assert names.count("kv_disk_spilled") > 0 and names.count("kv_disk_staged") > 0, "the disk tier was not used"
    assert {"kv_pool_full", "kv_disk_lost"} & set(names), "no disk-full event: the test did not cover it"
    assert not [e for e in events if e["event"] in ("kv_disk_spill_failed", "kv_disk_stage_failed")]
