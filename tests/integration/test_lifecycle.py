"""Daemon lifecycle and failures: start/stop, refusals, vanished clients, dead engines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from seer.client import AsyncSeerClient, SamplingParams, SeerClient, SeerServiceError
from seer.protocol import (
    ControlMessage,
    EngineCapabilities,
    EngineHello,
    HelloRejected,
)
from seer.wire import VERSION_FRAME, Codec
from tests.daemon_helpers import Daemon, pid_alive, seerctl, shm_entries, write_sim_config, wait_for



def test_start_status_stop_leaves_no_processes_or_shared_memory(tmp_path):
    """seerctl start reports ready engines, refuses a second daemon on the same run dir,
    and seerctl stop leaves no process, socket, daemon.json or /dev/shm segment behind."""
    shm_before = shm_entries()
    daemon = Daemon(tmp_path / "run", write_sim_config(tmp_path / "sim.toml"))
    info = daemon.start()
    status = json.loads(seerctl("status", "--json", "--run-dir", str(daemon.run_dir)).stdout)
    engine_pids = [e["pid"] for e in status["engines"]]
    assert [e["state"] for e in status["engines"]] == ["ready", "ready"]
    assert status["policy"] == "context" and status["weights_version"] == 0
    again = seerctl("start", "--config", str(daemon.config), "--run-dir", str(daemon.run_dir))
    assert again.returncode == 1
    message = " ".join(again.stderr.split())  # the console wraps long lines
    assert "already runs on" in message and "seerctl stop" in message
    stopped = seerctl("stop", "--run-dir", str(daemon.run_dir))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    wait_for(lambda: not any(pid_alive(p) for p in [info["pid"], *engine_pids]), 15, "daemon and engines to exit")
    assert not (daemon.run_dir / "daemon.json").exists()
    assert not (daemon.run_dir / "client.sock").exists()
    assert (daemon.run_dir / "controlplane.log").stat().st_size > 0
    assert shm_entries() - shm_before == set()
    assert seerctl("status", "--run-dir", str(daemon.run_dir)).returncode == 1


def test_bad_config_names_the_key_and_the_file(tmp_path):
    """An unknown key or a wrong type in seer.toml stops start-up with the key, the file
    and the allowed keys."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[engines]\ncount = 2\nnum_gpus = 4\n")
    proc = seerctl("start", "--config", str(bad), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and "engines.num_gpus" in proc.stderr and "kv_cache_gib" in proc.stderr
    bad.write_text('[engines]\ncount = "two"\n')
    proc = seerctl("start", "--config", str(bad), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "engines.count" in proc.stderr and str(bad) in proc.stderr
    assert not (tmp_path / "run" / "daemon.json").exists()


def test_a_vanished_client_has_its_rollout_aborted_and_engines_freed(tmp_path):
    """A client killed mid-rollout stops heart-beating; the daemon aborts its rollout
    (client_timeout_s = 3) and the engines end up with nothing running."""
    daemon = Daemon(tmp_path / "run", write_sim_config(tmp_path / "sim.toml", sim_step_s=0.03))
    daemon.start()
    try:
        # 500 tokens x 30 ms = 15 s of work: far longer than the 3 s client timeout.
        script = (
            "import sys; from seer.client import SeerClient, SamplingParams\n"
            f"c = SeerClient({daemon.address!r})\n"
            "print('started', flush=True)\n"
            "c.rollout(['q'] * 4, 4, SamplingParams(max_tokens=500, ignore_eos=True))\n"
        )
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "started"
        with SeerClient(daemon.address) as client:
            wait_for(lambda: sum(e.load.num_running for e in client.status().engines) == 16, 10, "16 running samples")
            child.send_signal(signal.SIGKILL)
            child.wait()
            wait_for(lambda: not client.status().rollouts, 15, "the rollout to be aborted")
            wait_for(lambda: sum(e.load.num_running for e in client.status().engines) == 0, 10, "engines to be freed")
            ok = client.rollout(["after"], 2, SamplingParams(max_tokens=4))
            assert len(ok.groups[0].samples) == 2
        log = (daemon.run_dir / "controlplane.log").read_text()
        assert '"client_lost"' in log and '"rollout_aborted"' in log
    finally:
        daemon.stop()


def test_an_engine_killed_mid_rollout_costs_time_not_samples(tmp_path):
    """SIGKILL one of two engines during a rollout: every sample still comes back exactly
    once, status shows the engine lost, and the log says why."""
    daemon = Daemon(tmp_path / "run", write_sim_config(tmp_path / "sim.toml", sim_step_s=0.01))
    daemon.start()
    try:
        with SeerClient(daemon.address) as client:
            victim = next(e for e in client.status().engines if e.engine_id == 1).pid
            import threading

            def kill_later() -> None:
                time.sleep(0.5)
                os.killpg(victim, signal.SIGKILL)

            threading.Thread(target=kill_later).start()
            # 400 tokens x 10 ms = 4 s per sample: the kill at 0.5 s lands mid-rollout.
            result = client.rollout([f"q{i}" for i in range(6)], 3,
                                    SamplingParams(max_tokens=400, ignore_eos=True, seed=3))
            assert [g.group_index for g in result.groups] == list(range(6))
            assert all(len(g.samples) == 3 and all(len(s.token_ids) == 400 for s in g.samples)
                       for g in result.groups)
            states = {e.engine_id: e.state for e in client.status().engines}
            assert states == {0: "ready", 1: "lost"}
            moved = [s for g in result.groups for s in g.samples if s.engine_ids == [1, 0]]
            assert moved, "some samples should have been re-dealt from the dead engine"
        assert '"engine_lost"' in (daemon.run_dir / "controlplane.log").read_text()
    finally:
        daemon.stop()


def test_losing_every_engine_fails_the_rollout_fast_with_a_clear_error(tmp_path):
    """With all engines dead the client gets an error naming the cause, not a hang."""
    daemon = Daemon(tmp_path / "run", write_sim_config(tmp_path / "sim.toml", sim_step_s=0.02, count=1))
    daemon.start()
    try:
        with SeerClient(daemon.address, timeout_s=30) as client:
            pid = client.status().engines[0].pid
            import threading

            threading.Thread(target=lambda: (time.sleep(0.5), os.killpg(pid, signal.SIGKILL))).start()
            t0 = time.monotonic()
            with pytest.raises(SeerServiceError) as info:
                client.rollout(["q"] * 2, 2, SamplingParams(max_tokens=400, ignore_eos=True))
            assert time.monotonic() - t0 < 15
            assert info.value.code == "no_engines" and "every engine is lost" in info.value.message
            with pytest.raises(SeerServiceError) as info:
                client.rollout(["q"], 1)
            assert info.value.code == "no_engines"
    finally:
        daemon.stop()


def test_an_engine_with_another_protocol_version_is_refused(sim_daemon):
    """An engine whose hello carries a different protocol version is told why and is
    not registered."""
    info = json.loads((sim_daemon.run_dir / "daemon.json").read_text())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"engine-7")
    sock.connect(info["engine_address"])
    try:
        caps = EngineCapabilities(backend="sim", model="x", dtype="none", max_model_len=512, vocab_size=259,
                                  kv_capacity_tokens=1000, block_size=16)
        hello = EngineHello(engine_id=7, protocol_version=99, pid=1, capabilities=caps, weights_version=0)
        sock.send_multipart([VERSION_FRAME, msgspec.msgpack.encode(hello)])
        assert sock.poll(5000)
        reply = Codec(ControlMessage).decode(sock.recv_multipart())
        assert isinstance(reply, HelloRejected) and "protocol 99" in reply.reason
        sock.send_multipart([b"seer/0", msgspec.msgpack.encode(hello)])
        assert sock.poll(5000)
        reply = Codec(ControlMessage).decode(sock.recv_multipart())
        assert isinstance(reply, HelloRejected) and "seer/0" in reply.reason
    finally:
        sock.close(0)
        ctx.term()
    with SeerClient(sim_daemon.address) as client:
        assert 7 not in {e.engine_id for e in client.status().engines}


def test_a_client_that_stops_iterating_cancels_its_rollout(sim_daemon):
    """Breaking out of stream_rollout cancels the rest of the rollout on the daemon."""
    import asyncio

    async def go():
        async with AsyncSeerClient(sim_daemon.address) as client:
            stream = client.stream_rollout([f"q{i}" for i in range(8)], 2,
                                           SamplingParams(max_tokens=300, ignore_eos=True))
            iterator = stream.__aiter__()
            await iterator.__anext__()
            await iterator.aclose()
            for _ in range(50):
                if not (await client.status()).rollouts:
                    return True
                await asyncio.sleep(0.1)
            return False

    assert asyncio.run(go())


def test_a_request_that_keeps_failing_fails_its_rollout_with_the_engine_error(tmp_path):
    """A chunk that fails on every engine is retried, then the rollout fails with
    `request_failed` naming the request and the engine's error — no endless retry loop."""
    config = write_sim_config(tmp_path / "sim.toml", sim_fault_token_id=77)
    daemon = Daemon(tmp_path / "run", config)
    daemon.start()
    try:
        with SeerClient(daemon.address, timeout_s=20) as client:
            with pytest.raises(SeerServiceError) as info:
                client.rollout([[5, 77, 6]], 1, SamplingParams(max_tokens=8))
            assert info.value.code == "request_failed"
            assert "failed 3 times" in info.value.message and "injected fault" in info.value.message
            ok = client.rollout([[5, 6]], 2, SamplingParams(max_tokens=8))
            assert len(ok.groups[0].samples) == 2
            assert [e.state for e in client.status().engines] == ["ready", "ready"]
    finally:
        daemon.stop()


def test_an_engine_whose_backend_dies_exits_instead_of_failing_work_forever(tmp_path):
    """A backend that dies on a chunk makes its worker exit, so the engine is declared
    lost; a poison request that kills every engine it touches ends the rollout with a
    clear error instead of a retry loop."""
    config = write_sim_config(tmp_path / "sim.toml", sim_fault_token_id=77, sim_fault_kills_engine=True)
    daemon = Daemon(tmp_path / "run", config)
    daemon.start()
    try:
        with SeerClient(daemon.address, timeout_s=20) as client:
            t0 = time.monotonic()
            with pytest.raises(SeerServiceError) as info:
                client.rollout([[5, 77, 6]], 1, SamplingParams(max_tokens=8))
            assert time.monotonic() - t0 < 15
            assert info.value.code in ("no_engines", "request_failed")
            wait_for(lambda: [e.state for e in client.status().engines] == ["lost", "lost"], 10,
                  "both engines to be declared lost")
        for engine_id in (0, 1):
            assert '"engine_backend_died"' in (daemon.run_dir / f"engine-{engine_id}.log").read_text()
    finally:
        daemon.stop()


def test_the_daemon_serves_clients_and_engines_over_tcp(tmp_path):
    """With tcp:// addresses in seer.toml (loopback), engines register and a client rolls
    out over TCP exactly as over ipc."""
    from tests.daemon_helpers import free_tcp_port

    client_addr = f"tcp://127.0.0.1:{free_tcp_port()}"
    engine_addr = f"tcp://127.0.0.1:{free_tcp_port()}"
    config = write_sim_config(tmp_path / "sim.toml",
                              server={"client_address": client_addr, "engine_address": engine_addr,
                                      "allow_insecure_tcp": True})
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    try:
        assert info["client_address"] == client_addr and info["engine_address"] == engine_addr
        with SeerClient(client_addr) as client:
            assert [e.state for e in client.status().engines] == ["ready", "ready"]
            result = client.rollout(["over tcp"] * 3, 2, SamplingParams(max_tokens=8))
            assert sum(len(g.samples) for g in result.groups) == 6
    finally:
        daemon.stop()
