"""A daemon fits its engines' step cost from the records their heartbeats carry, shows the
fit and the policy's choices in its status, and runs a replayed trace exactly."""

from __future__ import annotations

import time

from seer.client import SamplingParams, SeerClient


def test_the_daemon_fits_the_step_cost_from_heartbeats_and_reports_its_choices(sim_daemon):
    """After a rollout on simulated engines, status shows step records taken into the fit
    (the engines sent them with their heartbeats), the configured policy's placement and
    admission margin; a replayed rollout generates exactly the replay's lengths."""
    lengths = [[3, 40, 17], [64, 1, 9]]
    with SeerClient(sim_daemon.address) as client:
        result = client.rollout(["a", "b"], 3, SamplingParams(max_tokens=64, seed=1), policy="context",
                                replay_lengths=lengths)
        assert [[len(s.token_ids) for s in sorted(g.samples, key=lambda s: s.sample_index)]
                for g in sorted(result.groups, key=lambda g: g.group_index)] == lengths
        deadline = time.monotonic() + 30
        status = client.status()
        while status.scheduling.num_step_records == 0 and time.monotonic() < deadline:
            time.sleep(0.5)  # the next heartbeat carries the steps
            status = client.status()
    sch = status.scheduling
    assert sch.num_step_records > 0 and sch.num_step_records_refused == 0
    assert sch.policy == "context" and sch.placement == "drain" and sch.admission_margin_sd is not None
    assert sch.step_fixed_s > 0 and sch.step_per_prefill_token_s > 0
