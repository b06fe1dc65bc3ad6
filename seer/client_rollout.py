"""One rollout on the wire, from the client's side: ``RolloutStream`` iterates a
rollout's groups as they complete (sending heartbeats while it runs, and cancelling the
rollout on the daemon when the caller leaves before the end), and ``RolloutResult`` is
what ``rollout()`` returns once it has them all. ``AsyncSeerClient.stream_rollout``
builds the stream; the socket and the routing of replies stay in ``seer.client_async``.
``seer.client`` re-exports both."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
import zmq

from seer.agentic import Agent, AgentContext, Environment, answer_turn, first_messages, run_agent
from seer.client_errors import SeerProtocolError, SeerTimeoutError
from seer.client_requests import new_id
from seer.protocol import (
    Ack,
    CancelRollout,
    ClientHeartbeat,
    GroupCompleted,
    GroupResult,
    RolloutAccepted,
    RolloutCompleted,
    RolloutRequest,
    RolloutStats,
    TurnEnded,
    TurnInput,
)
from seer.tool_calls import ToolCallParser

if TYPE_CHECKING:
    from seer.client_async import AsyncSeerClient, _Call

__all__ = ["RolloutResult", "RolloutStream"]


class RolloutResult(msgspec.Struct, kw_only=True):
    rollout_id: str
    groups: list[GroupResult]  # in prompt order
    stats: RolloutStats
    weights_version: int


class RolloutStream:
    """Async iterator over a rollout's groups; ``stats`` is set once it is exhausted."""

    def __init__(self, client: AsyncSeerClient, request: RolloutRequest, timeout_s: float | None,
                 env: Environment | None = None, parser: ToolCallParser | None = None,
                 agent: Agent | None = None) -> None:
        self._client = client
        self._request = request
        self._env = env
        self._parser = parser
        self._histories: dict[tuple[int, int], list[dict]] = {}  # (group, sample) -> its conversation
        self._turn_tasks: set[asyncio.Task] = set()
        self._agent = agent
        self._executor: ThreadPoolExecutor | None = None
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.rollout_id = request.rollout_id
        self.num_groups = len(request.prompts)
        self.policy: str | None = None
        self.weights_version = -1
        self.stats: RolloutStats | None = None

    def __aiter__(self) -> AsyncIterator[GroupResult]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[GroupResult]:
        client = self._client
        call_id, call = await client._open(self._request)
        client._open_rollouts.add(self.rollout_id)
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeats())
        finished = False
        try:
            accepted = await self._accepted(call)
            self.policy = accepted.policy
            self.weights_version = accepted.weights_version
            if self._agent is not None:
                self._start_agents(call, accepted)
            while True:
                msg = await client._next(call, self._wait_s())
                match msg:
                    case GroupCompleted(group=group):
                        for sample in group.samples:
                            self._histories.pop((group.group_index, sample.sample_index), None)
                        yield group
                    case TurnEnded():
                        self._answer(call, msg)
                    case BaseException():
                        raise msg
                    case RolloutCompleted(stats=stats, weights_version=version):
                        self.stats = stats
                        self.weights_version = version
                        finished = True
                        return
                    case Ack():
                        continue  # heartbeat answers: the daemon is alive
                    case _:
                        raise SeerProtocolError(f"rollout {self.rollout_id}: the daemon sent "
                                                f"{type(msg).__name__} during the rollout; run the same Seer "
                                                "version on the client and the daemon")
        except SeerTimeoutError:
            if self._deadline is not None and time.monotonic() >= self._deadline:
                raise SeerTimeoutError(f"rollout {self.rollout_id} did not finish within its timeout; "
                                       "it has been cancelled") from None
            raise
        finally:
            heartbeat.cancel()
            for task in self._turn_tasks:
                task.cancel()
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            client._calls.pop(call_id, None)
            was_open = self.rollout_id in client._open_rollouts  # close() may have cancelled it already
            client._open_rollouts.discard(self.rollout_id)
            if not finished and was_open and not client._closed:
                # Abandoned (timeout, error or the caller stopped iterating): free the engines.
                # Never blocking: a DEALER with no live peer (the daemon is gone, or a CURVE
                # handshake was refused) would hold a blocking send, and the caller, forever.
                try:
                    await client._send_nowait(CancelRollout(call_id=new_id(), rollout_id=self.rollout_id))
                except zmq.ZMQError:
                    pass

    def _start_agents(self, call: _Call, accepted: RolloutAccepted) -> None:
        """One agent function per sample, each with its trajectory's key (``seer.agentic``)."""
        request, keys = self._request, self._request.agent_keys
        assert self._agent is not None and keys is not None
        # Plain agent functions block on HTTP calls: a thread each, not the loop's few.
        executor = ThreadPoolExecutor(max_workers=min(256, len(request.prompts) * request.group_size),
                                      thread_name_prefix="seer-agent")
        loop = asyncio.get_running_loop()
        for g, prompt in enumerate(request.prompts):
            for s in range(request.group_size):
                ctx = AgentContext(base_url=accepted.openai_url, api_key=keys[g][s], model=accepted.openai_model,
                                   prompt=prompt, group_index=g, sample_index=s, rollout_id=self.rollout_id)
                task = loop.create_task(self._run_agent(call, ctx, executor))
                self._turn_tasks.add(task)
                task.add_done_callback(self._turn_tasks.discard)
        self._executor = executor

    async def _run_agent(self, call: _Call, ctx: AgentContext, executor: ThreadPoolExecutor) -> None:
        assert self._agent is not None
        await self._send(call, await run_agent(self._agent, ctx, self._request.call_id, executor))

    def _answer(self, call: _Call, msg: TurnEnded) -> None:
        """Run the environment on a turn end, in its own task, and send its answer."""
        if self._env is None or self._request.trajectory is None:
            call.queue.put_nowait(SeerProtocolError(f"rollout {self.rollout_id}: the daemon sent a turn end for a "
                                                    "rollout without an environment; run the same Seer version on "
                                                    "the client and the daemon"))
            return
        task = asyncio.get_running_loop().create_task(self._run_env(call, msg))
        self._turn_tasks.add(task)
        task.add_done_callback(self._turn_tasks.discard)

    async def _run_env(self, call: _Call, msg: TurnEnded) -> None:
        prompt = self._request.prompts[msg.group_index]
        history = self._histories.setdefault((msg.group_index, msg.sample_index), first_messages(prompt))
        spec = self._request.trajectory
        assert self._env is not None and spec is not None
        answer = await answer_turn(self._env, msg, prompt, history, self._parser, spec.tool_timeout_s,
                                   self._request.call_id)
        await self._send(call, answer)

    async def _send(self, call: _Call, answer: TurnInput) -> None:
        client = self._client
        try:
            sent = await client._sock.poll(client.timeout_s * 1000, zmq.POLLOUT) and await client._send_nowait(answer)
        except zmq.ZMQError as exc:
            sent, why = False, str(exc)
        else:
            why = "no daemon took it"
        if not sent and not client._closed:
            call.queue.put_nowait(SeerTimeoutError(f"rollout {self.rollout_id}: could not send an environment's "
                                                   f"answer to the daemon at {client.address} ({why})"))

    async def _accepted(self, call: _Call) -> RolloutAccepted:
        """Wait for the daemon to accept the request, skipping heartbeat Acks (which can
        arrive first while a large request is decoded) but bounded by ``timeout_s`` in all:
        a daemon that answers heartbeats yet never the request (its socket dropped a frame
        beyond its hard size cap) must not keep the client waiting forever."""
        client = self._client
        deadline = time.monotonic() + client.timeout_s
        while True:
            try:
                msg = await client._next(call, max(0.0, deadline - time.monotonic()))
            except SeerTimeoutError:
                if not call.answered:
                    raise
                raise SeerTimeoutError(
                    f"the Seer daemon at {client.address} answers heartbeats but did not accept rollout "
                    f"{self.rollout_id} within {client.timeout_s:.0f} s; a request far beyond the daemon's "
                    "server.max_request_bytes is dropped unread: split the rollout into smaller calls") from None
            match msg:
                case RolloutAccepted():
                    return msg
                case Ack():
                    continue
                case _:
                    raise SeerProtocolError(f"rollout {self.rollout_id}: the daemon answered {type(msg).__name__}, "
                                            "expected RolloutAccepted; run the same Seer version on the client "
                                            "and the daemon")

    def _wait_s(self) -> float:
        wait = self._client.timeout_s
        if self._deadline is not None:
            wait = min(wait, max(0.0, self._deadline - time.monotonic()))
        return wait

    async def _heartbeats(self) -> None:
        client = self._client
        while True:
            await asyncio.sleep(client.heartbeat_interval_s)
            # Dropped when no daemon is connected; a daemon that stays silent ends the
            # rollout with SeerTimeoutError in _iterate.
            await client._send_nowait(ClientHeartbeat(call_id=self._request.call_id, rollout_ids=[self.rollout_id]))
