"""The client refuses a rollout request over the daemon's server.max_request_bytes at once,
with the message `seerctl rollout` prints (issue 38, point 6): it used to send it and wait
out its whole timeout for an answer the daemon never gives (a frame beyond twice the limit
is dropped by the socket)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from seer.cli.main import main
from seer.client import SeerClient, SeerInputError, check_request_size, daemon_info
from tests.daemon_helpers import write_sim_config


def _run_dir(tmp_path: Path, limit: int) -> Path:
    """A run dir whose daemon.json names a socket nobody listens on."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "daemon.json").write_text(json.dumps({"client_address": f"ipc://{run_dir}/client.sock",
                                                     "max_request_bytes": limit}))
    return run_dir


@pytest.mark.parametrize("how", ["run_dir", "address"])
def test_an_over_size_request_is_refused_at_once_from_daemon_json(tmp_path, how):
    """The limit is read from daemon.json (found through the run dir, or next to the ipc://
    socket); a request over it raises SeerInputError before anything is sent, in far less
    than the client's timeout (nothing listens: sending would only time out)."""
    run_dir = _run_dir(tmp_path, 4096)
    kwargs = {"run_dir": run_dir} if how == "run_dir" else {"address": f"ipc://{run_dir}/client.sock"}
    t0 = time.monotonic()
    with SeerClient(timeout_s=30, **kwargs) as client:
        assert client._client.max_request_bytes == 4096
        with pytest.raises(SeerInputError, match="more than server.max_request_bytes = 4096") as info:
            client.rollout(["x" * 5000], 1)
    assert time.monotonic() - t0 < 10
    assert "split the prompts into smaller rollouts" in str(info.value)


def test_an_explicit_limit_wins_and_none_is_known_for_a_remote_daemon(tmp_path):
    """max_request_bytes= is used as given; a tcp:// address has no daemon.json to read."""
    assert daemon_info("tcp://127.0.0.1:1") is None
    with SeerClient("tcp://127.0.0.1:1", timeout_s=1, max_request_bytes=2048) as client:
        with pytest.raises(SeerInputError, match="= 2048"):
            client.rollout(["y" * 3000], 1)


def test_a_daemon_json_of_another_address_is_not_used(tmp_path):
    """A stale daemon.json naming another address gives no limit (None), not a wrong one."""
    run_dir = _run_dir(tmp_path, 4096)
    assert daemon_info(f"ipc://{run_dir}/other.sock") is None
    assert daemon_info(f"ipc://{run_dir}/client.sock")["max_request_bytes"] == 4096


def test_the_client_and_the_cli_refuse_with_the_same_message(tmp_path, capsys):
    """The CLI's refusal of an over-size prompt file is the client's message, word for word
    (up to the byte count: the CLI measures the request the client would send)."""
    config = write_sim_config(tmp_path / "sim.toml", server={"max_request_bytes": 4096})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "z" * 5000}) + "\n")
    code = main(["rollout", "--prompts", str(prompts), "--config", str(config), "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    with pytest.raises(SeerInputError) as info:
        check_request_size(int(err.split(" bytes")[0].rsplit(" ", 1)[1]), 4096)
    assert err == f"seerctl: {info.value}"
