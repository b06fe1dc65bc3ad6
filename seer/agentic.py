"""Multi-turn trajectories, the client's side: the environment a trainer gives a rollout
(``rollout(..., env=...)``), what it is shown at each turn end (``Turn``) and what it
answers (``EnvReply``).

The daemon samples a turn until the model stops (EOS, a tool parser's stop string such
as ``</tool_call>``) or reaches ``sampling.max_tokens``, then sends ``TurnEnded``. The
client parses the turn's tool calls (``seer.tool_calls``, Hermes by default), runs the
environment (a plain or an async callable; a plain one in a worker thread) with the
trajectory's ``tool_timeout_s``, and sends its answer as a ``TurnInput``: messages to
append (rendered by the model's chat template on the daemon, appended as token ids,
never re-tokenizing what came before), or the end of the trajectory, with a reward if
it has one. An environment that raises ends its trajectory as ``tool_error`` (the
message kept in ``TurnRecord.error``); one that does not answer in time as
``tool_timeout``; the rest of the rollout goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from seer.protocol import ChatMessage, Prompt, TurnEnded, TurnInput
from seer.tool_calls import ToolCall, ToolCallParser

__all__ = ["Agent", "AgentContext", "EnvReply", "Environment", "Turn", "answer_turn", "run_agent", "tool_message"]


@dataclass
class Turn:
    """What an environment sees when a model turn ends."""

    rollout_id: str
    group_index: int
    sample_index: int
    turn: int  # 0 for the first
    prompt: Prompt
    text: str  # this turn's text
    token_ids: list[int]  # what this turn sampled
    finish_reason: str  # "stop" (EOS, a stop string) or "length" (the turn's max_tokens)
    tool_calls: list[ToolCall]  # parsed from ``text``
    parse_error: str | None  # a malformed tool call: what is wrong with it
    messages: list[dict] = field(default_factory=list)  # the conversation so far, this turn last
    final: bool = False  # a limit ends the trajectory whatever the answer (a reward is still kept)
    num_context_tokens: int = 0  # prompt + every token so far


@dataclass
class EnvReply:
    """An environment's answer: ``messages`` to append (e.g. ``tool_message(output)``,
    or user feedback) and go on, or ``done`` (no messages also means done)."""

    messages: list[ChatMessage | dict] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_name: str = ""


Environment = Callable[[Turn], "EnvReply | Awaitable[EnvReply]"]


@dataclass
class AgentContext:
    """What an agent function (``rollout(..., agent=fn)``) gets, once per sample: an
    OpenAI-compatible endpoint and a key that makes every call the next turn of this
    sample's trajectory (docs/integrations.md, "Any OpenAI-compatible agent")."""

    base_url: str  # e.g. http://127.0.0.1:PORT/v1: give it to openai.OpenAI(base_url=...) or an agent library
    api_key: str  # this trajectory's key; refused once the trajectory ended
    model: str  # the served model's id (GET /v1/models)
    prompt: Prompt
    group_index: int
    sample_index: int
    rollout_id: str


Agent = Callable[[AgentContext], Any]


def tool_message(content: str) -> ChatMessage:
    """A tool's output as a chat message (role ``tool``)."""
    return ChatMessage(role="tool", content=content)


def _message(m: ChatMessage | dict) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise TypeError(f"an environment message must be a ChatMessage or a dict with string 'role' and 'content', "
                        f"got {m!r}")
    return ChatMessage(role=m["role"], content=m["content"])


def first_messages(prompt: Prompt) -> list[dict]:
    if prompt.messages is not None:
        return [{"role": m.role, "content": m.content} for m in prompt.messages]
    return [{"role": "user", "content": prompt.prompt or ""}]


async def answer_turn(env: Environment, msg: TurnEnded, prompt: Prompt, history: list[dict],
                      parser: ToolCallParser | None, timeout_s: float, call_id: str) -> TurnInput:
    """Run ``env`` on a turn end and say what to send back. ``history`` (the trajectory's
    conversation) gets this turn and the environment's messages."""
    parsed = parser.parse(msg.text) if parser is not None else None
    history.append({"role": "assistant", "content": msg.text})
    turn = Turn(rollout_id=msg.rollout_id, group_index=msg.group_index, sample_index=msg.sample_index,
                turn=msg.turn, prompt=prompt, text=msg.text, token_ids=msg.token_ids,
                finish_reason=msg.finish_reason, tool_calls=list(parsed.tool_calls) if parsed else [],
                parse_error=parsed.error if parsed else None, messages=history, final=msg.final,
                num_context_tokens=msg.num_context_tokens)
    base = dict(call_id=call_id, rollout_id=msg.rollout_id, group_index=msg.group_index,
                sample_index=msg.sample_index, turn=msg.turn)
    started = time.monotonic()
    try:
        reply = await asyncio.wait_for(_call(env, turn), timeout_s)
        if reply is None:
            reply = EnvReply(done=True)
        if not isinstance(reply, EnvReply):
            raise TypeError(f"an environment must return an EnvReply (or None for done), got {type(reply).__name__}")
        messages = [_message(m) for m in reply.messages]
    except TimeoutError:
        return TurnInput(**base, outcome="tool_timeout", tool_s=time.monotonic() - started,
                         error=f"the environment did not answer within {timeout_s:g} s (TrajectorySpec.tool_timeout_s)")
    except Exception as exc:  # noqa: BLE001 - the trajectory ends as tool_error, the rollout goes on
        return TurnInput(**base, outcome="tool_error", tool_s=time.monotonic() - started,
                         error=f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - started
    history.extend({"role": m.role, "content": m.content} for m in messages)
    done = reply.done or not messages
    return TurnInput(**base, outcome="done" if done else "continue", messages=[] if done else messages,
                     tool_name=reply.tool_name, tool_s=seconds, reward=reply.reward)


async def _call(env: Environment, turn: Turn) -> EnvReply | None:
    if inspect.iscoroutinefunction(env) or inspect.iscoroutinefunction(env.__call__):  # a function or an object
        return await env(turn)  # type: ignore[misc]
    result = await asyncio.to_thread(env, turn)
    if inspect.isawaitable(result):
        return await result
    return result  # type: ignore[return-value]


async def run_agent(agent: Agent, ctx: AgentContext, call_id: str, executor) -> TurnInput:  # noqa: ANN001
    """Run an agent function for one sample; what to tell the daemon when it returns (its
    return value, JSON-able, becomes ``SampleResult.agent_return``) or raises (``tool_error``)."""
    base = dict(call_id=call_id, rollout_id=ctx.rollout_id, group_index=ctx.group_index,
                sample_index=ctx.sample_index, turn=-1)
    try:
        if inspect.iscoroutinefunction(agent):
            value = await agent(ctx)
        else:
            value = await asyncio.get_running_loop().run_in_executor(executor, agent, ctx)
            if inspect.isawaitable(value):
                value = await value
        import msgspec

        msgspec.json.encode(value)  # JSON-able, or it is the agent's error
    except Exception as exc:  # noqa: BLE001 - the trajectory ends as tool_error, the rollout goes on
        return TurnInput(**base, outcome="tool_error", error=f"the agent raised {type(exc).__name__}: {exc}")
    return TurnInput(**base, outcome="done", agent_return=value, reward=value if isinstance(value, float) else None)
