"""`seerctl start` says "ready" only when every engine is ready; otherwise it names each
engine that is not and why (issue 38, point 6: under memory pressure it once printed
"ready ... engines [1]" while engine 0 was still starting, and that engine then failed).

A ``sitecustomize`` on the daemon's PYTHONPATH makes simulated engine 0 exit at start
(code 3) or take longer than ``engines.startup_timeout_s`` to say hello."""

from __future__ import annotations

import os

import pytest

from tests.daemon_helpers import seerctl, write_sim_config

SITECUSTOMIZE = r'''
import os, sys, time
_argv = getattr(sys, "orig_argv", [])
_mode = os.environ.get("SEER_TEST_ENGINE0")
if _mode and "seer.engines.worker" in _argv and _argv[_argv.index("--engine-id") + 1] == "0":
    if _mode == "exit":
        os._exit(3)
    time.sleep(120)  # "slow": still starting when start-up times out (stop kills it)
'''


@pytest.mark.parametrize(("mode", "words"), [
    ("exit", ["engine 0: lost (process", "exited with code 3", "engine-0.out"]),
    ("slow", ["engine 0: still starting"]),
])
def test_start_names_the_engines_that_are_not_ready(tmp_path, mode, words):
    """Engine 0 exits at start, or is still starting when engines.startup_timeout_s (12 s:
    engine 1 says hello well within it, also on a loaded machine) runs out: start succeeds on engine 1 and its first line says "running ... on engines
    [1] only; not ready: engine 0: ..." instead of "ready"."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"SEER_TEST_ENGINE0": mode,
           "PYTHONPATH": os.pathsep.join([str(inject), *filter(None, [os.environ.get("PYTHONPATH")])])}
    config = write_sim_config(tmp_path / "sim.toml", startup_timeout_s=12.0)
    run_dir = tmp_path / "run"
    started = seerctl("start", "--config", str(config), "--run-dir", str(run_dir), env=env)
    try:
        assert started.returncode == 0, started.stderr + started.stdout
        first = started.stdout.splitlines()[0]
        assert "ready" not in first.split(";")[0], first
        assert "on engines [1] only" in first, first
        for word in words:
            assert word in first, first
    finally:
        seerctl("stop", "--run-dir", str(run_dir), env=env)


def test_start_says_ready_when_every_engine_is(tmp_path):
    """Both engines ready: the usual "Seer daemon ready (pid N, engines [0, 1])"."""
    run_dir = tmp_path / "run"
    started = seerctl("start", "--config", str(write_sim_config(tmp_path / "sim.toml")), "--run-dir", str(run_dir))
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.startswith("Seer daemon ready (pid ") and "engines [0, 1])" in started.stdout
    finally:
        seerctl("stop", "--run-dir", str(run_dir))
