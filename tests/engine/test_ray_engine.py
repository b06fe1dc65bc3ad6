"""One real vLLM engine placed by the Ray launcher: it joins over CURVE TCP from its actor,
generates, shows where it runs, and leaves nothing on the cluster at stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemon_helpers import curve_tcp_server, local_ray_cluster, pid_alive, seerctl, wait_for

pytestmark = pytest.mark.engine
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_address():
    with local_ray_cluster(num_cpus=2) as address:
        yield address


def _config(root: Path, address: str) -> Path:
    assert seerctl("keys", str(root / "keys")).returncode == 0
    server = "".join(f"{k} = {json.dumps(v)}\n" for k, v in curve_tcp_server().items())
    path = root / "seer.toml"
    path.write_text(f"""
[model]
dtype = "float32"
max_model_len = 512

[engines]
backend = "vllm"
count = 1
kv_cache_gib = 1.0

[server]
{server}
[kv_pool]
pool_gib = 0.25

[cluster]
launcher = "ray"
address = "{address}"
cpus_per_engine = 1.0
""")
    return path


def test_a_real_engine_in_a_ray_actor_serves_a_rollout(ray_address, model_dir, tmp_path):
    """vLLM in a Ray actor joins, answers a tiny rollout, shows its node IP and actor id; stop removes it all."""
    run_dir = tmp_path / "run"
    proc = seerctl("start", "--config", str(_config(tmp_path, ray_address)), "--run-dir", str(run_dir), timeout=900)
    try:
        assert proc.returncode == 0, proc.stderr + proc.stdout
        status = json.loads(seerctl("status", "--run-dir", str(run_dir), "--json").stdout)
        [engine] = status["engines"]
        assert engine["state"] == "ready" and engine["capabilities"]["backend"] == "vllm"
        assert engine["node_ip"] and engine["ray_actor_id"]
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(json.dumps({"id": "q", "prompt": "Name three primary colors."}) + "\n")
        out = tmp_path / "out.jsonl"
        rollout = seerctl("rollout", "--run-dir", str(run_dir), "--prompts", str(prompts), "--group-size", "2",
                          "--max-tokens", "8", "--temperature", "0", "--out", str(out), timeout=600)
        assert rollout.returncode == 0, rollout.stderr + rollout.stdout
        [row] = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(row["samples"]) == 2 and all(s["token_ids"] and s["text"] for s in row["samples"])
        assert {e for s in row["samples"] for e in s["engine_ids"]} == {engine["engine_id"]}
    finally:
        stopped = seerctl("stop", "--run-dir", str(run_dir), timeout=300)
    assert stopped.returncode == 0
    wait_for(lambda: not pid_alive(engine["pid"]), 120, "the engine process to exit")
    groups = [g for g in ray.util.placement_group_table().values()
              if g["name"] == f"seer-{status['pid']}" and g["state"] != "REMOVED"]
    assert groups == []
