"""Engines placed on a local Ray cluster (``[cluster] launcher = "ray"``) with simulated engines.

One Ray cluster (``ray.init(num_cpus=3)`` in this process, the tests' driver) and one
daemon serve the module: Ray's start costs seconds and ~0.7 GiB. The tests run in file
order: placement, an actor killed mid-rollout, stop; then a SIGKILLed daemon (its own,
one engine) and the bad-input cases, which start no daemon.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from tests.daemon_helpers import (curve_tcp_server, free_tcp_port, local_ray_cluster, pid_alive, seerctl, wait_for,
                                  write_sim_config)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_address():
    with local_ray_cluster(num_cpus=3) as address:
        yield address


def write_ray_config(root: Path, address: str, count: int = 2, **cluster: object) -> Path:
    """A sim config whose engines run as Ray actors joining over CURVE TCP (keys in root/keys)."""
    if not (root / "keys").exists():
        assert seerctl("keys", str(root / "keys")).returncode == 0
    path = write_sim_config(root / "ray.toml", server=curve_tcp_server(), count=count,
                            sim_step_s=0.05, sim_mean_output_tokens=150)  # ~8 s a sample: a kill lands mid-chunk
    settings = {"launcher": "ray", "address": address, "connect_timeout_s": 30.0, "placement_timeout_s": 60.0,
                **cluster}
    path.write_text(path.read_text() + "\n[cluster]\n" + "".join(f"{k} = {json.dumps(v)}\n"
                                                                 for k, v in settings.items()))
    return path


def status(run_dir: Path) -> dict:
    proc = seerctl("status", "--run-dir", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def seer_groups() -> list[dict]:
    """Placement groups of Seer daemons still known to the cluster and not removed."""
    return [g for g in ray.util.placement_group_table().values()
            if g["name"].startswith("seer-") and g["state"] != "REMOVED"]


def actor_alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace="seer")
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def ray_daemon(ray_address, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-daemon")
    run_dir = root / "run"
    proc = seerctl("start", "--config", str(write_ray_config(root, ray_address)), "--run-dir", str(run_dir),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    yield run_dir
    seerctl("stop", "--run-dir", str(run_dir))


def test_each_engine_runs_in_its_own_actor_and_status_says_where(ray_daemon):
    """Two engines join from two Ray actors of one placement group; status shows node IP and actor id."""
    engines = status(ray_daemon)["engines"]
    assert [e["state"] for e in engines] == ["ready", "ready"]
    assert all(e["node_ip"] for e in engines)
    assert len({e["ray_actor_id"] for e in engines}) == 2 and all(e["ray_actor_id"] for e in engines)
    groups = seer_groups()
    assert len(groups) == 1 and groups[0]["state"] == "CREATED"
    assert [b for b in groups[0]["bundles"].values()] == [{"CPU": 1.0}, {"CPU": 1.0}]
    table = seerctl("status", "--run-dir", str(ray_daemon), env={"COLUMNS": "250"}).stdout
    assert "Ray actor" in table and engines[0]["node_ip"] in table


def test_an_actor_killed_mid_rollout_loses_nothing(ray_daemon, tmp_path):
    """Killing an engine's actor under a rollout: its chunks requeue, a new actor takes its
    bundle and joins, and every sample of every prompt comes back."""
    daemon_pid = status(ray_daemon)["pid"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(8)))
    out = tmp_path / "out.jsonl"
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(proc=seerctl(
        "rollout", "--run-dir", str(ray_daemon), "--prompts", str(prompts), "--group-size", "4",
        "--max-tokens", "200", "--out", str(out), timeout=600)))
    thread.start()
    actor = ray.get_actor(f"seer-{daemon_pid}-engine-0-0", namespace="seer")
    victim = next(e for e in status(ray_daemon)["engines"] if e["ray_actor_id"] == actor._actor_id.hex())

    def victim_busy() -> bool:
        engine = next(e for e in status(ray_daemon)["engines"] if e["engine_id"] == victim["engine_id"])
        return engine["load"]["num_running"] > 0 or not thread.is_alive()

    wait_for(victim_busy, 120, "the rollout to reach the victim engine")
    assert thread.is_alive(), outcome["proc"].stderr
    ray.kill(actor)
    thread.join(600)
    proc = outcome["proc"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(8)] and all(len(r["samples"]) == 4 for r in rows)
    wait_for(lambda: not pid_alive(victim["pid"]), 60, "the killed actor's engine to exit")
    wait_for(lambda: sum(e["state"] == "ready" for e in status(ray_daemon)["engines"]) == 2, 120,
             "the restarted actor's engine to join")
    engines = {e["engine_id"]: e for e in status(ray_daemon)["engines"]}
    assert engines[victim["engine_id"]]["state"] == "lost"
    assert actor_alive(f"seer-{daemon_pid}-engine-0-1") and not actor_alive(f"seer-{daemon_pid}-engine-0-0")
    log = [json.loads(line) for line in (ray_daemon / "controlplane.log").read_text().splitlines()]
    lost = [e for e in log if e["event"] == "engine_lost" and e["engine_id"] == victim["engine_id"]]
    # Lost once, by whichever notices first: the launcher (actor died) or the socket (peer gone).
    assert len(lost) == 1 and lost[0]["num_requeued"] > 0
    restarted = [e for e in log if e["event"] == "engine_actor_restarted"]
    assert [e["slot"] for e in restarted] == [0] and "actor died" in restarted[0]["reason"]


def test_stop_drains_then_removes_the_actors_and_the_placement_group(ray_daemon):
    """`seerctl stop` leaves no engine process, no actor and no placement group on the cluster."""
    before = status(ray_daemon)
    pids = [e["pid"] for e in before["engines"] if e["state"] == "ready"]
    proc = seerctl("stop", "--run-dir", str(ray_daemon))
    assert proc.returncode == 0 and "stopped" in proc.stdout
    wait_for(lambda: not any(pid_alive(p) for p in pids), 60, "the engines to exit")
    assert seer_groups() == []
    assert not any(actor_alive(f"seer-{before['pid']}-engine-{i}-{a}") for i in range(2) for a in range(3))
    log = [json.loads(line) for line in (ray_daemon / "controlplane.log").read_text().splitlines()]
    assert any(e["event"] == "ray_engines_removed" for e in log)


def test_a_killed_daemon_leaves_no_actor_or_placement_group(ray_address, tmp_path):
    """SIGKILL of the daemon (the Ray driver): Ray removes its actors and placement group, and the engine exits."""
    run_dir = tmp_path / "run"
    proc = seerctl("start", "--config", str(write_ray_config(tmp_path, ray_address, count=1)), "--run-dir",
                   str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    before = status(run_dir)
    [engine] = before["engines"]
    assert len(seer_groups()) == 1 and actor_alive(f"seer-{before['pid']}-engine-0-0")
    os.kill(before["pid"], signal.SIGKILL)
    wait_for(lambda: not pid_alive(engine["pid"]), 120, "the engine to exit after its actor")
    wait_for(lambda: seer_groups() == [], 60, "Ray to remove the placement group")
    assert not actor_alive(f"seer-{before['pid']}-engine-0-0")
    seerctl("stop", "--run-dir", str(run_dir))  # removes the stale daemon.json


def test_a_slot_whose_restarts_are_spent_is_given_up(ray_address, tmp_path):
    """max_restarts = 1: the first killed actor is replaced, the second is not; its engine stays lost."""
    run_dir = tmp_path / "run"
    config = write_ray_config(tmp_path, ray_address, count=1, max_restarts=1)
    proc = seerctl("start", "--config", str(config), "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    try:
        daemon_pid = status(run_dir)["pid"]
        ray.kill(ray.get_actor(f"seer-{daemon_pid}-engine-0-0", namespace="seer"))
        wait_for(lambda: actor_alive(f"seer-{daemon_pid}-engine-0-1"), 120, "the replacement actor")
        wait_for(lambda: [e["state"] for e in status(run_dir)["engines"]] == ["lost", "ready"], 120,
                 "the replacement engine to join")
        ray.kill(ray.get_actor(f"seer-{daemon_pid}-engine-0-1", namespace="seer"))
        log = run_dir / "controlplane.log"
        wait_for(lambda: '"engine_actor_given_up"' in log.read_text(), 120, "the launcher to give up")
        wait_for(lambda: [e["state"] for e in status(run_dir)["engines"]] == ["lost", "lost"], 60, "both lost")
        assert not actor_alive(f"seer-{daemon_pid}-engine-0-2")
    finally:
        seerctl("stop", "--run-dir", str(run_dir))
    assert seer_groups() == []


def _start_fails(root: Path, config: Path) -> tuple[str, Path]:
    run_dir = root / "run"
    proc = seerctl("start", "--config", str(config), "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert not (run_dir / "daemon.json").exists()
    assert seerctl("status", "--run-dir", str(run_dir)).returncode == 1  # no daemon
    return lines[0], run_dir


def test_a_ray_address_that_does_not_answer_fails_start_in_one_line(ray_address, tmp_path):
    """Nothing listens at cluster.address: `seerctl start` exits 1 within the connect timeout, naming it."""
    config = write_ray_config(tmp_path, f"127.0.0.1:{free_tcp_port()}", connect_timeout_s=2.0)
    line, _ = _start_fails(tmp_path, config)
    assert "cluster.address" in line and "no Ray cluster answers" in line


def test_an_address_that_accepts_tcp_but_is_not_ray_fails_start_within_the_timeout(ray_address, tmp_path):
    """A port that accepts connections and never speaks Ray: start gives up after connect_timeout_s, in one line."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        config = write_ray_config(tmp_path, f"127.0.0.1:{silent.getsockname()[1]}", connect_timeout_s=3.0)
        line, _ = _start_fails(tmp_path, config)
    assert "cannot join the Ray cluster" in line and "within 3 s" in line


def test_an_unsatisfiable_placement_group_fails_start_and_is_removed(ray_address, tmp_path):
    """Bundles larger than the cluster stay pending: start exits 1 naming the resources, and the group is removed."""
    config = write_ray_config(tmp_path, ray_address, cpus_per_engine=64.0, placement_timeout_s=3.0)
    line, _ = _start_fails(tmp_path, config)
    assert "stayed pending" in line and "cluster.cpus_per_engine" in line
    assert seer_groups() == []


def test_auto_without_a_cluster_on_this_host_names_the_fix(tmp_path, monkeypatch):
    """address = "auto" with no RAY_ADDRESS and no recorded cluster: a LaunchError naming `ray start --head`."""
    from seer.cli import ray_launcher

    monkeypatch.setattr(ray_launcher, "RAY_CURRENT_CLUSTER", tmp_path / "none")
    with pytest.raises(ray_launcher.LaunchError, match="ray start --head"):
        ray_launcher.resolve_address("auto", {})
    assert ray_launcher.resolve_address("auto", {"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
