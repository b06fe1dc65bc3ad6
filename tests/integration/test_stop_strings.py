"""Stop strings are accepted under every policy, chunked ones included (docs/client.md).

Their cut across a chunk edge is pinned in tests/unit/test_stops.py (the control plane's
check) and against real vLLM in tests/engine/test_vllm_rollout.py; here a real daemon
must take them under each policy instead of refusing them."""

from __future__ import annotations

import pytest

from seer.client import SamplingParams, SeerClient


@pytest.mark.parametrize("policy", ["group", "divided", "context"])
def test_stop_strings_are_accepted_under_every_policy(sim_daemon, policy):
    """A rollout with stop strings runs to the end under group, divided and context policies."""
    sampling = SamplingParams(max_tokens=48, stop=["ab", "\n\n"], seed=3)
    with SeerClient(sim_daemon.address) as client:
        result = client.rollout([f"q{i}" for i in range(3)], 2, sampling, policy=policy)
    assert result.stats.policy == policy
    assert [len(g.samples) for g in result.groups] == [2, 2, 2]
    assert all(s.finish_reason in ("stop", "length") for g in result.groups for s in g.samples)
