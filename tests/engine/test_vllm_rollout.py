"""Seer on real vLLM engines (two engine processes, float32, SmolLM2-135M-Instruct).

Kept short: every generation here is at most 48 tokens. The daemon is shared by the
whole module and stopped by the last test, which checks nothing is left behind.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from seer.client import SamplingParams, SeerClient, SeerServiceError
from tests.daemon_helpers import pid_alive, shm_entries
from tests.engine.conftest import MAX_MODEL_LEN, QUESTIONS

pytestmark = pytest.mark.engine

def test_greedy_through_seer_equals_vllm_generate(vllm_daemon, chat_prompts, reference_outputs):
    """Greedy (float32) samples from Seer are token-identical to vLLM's own LLM.generate
    for the same prompts, with the same per-token logprobs, on both engines."""
    with SeerClient(vllm_daemon.address, timeout_s=120) as client:
        result = client.rollout([{"id": str(i), "prompt_token_ids": p} for i, p in enumerate(chat_prompts)],
                                group_size=2, sampling=SamplingParams(temperature=0.0, max_tokens=48))
    assert len(result.groups) == len(reference_outputs) == 4
    engines_used = set()
    for group, ref in zip(result.groups, reference_outputs):
        assert len(ref["token_ids"]) > 0
        for sample in group.samples:
            engines_used.update(sample.engine_ids)
            assert sample.token_ids == ref["token_ids"][:48], f"prompt {group.prompt_id} sample {sample.sample_index}"
            assert len(sample.logprobs) == len(sample.token_ids)
            assert max(abs(a - b) for a, b in zip(sample.logprobs, ref["logprobs"])) < 1e-3
    assert engines_used == {0, 1}


def _events(run_dir: Path, event: str, rollout_id: str) -> list[dict]:
    lines = (run_dir / "controlplane.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == event and e.get("rollout_id") == rollout_id]


@pytest.mark.parametrize("policy", ["divided", "context"])
def test_chunked_policies_on_real_engines_equal_vllm_generate(vllm_daemon, chat_prompts, reference_outputs, policy):
    """Generated in chunks of 16 tokens, every chunk on the other engine than the one
    before (placement "migrate"), greedy float32 samples equal vLLM's one-shot
    LLM.generate token for token with logprobs within 1e-4, and every chunk that moved
    computed only its last prompt token (the rest came from the host KV pool or the
    engine's own prefix cache)."""
    with SeerClient(vllm_daemon.address, timeout_s=120) as client:
        result = client.rollout([{"prompt_token_ids": p} for p in chat_prompts], group_size=2,
                                sampling=SamplingParams(temperature=0.0, max_tokens=48), policy=policy)
    assert result.stats.num_chunks > result.stats.num_samples == 8
    for group, ref in zip(result.groups, reference_outputs):
        for sample in group.samples:
            assert sample.token_ids == ref["token_ids"][:48], f"{policy}: prompt {group.prompt_id}"
            assert max(abs(a - b) for a, b in zip(sample.logprobs, ref["logprobs"])) < 1e-4
    migrated = _events(vllm_daemon.run_dir, "chunk_migrated", result.rollout_id)
    assert migrated and all(e["reprefill_tokens"] == 1 for e in migrated), migrated


def test_a_seeded_sample_is_the_same_under_every_policy(vllm_daemon, chat_prompts):
    """Schedule-invariant seeded sampling: at temperature 1.0 with a seed, the baselines
    group and request (one request per sample, on different engines), and divided /
    context (chunks of 16 tokens, every chunk on the other engine) return the same tokens,
    logprobs within 1e-4 (float32 batch noise), and the same finish reasons."""
    sampling = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, seed=4321)
    results = {}
    with SeerClient(vllm_daemon.address, timeout_s=180) as client:
        for policy in ("group", "request", "divided", "context"):
            results[policy] = client.rollout([{"prompt_token_ids": p} for p in chat_prompts[:3]], group_size=3,
                                             sampling=sampling, policy=policy)
    assert results["divided"].stats.num_chunks > results["group"].stats.num_chunks == 9
    base = [s for g in results["group"].groups for s in g.samples]
    assert len({tuple(s.token_ids) for s in base}) > 1  # sampled, not all alike
    for policy in ("request", "divided", "context"):
        other = [s for g in results[policy].groups for s in g.samples]
        assert [s.token_ids for s in other] == [s.token_ids for s in base], policy
        assert [s.finish_reason for s in other] == [s.finish_reason for s in base], policy
        for a, b in zip(other, base):
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4, policy
        if policy != "request":
            assert any(len(s.engine_ids) > 1 for s in other)  # chunks did move between engines


def test_chunks_migrating_through_the_kv_pool_equal_vllm_generate(vllm_daemon, migration_prompts,
                                                                  migration_reference):
    """Prompts the engines have never seen, one sample each, 64 tokens in chunks of 16,
    every chunk on the other engine: each continuation loads its prefix's KV from the
    host pool (bytes and load time logged as chunk_migrated), computes only its last
    prompt token, and the samples equal one-shot LLM.generate token for token with
    logprobs within 1e-4."""
    with SeerClient(vllm_daemon.address, timeout_s=120) as client:
        result = client.rollout([{"prompt_token_ids": p} for p in migration_prompts], group_size=1,
                                sampling=SamplingParams(temperature=0.0, max_tokens=64), policy="divided")
    for group, ref in zip(result.groups, migration_reference):
        (sample,) = group.samples
        assert sample.token_ids == ref["token_ids"], f"prompt {group.prompt_id}"
        assert max(abs(a - b) for a, b in zip(sample.logprobs, ref["logprobs"])) < 1e-4
        if len(sample.token_ids) > 16:
            assert len(sample.engine_ids) >= 2  # it did move
    migrated = _events(vllm_daemon.run_dir, "chunk_migrated", result.rollout_id)
    assert len(migrated) >= len(migration_prompts)
    for event in migrated:
        assert event["mode"] == "pool", event
        assert event["kv_loaded_tokens"] >= 16 and event["num_bytes"] == event["kv_loaded_tokens"] * 46080, event
        assert event["reprefill_tokens"] == 1, event


def test_stop_string_straddling_a_chunk_edge_ends_the_sample_like_one_shot(vllm_daemon, model_dir, chat_prompts,
                                                                          reference_outputs):
    """A stop string made of the text around the 16-token chunk edge (tokens 14..17 of
    the longest greedy answer) ends the divided-policy sample exactly where vLLM's own stop-string
    check ends the unchunked `group` sample: same tokens, reason "stop"."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    i = max(range(len(reference_outputs)), key=lambda k: len(reference_outputs[k]["token_ids"]))
    ref = reference_outputs[i]["token_ids"]
    assert len(ref) >= 24
    stop = tok.decode(ref[14:18])
    assert stop.strip() and stop not in tok.decode(ref[:17])  # first completed by token 17, not before
    sampling = SamplingParams(temperature=0.0, max_tokens=48, stop=[stop])
    with SeerClient(vllm_daemon.address, timeout_s=120) as client:
        one_shot = client.rollout([{"prompt_token_ids": chat_prompts[i]}], 1, sampling, policy="group")
        chunked = client.rollout([{"prompt_token_ids": chat_prompts[i]}], 1, sampling, policy="divided")
    (a,), (b,) = one_shot.groups[0].samples, chunked.groups[0].samples
    assert a.finish_reason == b.finish_reason == "stop"
    assert b.token_ids == a.token_ids == ref[:len(a.token_ids)]
    assert 17 <= len(a.token_ids) <= 18


def test_sampled_rollout_returns_16_samples_in_order_with_valid_logprobs(vllm_daemon):
    """4 chat prompts x G=4 at temperature 1 give 16 samples in prompt and sample
    order; every logprob is finite and <= 0; texts decode; siblings differ."""
    prompts = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS)]
    with SeerClient(vllm_daemon.address, timeout_s=120) as client:
        result = client.rollout(prompts, group_size=4, sampling=SamplingParams(max_tokens=32, seed=11))
    assert [g.prompt_id for g in result.groups] == ["q0", "q1", "q2", "q3"]
    assert sum(len(g.samples) for g in result.groups) == 16
    for group in result.groups:
        assert [s.sample_index for s in group.samples] == [0, 1, 2, 3]
        assert len({tuple(s.token_ids) for s in group.samples}) > 1
        for s in group.samples:
            assert 1 <= len(s.token_ids) <= 32 and len(s.logprobs) == len(s.token_ids)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            assert s.text.strip()
            assert s.num_prompt_tokens > 10
    stats = result.stats
    assert stats.num_output_tokens == sum(len(s.token_ids) for g in result.groups for s in g.samples)
    assert stats.throughput_tokens_per_s > 0 and stats.wall_time_s > 0


def test_chat_prompts_use_the_model_chat_template(vllm_daemon, chat_prompts):
    """A `messages` prompt is tokenised exactly as the model's chat template with the
    generation prompt (same token count as apply_chat_template)."""
    with SeerClient(vllm_daemon.address, timeout_s=120) as client:
        result = client.rollout([{"messages": [{"role": "user", "content": QUESTIONS[0]}]}], group_size=1,
                                sampling=SamplingParams(temperature=0.0, max_tokens=4))
    assert result.groups[0].samples[0].num_prompt_tokens == len(chat_prompts[0])


def test_prompt_longer_than_the_model_allows_is_refused(vllm_daemon):
    """A prompt over the engines' max_model_len is refused with the numbers and the fix."""
    with SeerClient(vllm_daemon.address, timeout_s=60) as client:
        with pytest.raises(SeerServiceError) as info:
            client.rollout([{"prompt_token_ids": [42] * (MAX_MODEL_LEN + 5)}], group_size=1)
        assert info.value.code == "prompt_too_long"
        assert str(MAX_MODEL_LEN + 5) in info.value.message and "max_model_len" in info.value.message
        with pytest.raises(SeerServiceError) as info:
            client.rollout([{"prompt_token_ids": [42, 99999999]}], group_size=1)
        assert info.value.code == "bad_token_ids" and "49152" in info.value.message


def test_update_weights_in_place_keeps_serving_the_same_model(vllm_daemon, model_dir, chat_prompts):
    """Reloading the model's own checkpoint bumps the weights version on every engine
    without a restart, and greedy output is unchanged afterwards."""
    sampling = SamplingParams(temperature=0.0, max_tokens=16)
    with SeerClient(vllm_daemon.address, timeout_s=120) as client:
        pids = [e.pid for e in client.status().engines]
        before = client.rollout([chat_prompts[0]], 1, sampling)
        version = client.update_weights(model_dir / "model.safetensors")
        status = client.status()
        assert version == before.weights_version + 1 == status.weights_version
        assert [e.pid for e in status.engines] == pids
        assert all(e.weights_version == version for e in status.engines)
        after = client.rollout([chat_prompts[0]], 1, sampling)
        assert after.weights_version == version
        assert after.groups[0].samples[0].token_ids == before.groups[0].samples[0].token_ids
        with pytest.raises(SeerServiceError) as info:
            client.update_weights(model_dir / "config.json")
        assert info.value.code == "weights_update_failed"


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def test_zz_stop_leaves_no_processes_or_shared_memory(vllm_daemon):
    """Stopping the real daemon ends the control plane, both engine processes and every
    vLLM helper process they started, and leaves no /dev/shm segment behind."""
    with SeerClient(vllm_daemon.address) as client:
        status = client.status()
    processes = {status.pid}
    for engine in status.engines:
        processes |= {engine.pid} | _descendants(engine.pid)
    assert len(processes) >= 5  # control plane + 2 engines + their vLLM engine-core processes
    vllm_daemon.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(pid_alive(p) for p in processes):
        time.sleep(0.2)
    assert [p for p in processes if pid_alive(p)] == []
    assert shm_entries() - vllm_daemon.shm_before == set()
