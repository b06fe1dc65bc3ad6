"""Engines that come and go leave nothing behind that grows with their number.

Every engine that joins gets a new id (``Registry.next_engine_id``: ids are never reused),
so anything kept per engine id for the daemon's life grows with every restart: a week of
training that loses an engine every few minutes, or the soak (docs/benchmarks.md, "Soak")
that kills one every ~3 s. Measured on the daemon (sim engines, 100 kills): ~58 KB of RSS
per lost engine, ~4-15 KB of it live objects (the engine's record with its in-flight map,
load, capabilities and hello; its secret, loss reason and identity; its Prometheus series;
its KV-host entry and the divided/context policies' work ledger entry), the rest heap
pages those scattered objects keep from being given back.

Here: 200 joined engines, each sent chunks and then lost, one at a time. The registry
keeps the newest ``LOST_ENGINES_KEPT`` lost ones (controlplane/registry.py) and forgets the
rest, with every table kept by engine id (``Scheduler.forget_engine``); a forgotten id is
never given out again.
"""

from __future__ import annotations

import msgspec
from structlog.testing import capture_logs

from seer.controlplane.outbox import ToPeer
from seer.controlplane.registry import LOST_ENGINES_KEPT, Registry
from seer.controlplane.state import EngineState
from seer.protocol import (
    JOIN_ENGINE_ID,
    EngineHeartbeat,
    EngineLoad,
    HelloAccepted,
    HelloRejected,
    Prompt,
    RolloutRequest,
    SamplingParams,
)
from tests.unit.core_parts import CLIENT, Clock, caps, dispatch, hello, make_core, start_rollout

NUM_ENGINES = 200


def _churn(tmp_path, num_engines: int = NUM_ENGINES, policy: str | None = None):
    clock = Clock()
    core = make_core(tmp_path, clock, count=0, replacement_wait_s=1e9)  # the rollout waits for the next joiner
    for k in range(num_engines):
        joiner = msgspec.structs.replace(hello(JOIN_ENGINE_ID, 1000 + k), secret=f"joiner-{k}")
        answer = core.hello(f"join-{k}".encode(), joiner)
        assert answer.admitted
        [engine_id] = core.registry.ready_ids()
        assert engine_id == k  # every joiner a new id, forgotten ones included
        if k == 0 and policy is None:
            start_rollout(core, "r", num_prompts=4, group_size=4, max_tokens=64)
        elif k == 0:
            core.clients.on_request(CLIENT, RolloutRequest(
                call_id="call-r", rollout_id="r", group_size=4, policy=policy, sampling=SamplingParams(max_tokens=640),
                prompts=[Prompt(prompt_token_ids=[5, 6, 7 + i]) for i in range(4)]))
        for send in dispatch(core, clock):
            core.metrics.chunk_dispatched(send)
        clock.now += 1.0
        core.health.lose_engine(engine_id, "exited")
        assert core.registry.engines[engine_id].state is EngineState.LOST
    return core


def _series(core, name: str) -> set[tuple[tuple[str, str], ...]]:
    return {tuple(sorted(sample.labels.items())) for family in core.metrics.registry.collect()
            for sample in family.samples if sample.name == name}


def test_a_lost_engines_prometheus_series_are_dropped(tmp_path):
    """The per-engine counters of an engine that was lost are not kept (nor scraped)."""
    core = _churn(tmp_path)
    assert core.metrics.engines_lost._value.get() == NUM_ENGINES
    assert _series(core, "seer:chunks_dispatched_total") == set()
    assert _series(core, "seer:chunks_finished_total") == set()


def test_what_is_kept_per_lost_engine_is_bounded(tmp_path):
    core = _churn(tmp_path)
    bound = 32  # lost engines one may keep (to name them in status, to take an id back)
    assert LOST_ENGINES_KEPT == bound
    assert len(core.registry.engines) <= bound
    assert len(core.registry.loss_reasons) <= bound
    assert len(core.scheduler.kv.engine_hosts) <= bound
    # The newest lost ones are those kept, each with why it was lost; ids stay unique.
    newest = set(range(NUM_ENGINES - bound, NUM_ENGINES))
    assert set(core.registry.engines) == set(core.registry.loss_reasons) == set(core.scheduler.kv.engine_hosts) == newest
    assert core.registry.next_engine_id(0) == NUM_ENGINES
    assert core.registry.proves(0, "joiner-0") is None  # its secret is gone too
    assert len(core.status.status().engines) == bound
    assert len(_series(core, "seer:engine_up")) == bound
    assert core.registry.not_ready([0, NUM_ENGINES - 1]) == {
        0: f"lost ({bound} or more engines were lost after it; see its log)", NUM_ENGINES - 1: "lost (exited)"}


def test_a_chunked_policys_work_ledger_forgets_lost_engines(tmp_path):
    """``context`` keeps each engine's expected work (``placement.WorkLedger``) and the
    engines holding each group's prompt: only engines the registry still remembers."""
    core = _churn(tmp_path, policy="context")
    ledger = core.scheduler.policy("context")._work
    assert ledger._engines  # it did keep work per engine
    assert set(ledger._engines) <= set(core.registry.engines)
    assert all(engine_id in core.registry.engines for engine_id, _, _ in ledger._of.values())
    holders = core.scheduler.policy("context")._group_engines  # engines holding a group's prompt
    assert holders and all(engines <= set(core.registry.engines) for engines in holders.values())


def _heartbeat(engine_id: int) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, load=EngineLoad())


def test_a_forgotten_engine_is_an_unknown_sender_asked_to_say_hello_again(tmp_path):
    """A message from a lost engine the registry forgot is refused like any unregistered
    sender's; one still remembered is refused naming why it was lost."""
    core = _churn(tmp_path, num_engines=LOST_ENGINES_KEPT + 3)
    newest = LOST_ENGINES_KEPT + 2
    with capture_logs() as logs:
        forgotten = core.membership.refuse_sender(b"join-0", _heartbeat(0))
        remembered = core.membership.refuse_sender(f"join-{newest}".encode(), _heartbeat(newest))
    assert forgotten is not None and forgotten.say_hello_again and "no engine registered as b'join-0'" in forgotten.reason
    assert remembered is not None and remembered.say_hello_again
    assert f"engine {newest} was declared lost (exited)" in remembered.reason
    assert [e["event"] for e in logs] == ["unregistered_engine_message", "lost_engine_heard"]


def test_a_forgotten_id_is_never_given_out_again(tmp_path):
    """A forgotten joined engine that registers again naming its id gets a fresh one; a
    hello that claims a forgotten id as its fixed id is refused."""
    core = _churn(tmp_path, num_engines=LOST_ENGINES_KEPT + 3)
    fresh = LOST_ENGINES_KEPT + 3
    back = msgspec.structs.replace(hello(JOIN_ENGINE_ID, 1000), secret="joiner-0", previous_engine_id=0,
                                   previous_control_plane=core.membership.control_plane)
    answer = core.hello(b"join-0-again", back)
    assert answer.admitted
    assert [(type(s.msg), s.msg.engine_id) for s in answer.sends] == [(HelloAccepted, fresh)]
    with capture_logs() as logs:
        claim = core.hello(b"engine-1.x", hello(1, 5000))
    assert not claim.admitted
    [refusal] = claim.sends
    assert isinstance(refusal, ToPeer) and isinstance(refusal.msg, HelloRejected)
    assert "engine id 1 belonged to an engine lost long ago" in refusal.msg.reason
    assert [e["event"] for e in logs] == ["engine_claim_refused"]
    assert core.registry.next_engine_id(0) == fresh + 1


def test_only_engines_still_lost_are_forgotten_oldest_first():
    """An engine that said hello again is not lost any more; a forgotten engine's connection
    name, taken since by another engine, stays that engine's."""
    registry = Registry()
    for engine_id in range(LOST_ENGINES_KEPT + 2):
        registry.admit(engine_id, caps(), identity=f"engine-{engine_id}".encode())
        registry.lose(engine_id)
        registry.note_loss(engine_id, "exited")
    registry.admit(0, caps(), identity=b"engine-0.back")  # back: no longer lost
    assert 0 not in registry.loss_reasons
    assert registry.forget_lost() == [1]
    assert registry.forget_lost() == []
    assert registry.by_identity(b"engine-1") is None and registry.forgot(1) and not registry.forgot(0)
    registry.admit(50, caps(), identity=b"engine-2")  # engine 2's old connection name, now engine 50's
    registry.admit(51, caps(), identity=b"engine-51")
    registry.lose(51)
    assert registry.forget_lost() == [2]
    assert registry.by_identity(b"engine-2") is registry.engines[50]
    assert registry.next_engine_id(0) == 52
