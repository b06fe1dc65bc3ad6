"""`policy="oracle"` on a daemon without true lengths is refused up front and leaves no
rollout behind (issue 14, defect 3): intake refuses it (``needs_true_lengths``) before
anything is registered. With recorded lengths it runs."""

from __future__ import annotations

import pytest

from seer.client import SeerClient, SeerServiceError
from tests.daemon_helpers import wait_for


def test_an_oracle_rollout_is_refused_and_leaves_nothing(sim_daemon):
    """The oracle policy needs true output lengths: without them a clear refusal, not
    internal_error, and status shows no rollout afterwards."""
    with SeerClient(sim_daemon.address, timeout_s=10) as client:
        with pytest.raises(SeerServiceError) as info:
            client.rollout(["q"], 2, policy="oracle")
        assert info.value.code == "needs_true_lengths"
        wait_for(lambda: client.status().rollouts == [], 10, "no rollout to be left")


def test_an_oracle_rollout_with_recorded_lengths_runs(sim_daemon):
    """Lengths recorded by a seeded run make the oracle runnable on a daemon: every sample
    comes back."""
    from seer.protocol import SamplingParams
    sampling = SamplingParams(max_tokens=12, seed=3)
    with SeerClient(sim_daemon.address, timeout_s=60) as client:
        first = client.rollout(["a", "b", "c"], 2, sampling, policy="divided")
        lengths = [[len(s.token_ids) for s in g.samples] for g in first.groups]
        result = client.rollout(["a", "b", "c"], 2, sampling, policy="oracle", true_lengths=lengths)
        assert [len(g.samples) for g in result.groups] == [2, 2, 2]
        assert result.stats.policy == "oracle"
