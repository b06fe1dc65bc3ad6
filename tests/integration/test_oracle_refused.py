"""`policy="oracle"` on a daemon is refused up front and leaves no rollout behind (issue 14,
defect 3): intake refuses it (``simulation_only_policy``) before anything is registered."""

from __future__ import annotations

import pytest

from seer.client import SeerClient, SeerServiceError
from tests.daemon_helpers import wait_for


def test_an_oracle_rollout_is_refused_and_leaves_nothing(sim_daemon):
    """The oracle policy needs true output lengths (simulation only): a clear refusal, not
    internal_error, and status shows no rollout afterwards."""
    with SeerClient(sim_daemon.address, timeout_s=10) as client:
        with pytest.raises(SeerServiceError) as info:
            client.rollout(["q"], 2, policy="oracle")
        assert info.value.code == "simulation_only_policy"
        wait_for(lambda: client.status().rollouts == [], 10, "no rollout to be left")
