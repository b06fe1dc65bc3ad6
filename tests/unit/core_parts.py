"""Test helper: the control plane's core (controlplane/core.py) without sockets, on a clock
the test moves, with engines that said hello and rollouts a client asked for."""

from __future__ import annotations

from pathlib import Path

from seer.config import EnginesConfig, SchedulerConfig, SeerConfig
from seer.controlplane.core import ControlCore
from seer.controlplane.launcher import EngineLauncher
from seer.controlplane.outbox import Outbox, ToClient
from seer.controlplane.scheduler import Dispatch
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import (
    PROTOCOL_VERSION,
    EngineCapabilities,
    EngineHello,
    Prompt,
    RolloutAccepted,
    RolloutRequest,
    SamplingParams,
)

CLIENT = b"client"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def caps() -> EngineCapabilities:
    return EngineCapabilities(backend="sim", model="m", dtype="float32", max_model_len=2048, vocab_size=300,
                              kv_capacity_tokens=100_000, block_size=16)


def hello(engine_id: int, pid: int, weights_version: int = 0) -> EngineHello:
    return EngineHello(engine_id=engine_id, protocol_version=PROTOCOL_VERSION, pid=pid,
                       weights_version=weights_version, capabilities=caps(), host_id="")


def make_core(tmp_path: Path, clock: Clock, launcher: EngineLauncher | None = None, **engines: object) -> ControlCore:
    """Two spawned engines configured (``engines.count``), the ``group`` policy, this host "here"."""
    config = SeerConfig(engines=EnginesConfig(backend="sim", **engines),  # type: ignore[arg-type]
                        scheduler=SchedulerConfig(policy="group", chunk_size_tokens=8))
    return ControlCore(config, tokenizer=ByteTokenizer(), engine_address="ipc://engines", client_address="ipc://c",
                       run_dir=tmp_path, launcher=launcher, clock=clock, local_host_id="here")


def admit(core: ControlCore, engine_id: int, pid: int | None = None) -> None:
    """A spawned engine says hello and is ready for work."""
    answer = core.hello(f"engine-{engine_id}".encode(), hello(engine_id, pid if pid is not None else 100 + engine_id))
    assert answer.admitted


def start_rollout(core: ControlCore, rollout_id: str = "r", num_prompts: int = 1, group_size: int = 2,
                  max_tokens: int = 64) -> None:
    """A client's rollout is accepted (not yet scheduled)."""
    req = RolloutRequest(call_id=f"call-{rollout_id}", rollout_id=rollout_id, group_size=group_size,
                         prompts=[Prompt(prompt_token_ids=[5, 6, 7 + i]) for i in range(num_prompts)],
                         sampling=SamplingParams(max_tokens=max_tokens))
    (accepted,) = core.clients.on_request(CLIENT, req)
    assert isinstance(accepted, ToClient) and isinstance(accepted.msg, RolloutAccepted)


def dispatch(core: ControlCore, clock: Clock) -> list[Dispatch]:
    """Schedule, and deliver every chunk as the server does (its deadline's clock starts)."""
    sent = core.scheduler.schedule()
    for send in sent:
        core.health.sent(send, clock.now)
    return sent


def errors(out: Outbox) -> list[tuple[str, str]]:
    """(code, message) of every ``ErrorReply`` a client is sent."""
    return [(s.msg.code, s.msg.message) for s in out if isinstance(s, ToClient) and hasattr(s.msg, "code")]
