"""CURVE config validation, the ZAP decision, and engine ids for joining engines."""

from __future__ import annotations

import pytest
import zmq
import zmq.asyncio
import zmq.auth
from structlog.testing import capture_logs

from seer.auth import ClientKeys, ZapHandler, client_curve, generate_keys, server_curve
from seer.config import ConfigError, load_config
from seer.controlplane.registry import Registry


def _config(tmp_path, server: str):
    path = tmp_path / "seer.toml"
    path.write_text("[server]\n" + server)
    return load_config(path)


def test_tcp_without_keys_is_refused_unless_explicitly_allowed(tmp_path):
    """A tcp:// address without a server key stops loading with the fields to set; the
    explicit allow_insecure_tcp opt-out loads; ipc (the default) needs nothing."""
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, 'client_address = "tcp://0.0.0.0:5555"\n')
    assert "without authentication" in str(info.value) and "seerctl keys" in str(info.value)
    assert "allow_insecure_tcp" in str(info.value)
    config = _config(tmp_path, 'engine_address = "tcp://0.0.0.0:5556"\nallow_insecure_tcp = true\n')
    assert config.server.allow_insecure_tcp
    assert _config(tmp_path, "").server.client_address == ""


def test_key_paths_are_relative_to_the_config_file_and_must_exist(tmp_path):
    """Key fields resolve against the config file's folder; a missing file is named."""
    generate_keys(tmp_path / "keys")
    config = _config(tmp_path, 'client_address = "tcp://127.0.0.1:5555"\n'
                               'curve_server_secret_key = "keys/server.key_secret"\n'
                               'curve_authorized_keys = "keys/authorized"\n')
    assert config.server.curve_server_secret_key == str(tmp_path / "keys" / "server.key_secret")
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, 'curve_server_public_key = "keys/nope.key"\n')
    assert "server.curve_server_public_key" in str(info.value) and "nope.key" in str(info.value)
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, 'curve_server_secret_key = "keys/server.key_secret"\n')
    assert "curve_authorized_keys" in str(info.value)


def test_socket_options_only_for_tcp_and_only_with_keys(tmp_path):
    """CURVE options apply to tcp:// addresses; ipc stays plain; the client side needs
    both the server public key and its own keypair."""
    generate_keys(tmp_path / "keys")
    config = _config(tmp_path, 'curve_server_secret_key = "keys/server.key_secret"\n'
                               'curve_authorized_keys = "keys/authorized"\n'
                               'curve_server_public_key = "keys/server.key"\n'
                               'curve_client_secret_key = "keys/client.key_secret"\n')
    server_opts = server_curve(config.server, "tcp://127.0.0.1:1")
    assert server_opts is not None and server_opts["CURVE_SERVER"] == 1
    assert server_curve(config.server, "ipc:///tmp/x.sock") is None
    client_opts = client_curve(config.server, "tcp://127.0.0.1:1")
    server_public, _ = zmq.auth.load_certificate(tmp_path / "keys" / "server.key")
    assert client_opts is not None and client_opts["CURVE_SERVERKEY"] == server_public
    assert ClientKeys.from_dir(tmp_path / "keys").socket_options() == client_opts


def test_zap_lets_authorized_keys_in_and_logs_the_rest(tmp_path):
    """ZAP: an authorized CURVE key gets 200, an unknown key gets 400 and a peer_refused
    event with the peer address and key; NULL (ipc) peers pass; a malformed request is refused."""
    files = generate_keys(tmp_path / "keys")
    ctx = zmq.asyncio.Context()
    try:
        zap = ZapHandler(ctx, str(files["authorized"]))
        good, _ = zmq.auth.load_certificate(files["client_public"])
        bad, _ = zmq.auth.load_certificate(files["server_public"])  # a valid key, never authorized
        request = [b"1.0", b"7", b"seer", b"10.0.0.9", b"", b"CURVE"]
        with capture_logs() as logs:
            ok = zap.decide(request + [zmq.utils.z85.decode(good)])
            refused = zap.decide(request + [zmq.utils.z85.decode(bad)])
            null = zap.decide([b"1.0", b"8", b"", b"", b"", b"NULL"])
            malformed = zap.decide([b"1.0", b"9"])
        assert ok[:3] == [b"1.0", b"7", b"200"] and ok[4] == good
        assert refused[2] == b"400" and null[2] == b"200" and malformed[2] == b"400"
        events = [e for e in logs if e["event"] == "peer_refused"]
        assert events[0]["peer_address"] == "10.0.0.9" and events[0]["client_key"] == bad.decode()
        assert zap.num_refused == 2
        zap.close()
    finally:
        ctx.term()


def test_joining_engines_get_ids_above_every_id_seen():
    """Ids for joining engines start above the spawned range and are never reused, so a
    stale message can never be taken for a newer engine's."""
    registry = Registry(heartbeat_timeout_s=5.0)
    registry.expect(0, 100, 0.0)
    registry.expect(1, 101, 0.0)
    assert registry.next_engine_id(num_spawned=2) == 2
    assert registry.next_engine_id(num_spawned=4) == 4  # spawned ids not yet expected stay free
    registry.expect(2, 102, 0.0)
    registry.lose(2)
    assert registry.next_engine_id(num_spawned=2) == 3
    # A spawned engine is reachable under no identity until its hello names its connection.
    assert registry.by_identity(b"engine-1") is None and registry.by_identity(b"join-x") is None
