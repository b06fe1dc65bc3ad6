"""``AsyncSeerClient``: the asyncio client, and the plumbing every call shares.

One DEALER socket per client; every call carries a ``call_id`` and a reader task routes
replies to it, so one client can run many calls at once. Owns the socket, the sends
(never left pending: ``_send_nowait``), the waits for replies (bounded by ``timeout_s``:
a silent daemon raises ``SeerTimeoutError``), the calls of the API, and the cancels
``close()`` sends for rollouts still open. A rollout's own iteration (heartbeats, its
messages, its cancel when abandoned) is ``seer.client_rollout.RolloutStream``, which
uses this plumbing; ``seer.client`` re-exports the client."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from seer.agentic import Agent, Environment
from seer.auth import AuthError, ClientKeys, is_tcp
from seer.client_errors import SeerError, SeerInputError, SeerProtocolError, SeerServiceError, SeerTimeoutError
from seer.client_requests import (
    DEFAULT_RUN_DIR,
    PromptLike,
    check_encodable,
    check_request,
    daemon_info,
    expect_reply,
    new_id,
    resolve_address,
    to_prompt,
    weights_source,
)
from seer.client_rollout import RolloutResult, RolloutStream
from seer.protocol import (
    CancelRollout,
    ErrorReply,
    GroupResult,
    RolloutRequest,
    SamplingParams,
    ServerMessage,
    ServiceStatus,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    TrajectorySpec,
    UpdateWeightsRequest,
    WeightsUpdated,
)
from seer.tool_calls import ToolCallParser
from seer.tool_calls import parser as make_parser
from seer.weights_segment import SegmentSource
from seer.wire import Codec, FrameError, make_socket

__all__ = ["CANCEL_CONFIRM_S", "AsyncSeerClient"]

# How long close() waits for the daemon to confirm the cancels of still-open rollouts
# (only when a daemon is connected; an unreachable one costs nothing).
CANCEL_CONFIRM_S = 2.0


class _Call:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[ServerMessage] = asyncio.Queue()
        self.answered = False


class AsyncSeerClient:
    """``keys``: CURVE keys for a daemon serving tcp:// with authentication
    (``ClientKeys.from_dir(DIR)`` for the files of ``seerctl keys DIR``)."""

    def __init__(self, address: str | None = None, *, run_dir: str | Path | None = None, timeout_s: float = 60.0,
                 heartbeat_interval_s: float = 1.0, keys: ClientKeys | None = None,
                 max_request_bytes: int | None = None) -> None:
        self.address = resolve_address(address, run_dir)
        self.timeout_s = timeout_s
        # The daemon's server.max_request_bytes: a larger request is refused here, at once
        # (``check_request_size``). Given, or read from the daemon's daemon.json (the run
        # dir's, or the ipc:// socket's folder); unknown (None) for a tcp:// daemon elsewhere.
        if max_request_bytes is None:
            limit = (daemon_info(self.address, run_dir or (None if address else DEFAULT_RUN_DIR)) or {}).get(
                "max_request_bytes")
            max_request_bytes = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
        self.max_request_bytes = max_request_bytes
        self.heartbeat_interval_s = heartbeat_interval_s
        try:
            curve = keys.socket_options() if keys is not None and is_tcp(self.address) else None
        except AuthError as exc:
            raise SeerInputError(str(exc)) from None
        self._ctx = zmq.asyncio.Context()
        try:
            self._sock = make_socket(self._ctx, zmq.DEALER, self.address, bind=False,
                                     identity=f"client-{uuid.uuid4().hex[:12]}".encode(), curve=curve)
        except zmq.ZMQError as exc:
            self._ctx.term()
            raise SeerInputError(f"cannot connect to {self.address[:200]!r}: {exc.strerror}; an address is "
                                 "ipc://PATH (at most ~100 characters) or tcp://HOST:PORT") from None
        self._codec: Codec[ServerMessage] = Codec(ServerMessage)
        self._calls: dict[str, _Call] = {}
        self._open_rollouts: set[str] = set()  # sent and not finished: cancelled by close()
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> AsyncSeerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel the rollouts still open on this client (so the daemon frees their engines
        now, not after ``client_lost``), then release the socket."""
        if self._closed:
            return
        if self._open_rollouts and self._reader is not None:
            await self._cancel_open_rollouts()
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(0)
        self._ctx.term()

    async def _cancel_open_rollouts(self) -> None:
        # Confirmed cancels (bounded): a socket closed with LINGER=0 right after a
        # fire-and-forget send would drop it.
        cancels = [asyncio.wait_for(self._simple_call(CancelRollout(call_id=new_id(), rollout_id=r)),
                                    CANCEL_CONFIRM_S) for r in list(self._open_rollouts)]
        self._open_rollouts.clear()
        await asyncio.gather(*cancels, return_exceptions=True)

    # ------------------------------------------------------------------ plumbing
    def _start(self) -> None:
        if self._closed:
            raise SeerError("the client is closed")
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = self._codec.decode(frames)
            except FrameError:
                continue
            call = self._calls.get(msg.call_id)
            if call is not None:
                call.answered = True
                call.queue.put_nowait(msg)
            elif isinstance(msg, ErrorReply) and not msg.call_id:
                # A frame the daemon could not decode carries no call id: it belongs to
                # the call(s) still waiting for their first answer.
                for c in self._calls.values():
                    if not c.answered:
                        c.queue.put_nowait(msg)

    async def _open(self, msg: msgspec.Struct) -> tuple[str, _Call]:
        self._start()
        call_id = msg.call_id  # type: ignore[attr-defined]
        check_encodable(msg, type(msg).__name__)  # SeerInputError before anything is registered or sent
        call = self._calls[call_id] = _Call()
        # A DEALER with no connected peer cannot send (no daemon listening, or a CURVE
        # handshake it refused): wait for the socket to become writable, bounded like every
        # other network await, then send without blocking.
        if not await self._sock.poll(self.timeout_s * 1000, zmq.POLLOUT) or not await self._send_nowait(msg):
            self._calls.pop(call_id, None)
            raise SeerTimeoutError(f"could not reach the Seer daemon at {self.address} within {self.timeout_s:.0f} s "
                                   "(it did not answer the connection); check that it runs and, on tcp://, that "
                                   "the CURVE keys match")
        return call_id, call

    async def _send_nowait(self, msg: msgspec.Struct) -> bool:
        """Send now or not at all (False: no connected daemon to take it). Every send of the
        client goes through here, so a pyzmq send is never left pending: pyzmq queues even a
        NOBLOCK send behind a pending one, without a timeout -- with the daemon unreachable
        (a CURVE handshake it refuses), a cancelled heartbeat's pending send made the
        rollout's final cancel wait forever."""
        try:
            await self._sock.send_multipart(self._codec.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def _next(self, call: _Call, timeout_s: float) -> ServerMessage:
        try:
            msg = await asyncio.wait_for(call.queue.get(), timeout_s)
        except TimeoutError:
            hint = ("; on tcp://, check that the CURVE keys match (a daemon with keys ignores clients without)"
                    if is_tcp(self.address) and not call.answered else "")
            raise SeerTimeoutError(f"the Seer daemon at {self.address} did not answer within {timeout_s:.0f} s; "
                                   f"check `seerctl status` and the daemon log{hint}") from None
        if isinstance(msg, ErrorReply):
            raise SeerServiceError(msg.code, msg.message)
        return msg

    async def _simple_call(self, msg: msgspec.Struct, timeout_s: float | None = None) -> ServerMessage:
        call_id, call = await self._open(msg)
        try:
            return await self._next(call, timeout_s or self.timeout_s)
        finally:
            self._calls.pop(call_id, None)

    # ------------------------------------------------------------------ API
    async def status(self) -> ServiceStatus:
        reply = await self._simple_call(StatusRequest(call_id=new_id()))
        return expect_reply(reply, StatusReply, "status").status

    async def update_weights(self, path: str | Path | SegmentSource, timeout_s: float = 600.0) -> int:
        """Load weights into every engine; returns the new weights version. ``path``: a
        safetensors checkpoint (file or folder) on the daemon's host, or a trainer's
        shared-memory segment (``seer.weights_segment.SegmentWriter.write``'s source)."""
        reply = await self._simple_call(UpdateWeightsRequest(call_id=new_id(), path=weights_source(path)),
                                        timeout_s)
        return expect_reply(reply, WeightsUpdated, "update_weights").weights_version

    async def cancel(self, rollout_id: str) -> None:
        await self._simple_call(CancelRollout(call_id=new_id(), rollout_id=rollout_id))

    async def shutdown(self) -> None:
        """Ask the daemon to drain and exit."""
        await self._simple_call(ShutdownRequest(call_id=new_id()))

    def stream_rollout(self, prompts: Iterable[PromptLike], group_size: int,
                       sampling: SamplingParams | None = None, *, policy: str | None = None,
                       timeout_s: float | None = None,
                       true_lengths: list[list[int]] | None = None, speculative: bool = True,
                       replay_lengths: list[list[int]] | None = None, env: Environment | None = None,
                       trajectory: TrajectorySpec | None = None,
                       tool_parser: ToolCallParser | str | None = "hermes",
                       replay_turns: list[list[list[int]]] | None = None,
                       agent: Agent | None = None) -> RolloutStream:
        """Yield each group as soon as its last sample finishes (completion order).

        Leaving the iteration early cancels the rollout on the daemon: at once on an
        exception or ``aclose()``, on the loop's next turn after a ``break`` (when the
        abandoned generator is finalised), and at the latest on ``close()``.

        ``true_lengths`` (``[prompt][sample]``, recorded from an earlier run with the same
        seed) is the input of the ``oracle`` policies, for benchmarks; leave it unset.
        ``replay_lengths`` (``[prompt][sample]``, benchmarks: trace replay) makes every sample
        decode exactly that many tokens, EOS ignored; the policies are not told them.

        ``speculative=False``: no speculative drafts for this rollout's samples, on a daemon
        whose engines use grouped speculative decoding (seeded samples then stay the same
        under every policy, as without SD). A daemon with vLLM's own drafters ("ngram",
        "suffix") refuses it; without SD it changes nothing.

        ``env``: every sample is a multi-turn trajectory (``seer.agentic``): at each turn end
        ``env`` gets a ``Turn`` (its text, parsed tool calls, the conversation) and answers
        with an ``EnvReply``; ``trajectory`` sets its limits (``TrajectorySpec()`` if None;
        ``sampling.max_tokens`` is then per turn). ``tool_parser`` finds tool calls (a
        ``seer.tool_calls`` parser or its name; None: none) and adds its stop strings.
        ``replay_turns`` (``[prompt][sample][turn]``, benchmarks: agentic trace replay):
        every turn decodes exactly that many tokens, EOS ignored.

        ``agent``: every sample is run by ``agent(ctx)`` (a plain or async function) against the
        daemon's OpenAI-compatible endpoint (``[openai]``): ``ctx.base_url`` and ``ctx.api_key``
        (``seer.agentic.AgentContext``) make each of its chat-completions calls the next turn of
        its trajectory; what it returns comes back as ``SampleResult.agent_return``."""
        sampling = sampling or SamplingParams()
        parser = None
        agent_keys = None
        if agent is not None:
            if env is not None:
                raise SeerInputError("pass env= or agent=, not both: an agent's calls are its turns")
            trajectory = trajectory or TrajectorySpec()
            num_prompts = len(prompts := list(prompts))
            agent_keys = [[secrets.token_urlsafe(24) for _ in range(group_size)] for _ in range(num_prompts)]
        elif env is not None:
            trajectory = trajectory or TrajectorySpec()
            parser = make_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
            if parser is not None and parser.stop:
                sampling = msgspec.structs.replace(sampling, stop=list(sampling.stop) + [
                    s for s in parser.stop if s not in sampling.stop])
        elif trajectory is not None:
            raise SeerInputError("a trajectory needs an environment: pass env=... (seer.agentic)")
        request = RolloutRequest(call_id=new_id(), rollout_id=new_id(),
                                 prompts=[to_prompt(p, i) for i, p in enumerate(prompts)],
                                 group_size=group_size, sampling=sampling, policy=policy,
                                 true_lengths=true_lengths, speculative=speculative, replay_lengths=replay_lengths,
                                 trajectory=trajectory, replay_turns=replay_turns, agent_keys=agent_keys)
        check_request(request, self.max_request_bytes)
        return RolloutStream(self, request, timeout_s, env, parser, agent)

    async def rollout(self, prompts: Iterable[PromptLike], group_size: int, sampling: SamplingParams | None = None,
                      *, policy: str | None = None, timeout_s: float | None = None,
                      on_group: Callable[[GroupResult], None] | None = None,
                      true_lengths: list[list[int]] | None = None, speculative: bool = True,
                      replay_lengths: list[list[int]] | None = None, env: Environment | None = None,
                      trajectory: TrajectorySpec | None = None,
                      tool_parser: ToolCallParser | str | None = "hermes",
                      replay_turns: list[list[list[int]]] | None = None,
                      agent: Agent | None = None) -> RolloutResult:
        """Run a rollout to the end; groups come back in prompt order. An exception from
        ``on_group`` cancels the rollout on the daemon before it propagates."""
        stream = self.stream_rollout(prompts, group_size, sampling, policy=policy, timeout_s=timeout_s,
                                     true_lengths=true_lengths, speculative=speculative,
                                     replay_lengths=replay_lengths, env=env, trajectory=trajectory,
                                     tool_parser=tool_parser, replay_turns=replay_turns, agent=agent)
        groups: list[GroupResult] = []
        # aclosing: the stream's cleanup (the cancel) runs here, not whenever the
        # abandoned generator is collected (never, on SeerClient's idle private loop).
        async with contextlib.aclosing(aiter(stream)) as completed:
            async for group in completed:
                groups.append(group)
                if on_group is not None:
                    on_group(group)
        groups.sort(key=lambda g: g.group_index)
        if stream.stats is None:
            raise SeerProtocolError(f"rollout {stream.rollout_id} ended without its RolloutCompleted")
        return RolloutResult(rollout_id=stream.rollout_id, groups=groups, stats=stream.stats,
                             weights_version=stream.weights_version)
