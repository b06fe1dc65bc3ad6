"""Integration fixtures: real daemons, real processes, real ZeroMQ sockets, simulated
engines (the real-engine tests live in tests/engine)."""

from __future__ import annotations

import pytest

from tests.daemon_helpers import Daemon, write_sim_config


@pytest.fixture(scope="module")
def sim_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sim")
    daemon = Daemon(root / "run", write_sim_config(root / "sim.toml"))
    daemon.start()
    yield daemon
    daemon.stop()


