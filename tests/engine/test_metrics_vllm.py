"""The daemon's Prometheus metrics with real vLLM engines: what the engines report (load,
KV cache usage, preemptions) and chunks migrating through the host KV pool."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seer.client import SamplingParams, SeerClient
from tests.daemon_helpers import wait_for

pytestmark = pytest.mark.engine


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=60).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


# Prompts no other test sends: no engine's prefix cache holds them, so a chunk that moves
# must take its context from the host KV pool.
METRICS_QUESTIONS = ["Give two reasons why bicycles are popular in cities.",
                     "Describe a quiet morning in a small mountain village."]


def test_real_engines_metrics_move_with_a_migrating_rollout(vllm_daemon):
    """Every chunk of a divided rollout moves to the other engine (placement "migrate"):
    the counters move by exactly its samples, tokens and chunks; every continued chunk
    migrated, and each that loaded its context from the pool is both a pool hit and a
    "pool" migration, with no miss; both engines report their load and vLLM's preemption
    count; the pool's bytes are its blocks times the engines' block size."""
    url = json.loads((vllm_daemon.run_dir / "daemon.json").read_text())["metrics_url"]
    before = scrape(url)
    with SeerClient(vllm_daemon.address, timeout_s=900) as client:
        result = client.rollout([{"messages": [{"role": "user", "content": q}]} for q in METRICS_QUESTIONS],
                                group_size=1, sampling=SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
                                policy="divided")
        geometry = client.status().engines[0].capabilities.kv_geometry
    after = scrape(url)
    stats = result.stats

    def moved(name: str, labels: tuple = ()) -> float:
        if labels:
            return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)
        return total(after, name) - total(before, name)

    num_samples = len(METRICS_QUESTIONS)
    assert moved("seer:samples_total") == stats.num_samples == num_samples
    assert moved("seer:generation_tokens_total") == stats.num_output_tokens == 48 * num_samples
    assert moved("seer:chunks_dispatched_total") == moved("seer:chunks_finished_total") == stats.num_chunks
    continued = stats.num_chunks - num_samples
    assert continued == 2 * num_samples  # chunks of 16 tokens: 3 per sample
    assert moved("seer:chunks_migrated_total") == continued
    pool = moved("seer:chunks_migrated_total", (("mode", "pool"),))
    assert pool >= num_samples  # at least each sample's second chunk: no engine had its prompt
    assert moved("seer:kv_pool_hits_total") == pool and moved("seer:kv_pool_misses_total") == 0
    assert moved("seer:kv_pool_loaded_tokens_total") >= 16 * pool
    for engine_id in ("0", "1"):
        key = (("engine_id", engine_id),)
        assert after[("seer:engine_up", key)] == 1
        assert 0.0 <= after[("seer:engine_kv_cache_usage_perc", key)] <= 1.0
        assert after[("seer:engine_num_preemptions_total", key)] >= 0
        assert after[("seer:engine_chunks_in_flight", key)] == 0
    # The engines' own counts come with their heartbeats (every engines.heartbeat_interval_s):
    # idle again within a few of them.
    wait_for(lambda: total(scrape(url), "seer:engine_num_requests_running") == 0, 120,
             "the engines to report no running request")
    local = (("host", "local"),)
    assert geometry is not None and after[("seer:kv_pool_capacity_blocks", local)] > 0
    assert after[("seer:kv_pool_capacity_bytes", local)] == \
        after[("seer:kv_pool_capacity_blocks", local)] * geometry.bytes_per_block
