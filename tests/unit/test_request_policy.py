"""The `request` baseline (per-sample least-requests routing) on the pure scheduler core."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer.config import ConfigError, config_from_dict, policy_names
from seer.controlplane.policies import POLICIES, make_policy
from seer.controlplane.policies.base import Policy, WholeRequestPolicy, register
from seer.controlplane.state import derive_sample_seed
from tests.unit.chunks import finished
from tests.unit.test_chunked_policies import rollout, scheduler
from tests.unit.test_policy_properties import make_rollout, make_scheduler, run_checked, workloads


def test_each_sample_goes_to_the_engine_with_fewest_requests_in_flight_ties_by_id():
    """Samples are routed one by one to the engine with the fewest in flight, lower id on ties,
    so a group's samples spread over engines."""
    sched = scheduler("request", engines=3)
    busy = rollout("request", [[10]], rid="busy")  # one sample already running on engine 0
    sched.submit(busy)
    [first] = sched.schedule()
    assert first.engine_id == 0
    r = rollout("request", [[10, 10, 10], [10, 10]])
    sched.submit(r)
    dispatches = sched.schedule()
    assert [d.request.request_id for d in dispatches] == ["r/0/0", "r/0/1", "r/0/2", "r/1/0", "r/1/1"]
    # loads before: [1, 0, 0] -> 1, 2, then 0 (tie at 1, lowest id), 1, 2
    assert [d.engine_id for d in dispatches] == [1, 2, 0, 1, 2]


def test_every_sample_runs_once_as_one_chunk_of_its_full_budget():
    """No chunking: each sample is dispatched exactly once with max_tokens as its budget and
    the sample's own seed, and finishes with its true length."""
    lengths = [[40, 5, 64], [16, 33]]
    sched = scheduler("request", engines=2, chunk_size_tokens=8)
    r = rollout("request", lengths, max_tokens=64)
    for g in r.groups:
        for q in g.requests:
            q.sampling = type(q.sampling)(max_tokens=64, seed=derive_sample_seed(7, g.group_index, q.sample_index))
    sched.submit(r)
    dispatches = sched.schedule()
    assert sorted(d.request.request_id for d in dispatches) == sorted(q.request_id for g in r.groups for q in g.requests)
    for d in dispatches:
        assert d.task.sampling.max_tokens == 64
        assert d.task.sampling.seed == derive_sample_seed(7, d.request.group.group_index, d.request.sample_index)
        n = lengths[d.request.group.group_index][d.request.sample_index]
        sched.chunk_finished(finished(d.engine_id, d.task.task_id, [7] * n, [-0.5] * n, "length" if n == 64 else "stop"))
    assert sched.schedule() == []
    assert r.done and r.num_chunks == 5
    assert [[q.num_generated_tokens for q in g.requests] for g in r.groups] == lengths


def test_a_sample_lost_with_its_engine_is_rerouted_to_the_least_loaded_engine():
    """When an engine is lost its sample goes back and is routed again, to a live engine."""
    sched = scheduler("request", engines=2)
    r = rollout("request", [[10, 10, 10]])
    sched.submit(r)
    assert [d.engine_id for d in sched.schedule()] == [0, 1, 0]
    sched.engine_lost(0)
    again = sched.schedule()
    assert sorted(d.request.request_id for d in again) == ["r/0/0", "r/0/2"]
    assert {d.engine_id for d in again} == {1}


@settings(max_examples=40, deadline=None, database=None)
@given(lengths=workloads, engines=st.integers(1, 3), seed=st.integers(0, 1000))
def test_request_keeps_the_scheduler_invariants(lengths, engines, seed):
    """Every sample finishes once with its true length, no task twice, one chunk per sample
    (admission is the engine's own, as under `group`)."""
    sched = make_scheduler("request", engines, 400, 16, 0)
    r = make_rollout("request", lengths, "r")
    sched.submit(r)
    log = run_checked(sched, r, lengths, random.Random(seed), admits=False)
    assert len(log) == sum(len(g) for g in lengths)
    assert len({d.request.request_id for d in log}) == len(log)


def test_policies_register_themselves_and_the_config_checks_against_them():
    """Every policy is in the registry and in the config's names; an unknown name in
    seer.toml is refused at load naming the choices; registering a new class is enough."""
    assert {"group", "request", "divided", "context", "oracle"} <= set(POLICIES) == set(policy_names())
    with pytest.raises(ConfigError, match="unknown policy 'seer'; choose one of: context, divided, group"):
        config_from_dict({"scheduler": {"policy": "seer"}})

    @register
    class Echo(WholeRequestPolicy):
        name = "test-echo"

        def assign(self, engines, limit=0):
            return []

    try:
        assert isinstance(make_policy("test-echo"), Echo)
        assert config_from_dict({"scheduler": {"policy": "test-echo"}}).scheduler.policy == "test-echo"
    finally:
        POLICIES.pop("test-echo")
        from seer import config

        config._POLICY_NAMES.discard("test-echo")


def test_registering_a_taken_name_is_refused():
    """Two classes cannot share a policy name."""

    class Impostor(WholeRequestPolicy):
        name = "group"

        def assign(self, engines, limit=0):
            return []

    with pytest.raises(ValueError, match="'group' is taken"):
        register(Impostor)


def test_registering_a_class_outside_the_interface_is_refused():
    """A class that does not subclass Policy, or leaves one of its required methods out,
    is refused at registration, naming what is missing."""

    class Stranger:
        name = "test-stranger"

    with pytest.raises(TypeError, match="must subclass .*Policy"):
        register(Stranger)

    class Halfway(Policy):
        name = "test-halfway"

        def __len__(self):
            return 0

        def enqueue(self, request):
            pass

    with pytest.raises(TypeError, match="does not implement assign, discard_rollout"):
        register(Halfway)
    assert "test-halfway" not in POLICIES

    class Unsliced(WholeRequestPolicy):  # the interface before the server placed bursts a slice at a time
        name = "test-unsliced"

        def assign(self, engines):
            return []

    with pytest.raises(TypeError, match="assign must take `limit`"):
        register(Unsliced)
    assert "test-unsliced" not in POLICIES
