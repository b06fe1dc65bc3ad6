"""The OpenAI-compatible endpoint (``[openai]``): ``POST /v1/chat/completions`` and
``GET /v1/models``, served by uvicorn + Starlette on the control plane's own event loop
(the calls read and change the scheduler's state, which only the loop may touch).

Every call must carry a bearer key: a live agent trajectory's (``agent_calls.py``: the
call becomes that trajectory's next turn, answered when the turn ends) or the operator's
``[openai] api_key`` (``/v1/models`` only). The answer is OpenAI's ``chat.completion``
(or its ``chat.completion.chunk`` stream with ``stream: true``) plus what the engines
sampled, as vLLM's ``return_token_ids`` gives it: ``choices[0].token_ids`` and
``choices[0].seer`` (logprobs of every token, the turn, the trajectory). Tool calls in the
Hermes format are parsed into ``message.tool_calls`` when the call offered ``tools``.
Refusals are OpenAI-style ``{"error": {"message", "type", "code"}}`` bodies with their
status codes: 401 (no or unknown key, trajectory ended), 400 (bad JSON or fields,
rewritten history, context exceeded), 404 (unknown model), 413 (body too large), 429 (a
call of the same trajectory in flight), 503 (the rollout was cancelled).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from seer.config import OpenAIConfig, SeerConfig
from seer.controlplane.agent_calls import CallRefused, ChatCall, parse_call, request_of, start_turn
from seer.controlplane.outbox import ToCall
from seer.controlplane.state import Request
from seer.protocol import TurnEnded
from seer.tool_calls import HermesParser

if TYPE_CHECKING:
    from seer.controlplane.scheduler import Scheduler
    from seer.controlplane.sessions import ClientSessions
    from seer.controlplane.tokenizer import Tokenizer

log = structlog.get_logger()

POLL_S = 0.05  # how often a call waiting for admission looks whether its rollout is there
SWEEP_S = 1.0  # how often the calls waiting for their turns are checked for an ended rollout or timeout
_json = msgspec.json.encode


def served_model_name(config: SeerConfig) -> str:
    """The model id ``/v1/models`` lists (and calls may name)."""
    if config.engines.backend == "sim":
        return "sim"
    return Path(config.model.path).name if config.model.path else "SmolLM2-135M-Instruct"


def http_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns SIGTERM and SIGINT."""

    def capture_signals(self):  # noqa: ANN201 - uvicorn's context manager
        import contextlib

        return contextlib.nullcontext()


@dataclass(slots=True)
class _Waiting:
    """A call waiting for its turn to be sampled."""

    fut: asyncio.Future
    rollout_id: str
    request: Request
    deadline: float  # time.monotonic()


def json_response(content: object, status_code: int = 200) -> Response:
    # msgspec, not JSONResponse's json.dumps: ~14 -> ~2.5 us for an answer of 16 tokens, and
    # bodies decode in ~10 us against json.loads' ~25 us; at 256 calls a round that is the
    # loop's time (benchmarks/openai_load.py). A -inf logprob becomes null, not an error.
    return Response(_json(content), status_code=status_code, media_type="application/json")


def refusal(exc: CallRefused) -> Response:
    return json_response({"error": {"message": str(exc), "type": exc.kind, "code": exc.code, "param": None}},
                         status_code=exc.status)


class OpenAIEndpoint:
    def __init__(self, config: OpenAIConfig, *, model: str, clients: ClientSessions, scheduler: Scheduler,
                 tokenizer: Tokenizer, schedule: Callable[[], Awaitable[None]], sock: socket.socket) -> None:
        self.config = config
        self.sock = sock  # bound by ``cli/daemon.py`` before any engine starts
        self.url = http_url(sock)
        clients.openai_url, clients.openai_model = self.url + "/v1", model  # what agent rollouts' clients are told
        self.model = model
        self.clients = clients
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.schedule = schedule
        self.parser = HermesParser()
        self.waiting: dict[str, _Waiting] = {}  # request id -> the call waiting for its turn
        self.num_calls = 0
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                     Route("/v1/models", self.models, methods=["GET"])])

    async def serve(self) -> None:
        """Answer calls until cancelled."""
        # Keep-alive beyond an agent's tool times: uvicorn's default (5 s) closed an idle
        # connection just as a call arrived on it while the loop stood still; the call was
        # never read and the agent got a ReadError (benchmarks/openai_load.py found it).
        server = _Server(uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=1,
                                        timeout_keep_alive=max(75, int(self.config.call_timeout_s))))
        log.info("openai_serving", url=self.url)
        sweeper = asyncio.create_task(self._sweep())
        try:
            await server.serve(sockets=[self.sock])
        finally:
            sweeper.cancel()
            for w in self.waiting.values():
                w.fut.cancel()

    async def _sweep(self) -> None:
        """End the waits of calls whose rollout ended or whose time ran out: one timer for
        all of them, not one per call (a ``wait_for`` per call cost ~10 us of the loop's)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for w in list(self.waiting.values()):
                if w.fut.done():
                    continue
                if w.rollout_id not in self.scheduler.rollouts or w.request.finish_reason is not None:
                    w.fut.set_exception(CallRefused(503, "rollout_cancelled", "the trajectory's rollout ended while "
                                                    "this call waited", kind="server_error"))
                elif now > w.deadline:
                    w.fut.set_exception(CallRefused(503, "call_timeout", f"the turn was not sampled within "
                                                    f"{self.config.call_timeout_s:g} s ([openai] call_timeout_s)",
                                                    kind="server_error"))

    def deliver(self, send: ToCall) -> None:
        w = self.waiting.get(send.request_id)
        if w is not None and not w.fut.done():
            w.fut.set_result(send.msg)

    # ------------------------------------------------------------------ routes
    def _key(self, http: HTTPRequest) -> str:
        scheme, _, key = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise CallRefused(401, "missing_api_key", "send the trajectory's key as 'Authorization: Bearer KEY' "
                              "(AgentContext.api_key)", kind="authentication_error")
        return key.strip()

    async def models(self, http: HTTPRequest) -> Response:
        try:
            key = self._key(http)
            if key != self.config.api_key and self.clients.agent_keys.lookup(key) is None:
                raise CallRefused(401, "invalid_api_key", "unknown key", kind="authentication_error")
        except CallRefused as exc:
            return refusal(exc)
        return json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                         "owned_by": "seer"}]})

    async def chat(self, http: HTTPRequest) -> Response:
        try:
            key = self._key(http)
            where = self.clients.agent_keys.lookup(key)
            if where is None:
                raise CallRefused(401, "invalid_api_key", "no live trajectory has this key (it ended, or was "
                                  "never issued); the operator key cannot start turns", kind="authentication_error")
            body = await self._body(http)
            call = parse_call(body, self.model)
            request = await self._admitted(*where)
            segment = start_turn(request, call, self.tokenizer, self._vocab_size(), self.parser)
        except CallRefused as exc:
            return refusal(exc)
        self.num_calls += 1
        waiting = _Waiting(asyncio.get_running_loop().create_future(), where[0], request,
                           time.monotonic() + self.config.call_timeout_s)
        self.waiting[request.request_id] = waiting
        try:
            if segment:
                log.info("agent_history_rewritten", request_id=request.request_id, turn=len(request.trajectory.turns) - 1,
                         segment=request.trajectory.turns[-1].segment, num_prompt_tokens=len(request.prompt_token_ids))
            self.scheduler.resume(request, new_segment=segment)
            await self.schedule()
            msg = await waiting.fut  # TurnEnded (``deliver``), or CallRefused (``_sweep``)
        except CallRefused as exc:
            return refusal(exc)
        finally:
            self.waiting.pop(request.request_id, None)
        return self._answer(call, request, msg)

    async def _body(self, http: HTTPRequest) -> object:
        limit = self.config.max_request_bytes
        if int(http.headers.get("content-length") or 0) > limit:
            raise CallRefused(413, "request_too_large", f"the body is over {limit} bytes ([openai] "
                              "max_request_bytes)")
        raw = bytearray()
        async for piece in http.stream():
            raw += piece
            if len(raw) > limit:
                raise CallRefused(413, "request_too_large", f"the body is over {limit} bytes ([openai] "
                                  "max_request_bytes)")
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise CallRefused(400, "invalid_json", f"the body is not JSON: {exc}") from None

    async def _admitted(self, rollout_id: str, group: int, sample: int) -> Request:
        """The trajectory's request, once its rollout left the backlog."""
        deadline = time.monotonic() + self.config.call_timeout_s
        while True:
            rollout = self.scheduler.rollouts.get(rollout_id)
            if rollout is not None:
                return request_of(rollout, group, sample)
            if not self.clients.agent_keys.has_rollout(rollout_id) or time.monotonic() > deadline:
                raise CallRefused(503, "rollout_not_running", f"rollout {rollout_id} is not running (cancelled, or "
                                  "not admitted in time)", kind="server_error")
            await asyncio.sleep(POLL_S)

    def _vocab_size(self) -> int:
        return self.clients.vocab_size()

    # ------------------------------------------------------------------ answers
    def _answer(self, call: ChatCall, request: Request, msg: TurnEnded) -> Response:
        parsed = self.parser.parse(msg.text) if call.tools else None
        tool_calls = [{"id": f"call_{msg.turn}_{i}", "type": "function",
                       "function": {"name": c.name, "arguments": _json(c.arguments).decode()}}
                      for i, c in enumerate(parsed.tool_calls)] if parsed else []
        content = (parsed.content if parsed else msg.text) or None
        finish = "tool_calls" if tool_calls else ("length" if msg.finish_reason == "length" else "stop")
        t = request.trajectory
        seer = {"turn": msg.turn, "rollout_id": msg.rollout_id, "group_index": msg.group_index,
                "sample_index": msg.sample_index, "logprobs": msg.logprobs,
                # > 0: the agent rewrote earlier messages and this turn runs in a new segment
                "segment": t.turns[msg.turn].segment if t is not None and msg.turn < len(t.turns) else 0}
        logprobs = {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp, "top_logprobs": []}
                                for t, lp in zip(msg.token_ids, msg.logprobs)]} if call.logprobs else None
        head = {"id": f"chatcmpl-{request.request_id.replace('/', '-')}-{msg.turn}", "created": int(time.time()),
                "model": self.model}
        usage = {"prompt_tokens": msg.num_context_tokens - len(msg.token_ids),
                 "completion_tokens": len(msg.token_ids), "total_tokens": msg.num_context_tokens}
        message: dict = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if not call.stream:
            return json_response({**head, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs,
                 "token_ids": msg.token_ids, "seer": seer}]})

        async def events():
            chunk = {**head, "object": "chat.completion.chunk"}
            delta: dict = {"role": "assistant", "content": content or ""}
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
            first = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": logprobs,
                     "token_ids": msg.token_ids, "seer": seer}
            yield b"data: " + _json({**chunk, "choices": [first]}) + b"\n\n"
            last = {"index": 0, "delta": {}, "finish_reason": finish}
            yield b"data: " + _json({**chunk, "choices": [last], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
