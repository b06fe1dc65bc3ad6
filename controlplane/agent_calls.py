"""Agent rollouts through the OpenAI-compatible endpoint: which trajectory a call's key
names, and a call turned into that trajectory's next turn. Pure (no sockets, no HTTP).

A rollout sent with ``RolloutRequest.agent_keys`` gives each sample a bearer key; its
trajectory waits (``TOOL_WAIT``, no turn yet) until a call arrives with that key. The
first call's messages are rendered by the chat template (with the generation prompt) and
become the sample's prompt; every later call must repeat the conversation so far (the
model's own turns may come back in any form: only their place is checked) and add
messages after it (tool outputs, user turns), which are appended as the template's diff
(``turns.answer``: never re-tokenized). A call that rewrote earlier messages (a truncating
agent, a retry, an assistant message of its own) starts a new segment: its whole
conversation is rendered as a fresh prompt and the tokens so far are kept apart
(``turns.new_segment``, ``SampleResult.segments``), never mixed with the new ones. Each
call's ``max_tokens``, ``temperature``, ``top_p`` and ``stop`` apply to its turn, over the
rollout's sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from seer.controlplane import turns
from seer.controlplane.state import Request, RequestState, Rollout
from seer.controlplane.tokenizer import Tokenizer
from seer.protocol import ChatMessage, TurnInput
from seer.tool_calls import HermesParser


class CallRefused(Exception):
    """An OpenAI-style error: HTTP ``status``, ``code`` and a message naming the fix."""

    def __init__(self, status: int, code: str, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind


@dataclass
class ChatCall:
    """A checked ``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage]
    tools: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False


def _content(value: object, index: int) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text only
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise CallRefused(400, "unsupported_content", f"messages[{index}] has a content part that is not "
                                  "text; Seer serves text-only models")
            parts.append(part["text"])
        return "".join(parts)
    raise CallRefused(400, "invalid_message", f"messages[{index}].content must be a string or a list of text parts")


def parse_call(body: object, model: str) -> ChatCall:
    """The call, or ``CallRefused`` naming the field (unknown fields are ignored, as OpenAI's
    own clients send many; fields that would change the meaning are refused)."""
    if not isinstance(body, dict):
        raise CallRefused(400, "invalid_json", "the body must be a JSON object")
    if body.get("model") not in (None, model):
        raise CallRefused(404, "model_not_found", f"model {body.get('model')!r} is not served here; "
                          f"GET /v1/models lists {model!r}")
    if body.get("n", 1) != 1:
        raise CallRefused(400, "unsupported_n", "n must be 1: each call is one turn of one trajectory")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise CallRefused(400, "invalid_messages", "messages must be a non-empty list")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise CallRefused(400, "invalid_message", f"messages[{i}] must be an object with a string role")
        messages.append(ChatMessage(role=m["role"], content=_content(m.get("content"), i)))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise CallRefused(400, "invalid_max_tokens", "max_tokens must be a positive integer")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise CallRefused(400, "invalid_stop", "stop must be a string or a list of strings")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int | float) or value < 0):
            raise CallRefused(400, f"invalid_{name}", f"{name} must be a non-negative number")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise CallRefused(400, "invalid_tools", 'tools must be a list of {"type": "function", "function": '
                          '{"name": ..., "description": ..., "parameters": {...}}} objects')
    return ChatCall(messages=messages, tools=tools, max_tokens=max_tokens,
                    temperature=body.get("temperature"), top_p=body.get("top_p"), stop=stop,
                    logprobs=bool(body.get("logprobs")), stream=bool(body.get("stream")))


class AgentKeys:
    """Bearer key -> (rollout id, group index, sample index) of the open agent rollouts."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[str, int, int]] = {}
        self._by_rollout: dict[str, list[str]] = {}

    def add(self, rollout_id: str, keys: list[list[str]]) -> None:
        flat = []
        for g, row in enumerate(keys):
            for s, key in enumerate(row):
                self._keys[key] = (rollout_id, g, s)
                flat.append(key)
        self._by_rollout[rollout_id] = flat

    def remove(self, rollout_id: str) -> None:
        for key in self._by_rollout.pop(rollout_id, []):
            self._keys.pop(key, None)

    def has_rollout(self, rollout_id: str) -> bool:
        return rollout_id in self._by_rollout

    def taken(self, keys: list[list[str]]) -> bool:
        return any(key in self._keys for row in keys for key in row)

    def lookup(self, key: str) -> tuple[str, int, int] | None:
        return self._keys.get(key)


def request_of(rollout: Rollout, group: int, sample: int) -> Request:
    return rollout.groups[group].requests[sample]


def start_turn(request: Request, call: ChatCall, tokenizer: Tokenizer, vocab_size: int,
               parser: HermesParser | None = None) -> bool:
    """Make ``call`` the waiting trajectory's next turn (the caller resumes it), or refuse it.
    ``parser``: the endpoint's tool-call format, for a call with ``tools`` (its stop strings
    end the turn at a call; its instructions describe the tools where the template does not).
    True: the call rewrote earlier messages and starts a new segment (the caller resumes it
    with ``new_segment``: its saved KV no longer matches its tokens)."""
    t = request.trajectory
    if t is None or request.state is not RequestState.TOOL_WAIT:
        raise CallRefused(429, "call_in_flight", "this trajectory's previous call has not been answered yet; a "
                          "trajectory's calls are sequential", kind="rate_limit_error")
    if t.pending_end is not None or request.finish_reason is not None:
        raise CallRefused(401, "trajectory_ended", "this trajectory has ended; its key is no longer valid",
                          kind="authentication_error")
    if t.base_sampling is None:
        t.base_sampling = request.sampling
    base = t.base_sampling
    sampling = msgspec.structs.replace(
        base, max_tokens=call.max_tokens or base.max_tokens,
        temperature=base.temperature if call.temperature is None else float(call.temperature),
        top_p=base.top_p if call.top_p is None else min(1.0, max(1e-6, float(call.top_p))),
        stop=list(dict.fromkeys([*base.stop, *(parser.stop if parser and call.tools else []), *call.stop])))
    segment = False
    if t.num_calls == 0:
        request.prompt_token_ids = _rendered(request, call, tokenizer, parser)
    elif _appends(t.conversation, call.messages):
        _next_call(request, call, tokenizer, vocab_size)
    else:
        if len(t.turns) >= t.max_turns:
            raise CallRefused(400, "max_turns", f"this trajectory has had its {t.max_turns} turns "
                              "(TrajectorySpec.max_turns)")
        turns.new_segment(request, _rendered(request, call, tokenizer, parser))
        segment = True
    request.sampling = sampling
    if t.num_calls == 0 or segment:
        t.conversation = [(m.role, m.content) for m in call.messages]
    t.num_calls += 1
    t.conversation.append(("assistant", None))
    return segment


def _rendered(request: Request, call: ChatCall, tokenizer: Tokenizer, parser: HermesParser | None) -> list[int]:
    """The call's whole conversation as a prompt (with the generation prompt), within the
    trajectory's context budget. Its ``tools`` go to the chat template; where the template
    renders nothing of them (SmolLM2's has no tool section), ``parser``'s instructions
    describe them in the system message instead, so the model still sees its tools."""
    t = request.trajectory
    assert t is not None
    try:
        ids = tokenizer.encode_chat(call.messages)
        if call.tools:
            with_tools = tokenizer.encode_chat(call.messages, tools=call.tools)
            if with_tools == ids and parser is not None:  # the template ignores tools
                with_tools = tokenizer.encode_chat(_with_instructions(call.messages, parser.instructions(call.tools)))
            ids = with_tools
    except ValueError as exc:
        raise CallRefused(400, "template_error", str(exc)) from None
    if len(ids) + 1 > t.max_context_tokens:
        raise CallRefused(400, "context_length_exceeded", f"the messages are {len(ids)} tokens; this trajectory "
                          f"allows {t.max_context_tokens} in all (TrajectorySpec.max_total_tokens, "
                          "model.max_model_len)")
    return ids


def _with_instructions(messages: list[ChatMessage], instructions: str) -> list[ChatMessage]:
    """``instructions`` at the end of the system message (one is added where there is none)."""
    if messages[0].role == "system":
        head = ChatMessage(role="system", content=f"{messages[0].content}\n\n{instructions}")
        return [head, *messages[1:]]
    return [ChatMessage(role="system", content=instructions), *messages]


def _appends(held: list[tuple[str, str | None]], messages: list[ChatMessage]) -> bool:
    """Does the call repeat the conversation held (the model's own turns only by their
    place: an agent may send them back in any form) and add user or tool messages after it?"""
    if len(messages) <= len(held):
        return False
    for (role, content), m in zip(held, messages):
        if m.role != role or (content is not None and m.content != content):
            return False
    return not any(m.role == "assistant" for m in messages[len(held):])


def _next_call(request: Request, call: ChatCall, tokenizer: Tokenizer, vocab_size: int) -> None:
    t = request.trajectory
    assert t is not None
    new = call.messages[len(t.conversation):]
    answer = TurnInput(call_id="", rollout_id="", group_index=0, sample_index=0, turn=len(t.turns) - 1,
                       messages=new)
    ended = turns.answer(request, answer, tokenizer, vocab_size)
    if ended is not None:  # a limit: the trajectory cannot take this call
        error = t.turns[-1].error or ended
        t.turns[-1].outcome = ""  # the trajectory is still the agent's to end
        raise CallRefused(400, "context_length_exceeded" if ended == "context_budget" else ended, error)
    t.conversation.extend((m.role, m.content) for m in new)
