"""`policy="oracle"` on a daemon is refused up front and leaves no rollout behind (issue 14,
defect 3). The fix belongs to the control plane (phase 2): until then this is a strict
xfail, so the fix turns it into a failure that asks for the marker to go (and for
"oracle" to return to tests/wire_strategies.py's fuzzed policies)."""

from __future__ import annotations

import pytest

from seer.client import SeerClient, SeerServiceError
from tests.daemon_helpers import wait_for


@pytest.mark.xfail(strict=True, reason="issue 14 defect 3: Scheduler.submit registers the rollout before the "
                                       "oracle policy raises (controlplane, phase 2)")
def test_an_oracle_rollout_is_refused_and_leaves_nothing(sim_daemon):
    """The oracle policy needs true output lengths (simulation only): a clear refusal, not
    internal_error, and status shows no rollout afterwards."""
    with SeerClient(sim_daemon.address, timeout_s=10) as client:
        with pytest.raises(SeerServiceError) as info:
            client.rollout(["q"], 2, policy="oracle")
        assert info.value.code != "internal_error"
        wait_for(lambda: client.status().rollouts == [], 10, "no rollout to be left")
