"""``SeerClient``: the blocking client, the same API as ``AsyncSeerClient`` run on a
private event loop (each call is ``run_until_complete`` of the async one). Owns that
loop and nothing else; do not share one instance between threads, and use
``AsyncSeerClient`` inside a running event loop. ``seer.client`` re-exports it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

from seer.agentic import Agent, Environment
from seer.auth import ClientKeys
from seer.client_async import AsyncSeerClient
from seer.client_requests import PromptLike
from seer.client_rollout import RolloutResult
from seer.protocol import GroupResult, SamplingParams, ServiceStatus, TrajectorySpec
from seer.tool_calls import ToolCallParser
from seer.weights_segment import SegmentSource

__all__ = ["SeerClient"]


class SeerClient:
    """Blocking client: the same API as ``AsyncSeerClient``, on a private event loop."""

    def __init__(self, address: str | None = None, *, run_dir: str | Path | None = None, timeout_s: float = 60.0,
                 heartbeat_interval_s: float = 1.0, keys: ClientKeys | None = None,
                 max_request_bytes: int | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(_make_async(address, run_dir, timeout_s, heartbeat_interval_s,
                                                                 keys, max_request_bytes))
        self.address = self._client.address

    def __enter__(self) -> SeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def rollout(self, prompts: Iterable[PromptLike], group_size: int, sampling: SamplingParams | None = None,
                *, policy: str | None = None, timeout_s: float | None = None,
                on_group: Callable[[GroupResult], None] | None = None,
                true_lengths: list[list[int]] | None = None, speculative: bool = True,
                replay_lengths: list[list[int]] | None = None, env: Environment | None = None,
                trajectory: TrajectorySpec | None = None,
                tool_parser: ToolCallParser | str | None = "hermes",
                replay_turns: list[list[list[int]]] | None = None, agent: Agent | None = None) -> RolloutResult:
        return self._loop.run_until_complete(self._client.rollout(
            prompts, group_size, sampling, policy=policy, timeout_s=timeout_s, on_group=on_group,
            true_lengths=true_lengths, speculative=speculative, replay_lengths=replay_lengths, env=env,
            trajectory=trajectory, tool_parser=tool_parser, replay_turns=replay_turns, agent=agent))

    def status(self) -> ServiceStatus:
        return self._loop.run_until_complete(self._client.status())

    def update_weights(self, path: str | Path | SegmentSource, timeout_s: float = 600.0) -> int:
        return self._loop.run_until_complete(self._client.update_weights(path, timeout_s))

    def cancel(self, rollout_id: str) -> None:
        self._loop.run_until_complete(self._client.cancel(rollout_id))

    def shutdown(self) -> None:
        self._loop.run_until_complete(self._client.shutdown())


async def _make_async(address: str | None, run_dir: str | Path | None, timeout_s: float,
                      heartbeat_interval_s: float, keys: ClientKeys | None,
                      max_request_bytes: int | None) -> AsyncSeerClient:
    return AsyncSeerClient(address, run_dir=run_dir, timeout_s=timeout_s, heartbeat_interval_s=heartbeat_interval_s,
                           keys=keys, max_request_bytes=max_request_bytes)
