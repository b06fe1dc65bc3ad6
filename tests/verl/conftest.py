"""veRL integration fixtures. These tests run only inside ``.venv-verl`` (veRL 0.9.1 pins an
older transformers than the main venv's vLLM), driven from the main suite by
tests/integration/test_verl_suite.py (sim daemon) and tests/engine/test_verl_engine.py
(real vLLM). Elsewhere they are not collected; the drivers fail if ``.venv-verl`` is missing.

The Seer daemon runs in the main venv (``SEER_DAEMON_PYTHON``, set by the drivers), as it
would beside a trainer: the trainer's environment talks to it over ZeroMQ only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("verl") is None:
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]


def daemon_python() -> str:
    main = ROOT / ".venv" / "bin" / "python"
    return os.environ.get("SEER_DAEMON_PYTHON") or (str(main) if main.exists() else sys.executable)


def seerctl(*args: str, timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([daemon_python(), "-m", "seer.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


class SeerDaemon:
    """One daemon started with ``seerctl start`` (background) and stopped with ``seerctl stop``."""

    def __init__(self, run_dir: Path, config: Path) -> None:
        self.run_dir, self.config = run_dir, config

    def start(self) -> SeerDaemon:
        proc = seerctl("start", "--config", str(self.config), "--run-dir", str(self.run_dir))
        assert proc.returncode == 0, proc.stderr + proc.stdout
        return self

    def stop(self) -> None:
        seerctl("stop", "--run-dir", str(self.run_dir), timeout=120.0)

    @property
    def address(self) -> str:
        return json.loads((self.run_dir / "daemon.json").read_text())["client_address"]


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


SIM_CONFIG = """
[engines]
backend = "sim"
count = 2
sim_step_s = 0.002
heartbeat_timeout_s = 5.0

[server]
client_timeout_s = 3.0
max_group_size = 16

[scheduler]
chunk_size_tokens = 16

[model]
max_model_len = 512
"""


@pytest.fixture(scope="session")
def sim_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("verl-sim")
    daemon = SeerDaemon(root / "run", write_config(root / "sim.toml", SIM_CONFIG)).start()
    yield daemon
    daemon.stop()
