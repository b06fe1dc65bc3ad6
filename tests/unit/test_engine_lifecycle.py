"""One engine table: the registry's records are the scheduler's engines, and every state
change follows the documented lifecycle (controlplane/state.py: ``EngineState``)."""

from __future__ import annotations

import pytest

from seer.config import SchedulerConfig
from seer.controlplane.registry import EngineStateError, Registry
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import ENGINE_TRANSITIONS, EngineState
from seer.protocol import EngineCapabilities, EngineHello, EngineLoad, Prompt, RolloutRequest, SamplingParams
from seer.controlplane.intake import Limits, build_rollout
from seer.controlplane.tokenizer import ByteTokenizer


def caps() -> EngineCapabilities:
    return EngineCapabilities(backend="sim", model="m", dtype="float32", max_model_len=512, vocab_size=300,
                              kv_capacity_tokens=100_000, block_size=16)


def hello(engine_id: int, pid: int, weights_version: int = 0) -> EngineHello:
    return EngineHello(engine_id=engine_id, protocol_version=1, pid=pid, weights_version=weights_version,
                       capabilities=caps(), host_id="h")


def scheduler() -> tuple[Scheduler, Registry]:
    registry = Registry(heartbeat_timeout_s=5.0)
    return Scheduler(SchedulerConfig(), lambda: 0.0, registry=registry), registry


def submit_one(sched: Scheduler) -> None:
    req = RolloutRequest(call_id="c", rollout_id="r", prompts=[Prompt(prompt_token_ids=[5, 6, 7])], group_size=2,
                         sampling=SamplingParams(max_tokens=8))
    sched.submit(build_rollout(req, ByteTokenizer(), Limits(max_group_size=8, max_prompts=8, max_model_len=512,
                                                            vocab_size=300), "group", 0.0))


def test_the_scheduler_and_the_registry_hold_the_same_record():
    """An engine the scheduler admits is ready in the registry, with what its hello said;
    the scheduler's engines are the registry's records."""
    sched, registry = scheduler()
    sched.engine_joined(0, caps(), pid=42, loaded_weights_version=3, now_s=1.0, identity=b"engine-0")
    assert sched.engines is registry.engines
    view = registry.engines[0]
    assert view.state is EngineState.READY and registry.ready_ids() == [0] == [e.engine_id for e in sched.live_engines()]
    assert (view.pid, view.loaded_weights_version, view.last_heard_s) == (42, 3, 1.0)
    assert registry.by_identity(b"engine-0") is view
    assert view.status().state == "ready" and view.status().weights_version == 3


def test_losing_a_ready_engine_requeues_its_work_and_marks_it_lost_once():
    """``engine_lost`` moves the one record to ``lost`` and puts its chunks back; a second
    loss of the same engine is not reported again."""
    sched, registry = scheduler()
    sched.engine_joined(0, caps())
    submit_one(sched)
    assert len(sched.schedule()) == 2
    report = sched.engine_lost(0)
    assert report.previous is EngineState.READY and len(report.requeued) == 2 and report.stranded_rollouts
    assert registry.engines[0].state is EngineState.LOST and not registry.engines[0].inflight
    assert sched.engine_lost(0).previous is None


def test_losing_an_engine_that_never_took_work_strands_nothing():
    """A ``starting`` or ``updating`` engine that is lost had nothing of the scheduler's:
    no requeue, no stranded rollouts, but the registry knows it is lost."""
    sched, registry = scheduler()
    registry.expect(0, pid=10, now_s=0.0)
    registry.updating(hello(1, pid=11), now_s=0.0)
    submit_one(sched)
    for engine_id, was in ((0, EngineState.STARTING), (1, EngineState.UPDATING)):
        report = sched.engine_lost(engine_id)
        assert report.previous is was and not report.requeued and not report.stranded_rollouts
        assert registry.engines[engine_id].state is EngineState.LOST


def test_an_engine_admitted_again_starts_with_a_fresh_load():
    """A lost engine that says hello again is ready again; the load it reported before does
    not carry over (its process and counters are new)."""
    sched, registry = scheduler()
    sched.engine_joined(0, caps())
    registry.heard(0, 1.0, EngineLoad(num_running=3, num_preemptions=7))
    sched.engine_lost(0)
    sched.engine_joined(0, caps())
    assert registry.engines[0].state is EngineState.READY and registry.engines[0].load == EngineLoad()


def test_stopped_is_final_and_a_transition_the_lifecycle_lacks_is_refused():
    """After a clean shutdown an engine cannot be admitted, lost or stopped again; the error
    names the transition."""
    _, registry = scheduler()
    registry.admit(0, caps())
    registry.stop(0)
    assert registry.lose(0) is None and registry.engines[0].state is EngineState.STOPPED
    with pytest.raises(EngineStateError, match="engine 0 cannot go from stopped to ready"):
        registry.admit(0, caps())
    with pytest.raises(EngineStateError, match="from stopped to stopped"):
        registry.stop(0)


def test_every_state_is_in_the_transition_table():
    """Each ``EngineState`` has its row (a new state without one would fail every move)."""
    assert set(ENGINE_TRANSITIONS) == {None, *EngineState}
    assert ENGINE_TRANSITIONS[EngineState.STOPPED] == frozenset()
