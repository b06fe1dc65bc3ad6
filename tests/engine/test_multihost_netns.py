"""Two real vLLM engines on two "hosts": network namespaces joined by a veth pair that
the test creates (``ip netns add``; skipped, with the reason, where that is not allowed).

Host A runs the daemon (CURVE-keyed tcp:// engine address on the veth) and its spawned
engine; the daemon's kvpool/segment.py creates A's pool and starts A's agent. Host B runs an engine
joined with ``seerctl engine --join tcp://...`` and the keys; the join path creates B's
pool and agent. ``placement = "migrate"`` moves every chunk to the other host, so the
KV of every continuation is pulled between the hosts' pools by the agents (transport
"tcp", over the veth) before the chunk runs. The samples must equal vLLM's one-shot
``LLM.generate`` token for token.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seer.auth import generate_keys
from seer.client import SamplingParams, SeerClient
from seer.process import stop_process
from tests.daemon_helpers import SEERCTL, wait_for
from tests.engine.conftest import vllm_config

MAX_TOKENS = 40
CHUNK = 16


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces A and B, veth between them (10.232.N.1 in A, .2 in B), lo up in both."""
    tag = secrets.token_hex(3)
    a, b = f"seerh2{tag}a", f"seerh2{tag}b"
    probe = _ip("netns", "add", a, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here (`ip netns add` failed: {probe.stderr.strip()})")
    net = 1 + int(tag, 16) % 250
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"vh2{tag}a", "type", "veth", "peer", "name", f"vh2{tag}b")
        for ns, dev, addr in ((a, f"vh2{tag}a", f"10.232.{net}.1/24"), (b, f"vh2{tag}b", f"10.232.{net}.2/24")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, f"10.232.{net}.1"
    finally:
        for ns in (a, b):
            _ip("netns", "del", ns, check=False)


def _config(path: Path, keys: dict[str, Path], engine_address: str) -> Path:
    return vllm_config(path, engines=1, extra=f"""cpu_binding = "none"

[server]
engine_address = "{engine_address}"
curve_server_secret_key = "{keys['server_secret']}"
curve_authorized_keys = "{keys['authorized']}"
curve_server_public_key = "{keys['server_public']}"
curve_client_secret_key = "{keys['client_secret']}"

[scheduler]
policy = "divided"
chunk_size_tokens = {CHUNK}
placement = "migrate"

[kv_pool]
pool_gib = 0.25
min_load_tokens = 1
transport = "tcp"
""")


def _events(log: Path, name: str) -> list[dict]:
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == name]


@pytest.mark.timeout(2400)  # two vLLM starts on a shared 2-core machine: minutes each under load
def test_chunks_migrating_between_hosts_pull_kv_over_tcp_and_equal_vllm_generate(
        two_hosts, tmp_path, model_dir, migration_prompts, migration_reference):
    """Every continuation runs on the other host; before it runs, its prefix's KV is pulled
    from the other host's pool (kv_transferred, bytes > 0, transport tcp), the engine loads
    it (kv_loaded_tokens > 0) and computes only the last prompt token; the samples equal
    one-shot LLM.generate token for token with logprobs within 1e-4."""
    ns_a, ns_b, ip_a = two_hosts
    keys = generate_keys(tmp_path / "keys")
    port = 20000 + secrets.randbelow(20000)
    config = _config(tmp_path / "seer.toml", keys, f"tcp://{ip_a}:{port}")
    run_dir = tmp_path / "run"
    join_log = tmp_path / "join" / "engine.log"
    join_log.parent.mkdir()
    # The joining engine starts first (it says hello until a control plane answers), so the
    # two vLLM start-ups overlap.
    with open(join_log.with_suffix(".out"), "wb") as out:
        joined = subprocess.Popen(["ip", "netns", "exec", ns_b, *SEERCTL, "engine", "--join",
                                   f"tcp://{ip_a}:{port}", "--config", str(config), "--log-file", str(join_log)],
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1"})
    cp_log = run_dir / "controlplane.log"
    try:
        # One core per host's engine: with the daemon's "auto" binding its one engine would
        # take both cores and its OpenMP threads would wait on the core B's engine keeps busy.
        start = subprocess.run(["ip", "netns", "exec", ns_a, *SEERCTL, "start", "--config", str(config),
                                "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=1200,
                               env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"})
        assert start.returncode == 0, start.stderr + start.stdout
        with SeerClient(run_dir=run_dir, timeout_s=120) as client:
            wait_for(lambda: sum(e.state == "ready" for e in client.status().engines) == 2, 1200,
                     f"the joined engine on host B (see {join_log.with_suffix('.out')})")
            wait_for(lambda: len(_events(cp_log, "kv_agent_registered")) >= 2, 120, "both hosts' agents")
            hosts = {e["host_id"] for e in _events(cp_log, "engine_ready")}
            assert len(hosts) == 2, hosts
            result = client.rollout([{"prompt_token_ids": p} for p in migration_prompts], group_size=1,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                    policy="divided", timeout_s=900)
        for group, ref in zip(result.groups, migration_reference):
            (sample,) = group.samples
            assert sample.token_ids == ref["token_ids"][:MAX_TOKENS], f"prompt {group.prompt_id}"
            assert max(abs(x - y) for x, y in zip(sample.logprobs, ref["logprobs"])) < 1e-4
            assert len(set(sample.engine_ids)) == 2
        moved = [e for e in _events(cp_log, "kv_transferred") if e.get("rollout_id") == result.rollout_id]
        assert len(moved) >= len(migration_prompts), _events(cp_log, "kv_transfer_failed")
        for event in moved:
            assert event["from_host"] != event["to_host"] and event["transport"] == "tcp", event
            assert event["num_bytes"] > 0 and event["num_blocks"] > 0, event
        migrated = [e for e in _events(cp_log, "chunk_migrated") if e.get("rollout_id") == result.rollout_id]
        assert migrated and all(e["mode"] == "pool" and e["kv_loaded_tokens"] > 0 for e in migrated), migrated
        assert all(e["reprefill_tokens"] == 1 for e in migrated), migrated
    finally:
        stop_process(joined, 60)
        subprocess.run([*SEERCTL, "stop", "--run-dir", str(run_dir)], capture_output=True, timeout=120)
    # Both hosts' agents are gone with their engines / daemon, and so are their segments.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            Path("/dev/shm", e["pool"]).exists() for e in _events(cp_log, "kv_agent_registered")):
        time.sleep(0.5)
    assert not [e["pool"] for e in _events(cp_log, "kv_agent_registered") if Path("/dev/shm", e["pool"]).exists()]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
