"""The instance registry's bookkeeping for engines that join after a weights update."""

from __future__ import annotations

from seer.controlplane.registry import LOST_ENGINES_KEPT, Registry
from seer.controlplane.state import EngineState
from seer.protocol import EngineCapabilities, EngineHello


def _hello(pid: int, weights_version: int = 0, engine_id: int = 3, host_id: str = "h") -> EngineHello:
    return EngineHello(engine_id=engine_id, protocol_version=1, pid=pid, weights_version=weights_version,
                       capabilities=EngineCapabilities(backend="sim", model="m", dtype="float32", max_model_len=512,
                                                       vocab_size=100, kv_capacity_tokens=1000, block_size=16),
                       host_id=host_id)


def test_nothing_to_replay_before_any_update_or_for_a_current_engine():
    """Without a recorded update, or for an engine at (or past) the service's version,
    there is no checkpoint to replay."""
    registry = Registry(heartbeat_timeout_s=5.0)
    assert registry.weights_to_replay(_hello(10, 0), 2) is None
    registry.weights_path = "/ckpt/step-2"
    assert registry.weights_to_replay(_hello(10, 2), 2) is None
    assert registry.weights_to_replay(_hello(10, 3), 2) is None
    assert registry.weights_to_replay(_hello(10, 1), 2) == "/ckpt/step-2"


def test_an_updating_engine_is_connected_but_not_ready():
    """`updating` engines are pinged and can go silent, but are not ready for work."""
    registry = Registry(heartbeat_timeout_s=5.0)
    registry.updating(_hello(10), now_s=0.0, identity=b"join-a", joined=True)
    assert registry.ready_ids() == [] and registry.updating_ids() == [3] == registry.connected_ids()
    assert registry.is_updating(3) and registry.engines[3].hello is not None
    assert registry.silent(now_s=6.0) == [3]
    registry.admit(3, registry.engines[3].capabilities, pid=10, loaded_weights_version=1, now_s=6.0,
                   identity=b"join-a", joined=True)
    assert registry.ready_ids() == [3] and not registry.is_updating(3) and registry.engines[3].hello is None


def test_a_failed_replay_is_not_retried_for_the_same_process_and_checkpoint():
    """After a replay failed, the same engine process (host, pid) -- whatever identity it
    comes back with -- gets no replay of the same checkpoint, and the error is kept for
    its refusal; another process, or a newer checkpoint, is tried again."""
    registry = Registry(heartbeat_timeout_s=5.0)
    registry.weights_path = "/ckpt/step-1"
    registry.updating(_hello(10), now_s=0.0, identity=b"join-a", joined=True)
    registry.replay_failed(3, "RuntimeError: gone")
    assert registry.engines[3].state is EngineState.LOST
    assert registry.weights_to_replay(_hello(10, engine_id=-1), 1) is None
    assert "/ckpt/step-1" in registry.replay_error(_hello(10)) and "gone" in registry.replay_error(_hello(10))
    assert registry.weights_to_replay(_hello(11), 1) == "/ckpt/step-1"
    assert registry.weights_to_replay(_hello(10, host_id="other"), 1) == "/ckpt/step-1"
    registry.weights_path = "/ckpt/step-2"
    assert registry.weights_to_replay(_hello(10), 2) == "/ckpt/step-2"


def test_failed_replays_are_remembered_for_the_newest_processes_only():
    """A week of engines that fail to load a checkpoint keeps the registry bounded: the
    failures of the newest ``LOST_ENGINES_KEPT`` processes are kept, the oldest forgotten
    (such a process, if it ever comes back, is simply tried again)."""
    registry = Registry(heartbeat_timeout_s=5.0)
    registry.weights_path = "/ckpt/step-1"
    n = LOST_ENGINES_KEPT + 10
    for k in range(n):
        registry.updating(_hello(1000 + k, engine_id=k), now_s=0.0, identity=b"join-%d" % k, joined=True)
        registry.replay_failed(k, "RuntimeError: gone")
    assert len(registry._replay_failures) == LOST_ENGINES_KEPT
    assert registry.weights_to_replay(_hello(1000 + n - 1), 1) is None  # the newest: not retried
    assert registry.weights_to_replay(_hello(1000), 1) == "/ckpt/step-1"  # the oldest: forgotten, tried again
