"""What ``seerctl status`` shows and when the daemon calls itself ready (controlplane/status.py),
read from the control plane's tables without sockets."""

from __future__ import annotations

import os

from seer.controlplane.launcher import EnginePlacement
from tests.unit.core_parts import Clock, admit, make_core, start_rollout


class Launcher:
    """What a launcher tells the control plane: the processes it started, whether it gave up."""

    def __init__(self, num_engines: int, placements: list[EnginePlacement], gave_up: bool = False) -> None:
        self.num_engines = num_engines
        self._placements = placements
        self._gave_up = gave_up

    def placements(self) -> list[EnginePlacement]:
        return self._placements

    def gave_up(self) -> bool:
        return self._gave_up


def test_the_status_shows_each_rollouts_progress_and_every_engine_by_id(tmp_path):
    """Rollouts with their groups, samples and time since acceptance; engines sorted by
    id with their state; the daemon's pid, policy, weights version and addresses."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    admit(core, 1)
    admit(core, 0)
    core.registry.expect(2, 4242, clock.now)
    start_rollout(core, "r", num_prompts=3, group_size=2)
    clock.now = 7.5
    status = core.status.status()
    (rollout,) = status.rollouts
    assert (rollout.rollout_id, rollout.num_groups, rollout.num_samples, rollout.num_samples_done) == ("r", 3, 6, 0)
    assert rollout.elapsed_s == 7.5
    assert [(e.engine_id, e.state) for e in status.engines] == [(0, "ready"), (1, "ready"), (2, "starting")]
    assert (status.pid, status.policy, status.weights_version) == (os.getpid(), "group", 0)
    assert status.run_dir == str(tmp_path) and status.client_address == "ipc://c"


def test_launched_engines_show_the_node_and_actor_they_run_on(tmp_path):
    """A launcher knows its engines by host and pid: each engine that matches a placement
    shows that placement's node and Ray actor; the others show none."""
    clock = Clock()
    placement = EnginePlacement(host_id="here", pid=101, node_ip="10.0.0.2", actor_id="actor-1")
    core = make_core(tmp_path, clock, launcher=Launcher(2, [placement]))
    admit(core, 0, pid=100)
    admit(core, 1, pid=101)
    engines = core.status.status().engines
    assert [(e.node_ip, e.ray_actor_id) for e in engines] == [("", ""), ("10.0.0.2", "actor-1")]
    assert core.status.engine_processes() == {0: ("here", 100), 1: ("here", 101)}


def test_engines_are_starting_until_spawned_ones_said_hello_and_launched_ones_are_ready(tmp_path):
    """Spawned engines are starting until their hello; a launcher's until as many are
    ready as it launches, or it gave up restarting them."""
    clock = Clock()
    core = make_core(tmp_path, clock)
    assert not core.status.starting()
    core.registry.expect(0, 4242, clock.now)
    assert core.status.starting()
    admit(core, 0)
    assert not core.status.starting()

    launched = make_core(tmp_path, clock, launcher=Launcher(2, []))
    admit(launched, 2)
    assert launched.status.starting()
    admit(launched, 3)
    assert not launched.status.starting()
    gave_up = make_core(tmp_path, clock, launcher=Launcher(2, [], gave_up=True))
    assert not gave_up.status.starting()
