"""CURVE on tcp:// (loopback): keyed clients and engines get in, everyone else is refused and logged."""

from __future__ import annotations

import json
import subprocess

import pytest

from seer.auth import ClientKeys, generate_keys
from seer.client import SamplingParams, SeerClient, SeerTimeoutError
from tests.daemon_helpers import SEERCTL, Daemon, curve_tcp_server, seerctl, wait_for, write_sim_config



def _refusals(run_dir) -> list[dict]:
    events = [json.loads(line) for line in (run_dir / "controlplane.log").read_text().splitlines()]
    return [e for e in events if e.get("event") == "peer_refused"]


@pytest.fixture(scope="module")
def curve_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("curve")
    proc = seerctl("keys", str(root / "keys"))
    assert proc.returncode == 0, proc.stderr
    keys = root / "keys"
    server = curve_tcp_server()
    daemon = Daemon(root / "run", write_sim_config(root / "curve.toml", server=server, count=1))
    info = daemon.start()
    yield daemon, info, keys
    daemon.stop()


def test_keyed_clients_and_engines_work_over_tcp(curve_daemon):
    """With CURVE keys the spawned engine registers over tcp, a keyed client rolls out,
    and `seerctl status` finds its keys through daemon.json."""
    daemon, info, keys = curve_daemon
    assert info["client_address"].startswith("tcp://") and info["engine_address"].startswith("tcp://")
    with SeerClient(info["client_address"], keys=ClientKeys.from_dir(keys)) as client:
        assert [e.state for e in client.status().engines] == ["ready"]
        result = client.rollout(["over curve"] * 3, 2, SamplingParams(max_tokens=8))
        assert sum(len(g.samples) for g in result.groups) == 6
    status = seerctl("status", "--json", "--run-dir", str(daemon.run_dir))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["engines"][0]["state"] == "ready"


def test_clients_without_or_with_wrong_keys_are_refused_and_logged(curve_daemon, tmp_path):
    """A plain client, a client whose key is not authorized and a client that has the
    wrong server key all time out without being served; the daemon logs peer_refused."""
    daemon, info, keys = curve_daemon
    address = info["client_address"]
    with SeerClient(address, timeout_s=3) as plain, pytest.raises(SeerTimeoutError):
        plain.status()
    # Which side notices the mechanism mismatch first is a race: the reason may be either.
    wait_for(lambda: any(e["reason"].startswith("handshake failed") for e in _refusals(daemon.run_dir)),
          15, "the keyless client to be logged")
    stranger = generate_keys(tmp_path / "stranger")  # a valid keypair the server never authorized
    with SeerClient(address, timeout_s=3, keys=ClientKeys(keys / "server.key", stranger["client_secret"])) as c:
        with pytest.raises(SeerTimeoutError):
            c.status()
    wait_for(lambda: any(e["reason"] == "client key not in the authorized keys" for e in _refusals(daemon.run_dir)),
          15, "the unauthorized key to be logged")
    wrong_server = ClientKeys(stranger["server_public"], keys / "client.key_secret")
    with SeerClient(address, timeout_s=3, keys=wrong_server) as c, pytest.raises(SeerTimeoutError):
        c.status()
    wait_for(lambda: any("another server key" in e["reason"] for e in _refusals(daemon.run_dir)),
          15, "the client with the wrong server key to be logged")
    refused = [e for e in _refusals(daemon.run_dir) if e["reason"] == "client key not in the authorized keys"]
    assert refused[0]["client_key"] == stranger["client_public"].read_text().split('public-key = "')[1][:40]
    assert refused[0]["peer_address"] == "127.0.0.1"
    with SeerClient(address, keys=ClientKeys.from_dir(keys)) as client:  # the daemon still serves keyed clients
        assert client.status().engines


def test_an_engine_joins_over_tcp_with_keys_and_a_keyless_one_is_refused(curve_daemon, tmp_path):
    """`seerctl engine --join tcp://...` with the client keys registers and takes work;
    without keys the command refuses to connect unless allow_insecure_tcp is set."""
    daemon, info, keys = curve_daemon
    config = daemon.config
    joined = subprocess.Popen([*SEERCTL, "engine", "--join", info["engine_address"], "--config", str(config),
                               "--log-file", str(tmp_path / "joined.log")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with SeerClient(info["client_address"], keys=ClientKeys.from_dir(keys), timeout_s=30) as client:
            wait_for(lambda: len([e for e in client.status().engines if e.state == "ready"]) == 2, 60,
                  "the joined engine to be ready")
            joined_id = max(e.engine_id for e in client.status().engines)
            assert joined_id == 1
            result = client.rollout([f"q{i}" for i in range(8)], 2, SamplingParams(max_tokens=8))
            assert {s.engine_ids[0] for g in result.groups for s in g.samples} == {0, 1}
    finally:
        joined.terminate()
        joined.wait(30)
    keyless = tmp_path / "keyless.toml"
    keyless.write_text('[engines]\nbackend = "sim"\n')
    proc = seerctl("engine", "--join", info["engine_address"], "--config", str(keyless), timeout=60)
    assert proc.returncode == 1
    assert "without CURVE keys" in proc.stderr and "allow_insecure_tcp" in proc.stderr
