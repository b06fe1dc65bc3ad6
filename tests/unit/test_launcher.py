"""The launcher seam: restart budget, engine matching, the config an engine actor writes, [cluster] checks."""

from __future__ import annotations

import tomllib

import msgspec
import pytest

from seer.cli.ray_actor import config_toml, engine_command
from seer.cli.ray_launcher import LaunchError, probe, resolve_address
from seer.config import ConfigError, SeerConfig, config_from_dict
from seer.controlplane.launcher import EnginePlacement, RestartBudget, match_engine


def test_a_slot_restarts_until_its_budget_is_spent_and_never_while_stopping():
    """max_restarts = 2: two restarts of a slot, then none; other slots keep their own budget; none at stop."""
    budget = RestartBudget.for_slots(2, max_restarts=2)
    assert budget.should_restart(0, stopping=False) and budget.restarted(0) == 1
    assert budget.should_restart(0, stopping=False) and budget.restarted(0) == 2
    assert not budget.should_restart(0, stopping=False)
    assert budget.should_restart(1, stopping=False) and not budget.should_restart(1, stopping=True)


def test_a_launched_engine_is_found_by_host_and_pid():
    """The control plane knows engines by id, the launcher by process: (host id, pid) joins them."""
    placement = EnginePlacement(host_id="a:1", pid=42, node_ip="10.0.0.2", actor_id="ff")
    assert match_engine(placement, {2: ("a:1", 41), 3: ("b:1", 42), 4: ("a:1", 42)}) == 4
    assert match_engine(placement, {2: ("a:1", 42), 5: ("a:1", 42)}) == 5  # pid reused: the newest
    assert match_engine(placement, {3: ("b:1", 42)}) is None


def test_the_actor_config_file_loads_back_to_the_same_config():
    """The TOML an engine actor writes for `seerctl engine --config` decodes to the daemon's config."""
    config = SeerConfig()
    text = config_toml(msgspec.to_builtins(config))
    assert msgspec.convert(tomllib.loads(text), SeerConfig) == config
    cmd = engine_command("tcp://10.0.0.1:5555", "/tmp/c.toml", "/cache", "/tmp/e.log")  # type: ignore[arg-type]
    assert cmd[3:7] == ["engine", "--join", "tcp://10.0.0.1:5555", "--config"]


def test_the_ray_launcher_needs_a_tcp_engine_address():
    """launcher = "ray" with the default ipc:// engine address is refused naming server.engine_address."""
    with pytest.raises(ConfigError, match=r"server.engine_address = \"tcp://HOST:PORT\""):
        config_from_dict({"cluster": {"launcher": "ray"}})
    with pytest.raises(ConfigError, match="cluster.max_restarts"):
        config_from_dict({"cluster": {"max_restarts": -1}})


def test_bad_ray_addresses_are_refused_in_one_line():
    """ray:// and a malformed address are refused before any connection attempt; a closed port within its timeout."""
    with pytest.raises(LaunchError, match="Ray Client"):
        resolve_address("ray://head:10001", {})
    with pytest.raises(LaunchError, match="HOST:PORT"):
        probe("head", 1.0)
    with pytest.raises(LaunchError, match="no Ray cluster answers"):
        probe("127.0.0.1:1", 0.5)
