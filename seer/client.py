"""What a trainer imports: ``SeerClient`` (blocking) and ``AsyncSeerClient``.

Importable without torch or vLLM (only msgspec and pyzmq). One DEALER socket per
client; every call carries a ``call_id`` and a reader task routes replies to it, so
one async client can run many calls at once. While a rollout runs the client sends
heartbeats (the daemon aborts rollouts of clients that vanish) and expects the daemon
to answer them: a daemon silent for ``timeout_s`` raises ``SeerTimeoutError``, never
a hang. Service errors arrive as ``SeerServiceError`` with the daemon's message; a
value that cannot be sent at all (an integer beyond 64 bits, a lone surrogate) raises
``SeerInputError`` before anything is sent, and so does a rollout request larger than the
daemon's ``server.max_request_bytes`` whenever the client knows that limit (from the
daemon's ``daemon.json``, or ``max_request_bytes=``): the message is the one ``seerctl
rollout`` prints. Every error the client raises is a ``SeerError``.

A rollout that is left before its end (``break``, an exception, a closed generator, an
``on_group`` that raises, or ``close()`` with streams still open) is cancelled on the
daemon at once, so its engines are freed without waiting for ``client_lost``.

``SeerClient`` runs an ``AsyncSeerClient`` on a private event loop; do not share one
instance between threads, and use ``AsyncSeerClient`` inside a running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio

from seer.protocol import (
    Ack,
    CancelRollout,
    ClientHeartbeat,
    ErrorReply,
    GroupCompleted,
    GroupResult,
    Prompt,
    RolloutAccepted,
    RolloutCompleted,
    RolloutRequest,
    RolloutStats,
    SampleResult,
    SamplingParams,
    ServerMessage,
    ServiceStatus,
    ShutdownRequest,
    StatusReply,
    StatusRequest,
    UpdateWeightsRequest,
    WeightsUpdated,
)
from seer.auth import AuthError, ClientKeys, is_tcp
from seer.weights_segment import SegmentSource, WeightsSegmentError, parse_source
from seer.wire import Codec, FrameError, make_socket

__all__ = [
    "AsyncSeerClient",
    "ClientKeys",
    "GroupResult",
    "Prompt",
    "RolloutResult",
    "RolloutStream",
    "SampleResult",
    "SamplingParams",
    "SeerClient",
    "SeerError",
    "SeerInputError",
    "SeerProtocolError",
    "SeerServiceError",
    "SeerTimeoutError",
    "check_request_size",
    "daemon_info",
    "resolve_address",
]

DEFAULT_RUN_DIR = Path.home() / ".seer" / "run"

T = TypeVar("T")

PromptLike = Prompt | str | dict | Sequence[int]

# How long close() waits for the daemon to confirm the cancels of still-open rollouts
# (only when a daemon is connected; an unreachable one costs nothing).
CANCEL_CONFIRM_S = 2.0


class SeerError(Exception):
    """Base class of every error the client raises."""


class SeerServiceError(SeerError):
    """The daemon refused or failed a call; ``code`` is stable, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class SeerTimeoutError(SeerError):
    pass


class SeerInputError(SeerError):
    """A value the client cannot send (or that no daemon would accept): nothing was sent."""


class SeerProtocolError(SeerError):
    """The daemon answered with a message this call does not expect (a version mismatch
    or a bug); the message names both."""


def check_encodable(msg: object, what: str) -> bytes:
    """Encode ``msg`` as it would go on the wire, or raise ``SeerInputError`` naming ``what``
    and the problem (integers must fit 64 bits; text must be valid Unicode)."""
    try:
        return msgspec.msgpack.encode(msg)
    except OverflowError as exc:
        raise SeerInputError(f"{what}: an integer does not fit in 64 bits ({exc}); token ids, seeds and "
                             "counts must be between -2**63 and 2**64 - 1") from None
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end] if isinstance(exc.object, str) else ""
        raise SeerInputError(f"{what}: text is not valid Unicode ({bad!r} at position {exc.start}: "
                             f"{exc.reason}); remove lone surrogates or decode the text properly") from None
    except (TypeError, ValueError) as exc:
        raise SeerInputError(f"{what}: cannot be encoded ({exc})") from None


def _check_request(request: RolloutRequest, max_request_bytes: int | None) -> None:
    """SeerInputError naming the first prompt (or the sampling) that cannot be sent, or the
    size of a request the daemon would refuse (``check_request_size``)."""
    try:
        encoded = check_encodable(request, "rollout request")
    except SeerInputError:
        for index, prompt in enumerate(request.prompts):
            check_encodable(prompt, f"prompt {index}")
        check_encodable(request.sampling, "sampling")
        raise
    if max_request_bytes is not None:
        check_request_size(len(encoded), max_request_bytes)


def check_request_size(num_bytes: int, max_request_bytes: int) -> None:
    """SeerInputError if a rollout request of ``num_bytes`` (its msgpack payload) is over
    the daemon's ``server.max_request_bytes``: the client and ``seerctl rollout`` refuse it
    with this one message before sending (a daemon drops a frame far beyond its limit
    unread, and the caller would only see a timeout)."""
    if num_bytes > max_request_bytes:
        raise SeerInputError(f"the rollout request takes {num_bytes} bytes, more than server.max_request_bytes = "
                             f"{max_request_bytes} of the daemon; split the prompts into smaller rollouts or raise "
                             "server.max_request_bytes in the daemon's seer.toml")


def daemon_info(address: str, run_dir: str | Path | None = None) -> dict | None:
    """The ``daemon.json`` of the daemon serving ``address``: the run dir's (explicit, or
    the folder of an ``ipc://`` socket), if it names this address; None otherwise (a
    ``tcp://`` daemon on another host, or no daemon.json)."""
    folders = [Path(run_dir)] if run_dir else []
    if address.startswith("ipc://"):
        folders.append(Path(address[len("ipc://"):]).parent)
    for folder in folders:
        try:
            info = json.loads((folder / "daemon.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("client_address") == address:
            return info
    return None


def _expect(reply: ServerMessage, kind: type[T], call: str) -> T:
    if not isinstance(reply, kind):
        raise SeerProtocolError(f"{call}: the daemon answered {type(reply).__name__}, expected {kind.__name__}; "
                                "run the same Seer version on the client and the daemon")
    return reply


class RolloutResult(msgspec.Struct, kw_only=True):
    rollout_id: str
    groups: list[GroupResult]  # in prompt order
    stats: RolloutStats
    weights_version: int


def resolve_address(address: str | None, run_dir: str | Path | None = None) -> str:
    """An explicit address, or the one the daemon of ``run_dir`` (default ~/.seer/run) wrote."""
    if address:
        return address
    folder = Path(run_dir) if run_dir else DEFAULT_RUN_DIR
    info = folder / "daemon.json"
    try:
        return json.loads(info.read_text())["client_address"]
    except FileNotFoundError:
        raise SeerError(f"no Seer daemon found in {folder} (no daemon.json); start one with `seerctl start` "
                        "or pass address=") from None
    except (KeyError, ValueError) as exc:
        raise SeerError(f"{info} is unreadable ({exc}); restart the daemon with `seerctl start`") from None


def to_prompt(item: PromptLike, index: int) -> Prompt:
    if isinstance(item, Prompt):
        return item
    if isinstance(item, str):
        return Prompt(prompt=item)
    if isinstance(item, dict):
        try:
            return msgspec.convert(item, Prompt)
        except msgspec.ValidationError as exc:
            raise SeerInputError(f"prompt {index}: {exc}") from None
    if isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
        return Prompt(prompt_token_ids=list(item))
    raise SeerInputError(f"prompt {index}: expected str, dict, Prompt or a list of token ids, "
                         f"got {type(item).__name__}")


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
        cancels = [asyncio.wait_for(self._simple_call(CancelRollout(call_id=_new_id(), rollout_id=r)),
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
        reply = await self._simple_call(StatusRequest(call_id=_new_id()))
        return _expect(reply, StatusReply, "status").status

    async def update_weights(self, path: str | Path | SegmentSource, timeout_s: float = 600.0) -> int:
        """Load weights into every engine; returns the new weights version. ``path``: a
        safetensors checkpoint (file or folder) on the daemon's host, or a trainer's
        shared-memory segment (``seer.weights_segment.SegmentWriter.write``'s source)."""
        reply = await self._simple_call(UpdateWeightsRequest(call_id=_new_id(), path=_weights_source(path)),
                                        timeout_s)
        return _expect(reply, WeightsUpdated, "update_weights").weights_version

    async def cancel(self, rollout_id: str) -> None:
        await self._simple_call(CancelRollout(call_id=_new_id(), rollout_id=rollout_id))

    async def shutdown(self) -> None:
        """Ask the daemon to drain and exit."""
        await self._simple_call(ShutdownRequest(call_id=_new_id()))

    def stream_rollout(self, prompts: Iterable[PromptLike], group_size: int,
                       sampling: SamplingParams | None = None, *, policy: str | None = None,
                       timeout_s: float | None = None,
                       true_lengths: list[list[int]] | None = None, speculative: bool = True,
                       replay_lengths: list[list[int]] | None = None) -> RolloutStream:
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
        "suffix") refuses it; without SD it changes nothing."""
        request = RolloutRequest(call_id=_new_id(), rollout_id=_new_id(),
                                 prompts=[to_prompt(p, i) for i, p in enumerate(prompts)],
                                 group_size=group_size, sampling=sampling or SamplingParams(), policy=policy,
                                 true_lengths=true_lengths, speculative=speculative, replay_lengths=replay_lengths)
        _check_request(request, self.max_request_bytes)
        return RolloutStream(self, request, timeout_s)

    async def rollout(self, prompts: Iterable[PromptLike], group_size: int, sampling: SamplingParams | None = None,
                      *, policy: str | None = None, timeout_s: float | None = None,
                      on_group: Callable[[GroupResult], None] | None = None,
                      true_lengths: list[list[int]] | None = None, speculative: bool = True,
                      replay_lengths: list[list[int]] | None = None) -> RolloutResult:
        """Run a rollout to the end; groups come back in prompt order. An exception from
        ``on_group`` cancels the rollout on the daemon before it propagates."""
        stream = self.stream_rollout(prompts, group_size, sampling, policy=policy, timeout_s=timeout_s,
                                     true_lengths=true_lengths, speculative=speculative,
                                     replay_lengths=replay_lengths)
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


class RolloutStream:
    """Async iterator over a rollout's groups; ``stats`` is set once it is exhausted."""

    def __init__(self, client: AsyncSeerClient, request: RolloutRequest, timeout_s: float | None) -> None:
        self._client = client
        self._request = request
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
            while True:
                msg = await client._next(call, self._wait_s())
                match msg:
                    case GroupCompleted(group=group):
                        yield group
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
            client._calls.pop(call_id, None)
            was_open = self.rollout_id in client._open_rollouts  # close() may have cancelled it already
            client._open_rollouts.discard(self.rollout_id)
            if not finished and was_open and not client._closed:
                # Abandoned (timeout, error or the caller stopped iterating): free the engines.
                # Never blocking: a DEALER with no live peer (the daemon is gone, or a CURVE
                # handshake was refused) would hold a blocking send, and the caller, forever.
                try:
                    await client._send_nowait(CancelRollout(call_id=_new_id(), rollout_id=self.rollout_id))
                except zmq.ZMQError:
                    pass

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
                replay_lengths: list[list[int]] | None = None) -> RolloutResult:
        return self._loop.run_until_complete(self._client.rollout(
            prompts, group_size, sampling, policy=policy, timeout_s=timeout_s, on_group=on_group,
            true_lengths=true_lengths, speculative=speculative, replay_lengths=replay_lengths))

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


def _weights_source(path: str | Path | SegmentSource) -> str:
    """The source string on the wire: a segment's ``shm://`` name as it is, a path absolute."""
    try:
        segment = path if isinstance(path, SegmentSource) else parse_source(str(path))
    except WeightsSegmentError as exc:
        raise SeerInputError(str(exc)) from None
    return str(segment) if segment is not None else str(Path(path).resolve())


def _new_id() -> str:
    return uuid.uuid4().hex
