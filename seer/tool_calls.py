"""Tool calls in a model's turn, for multi-turn agentic rollouts (client side).

A multi-turn rollout generates until the model calls a tool; the client-side
environment then parses the turn's text, runs the tools, and appends their outputs as
token ids (``Tokenizer.encode_turn_suffix`` in the control plane) before generation
goes on. This module is the parsing half: a ``ToolCallParser`` turns one assistant
turn's text into a ``ParsedTurn`` (the text outside the calls, the calls, and an error
that says precisely what is wrong with a malformed call). Its ``stop`` strings are the
ones to end a turn at, so that a turn ends right after its tool call.

``HermesParser`` ("hermes") reads the Hermes / Qwen format that common chat templates
teach, one JSON object per call, possibly several calls in one turn::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``arguments`` may also come as a JSON string holding an object (some models write it
so); it is decoded. A missing or null ``arguments`` is ``{}``, and ``parameters`` is
read where ``arguments`` is missing. A text cut at the stop string ``</tool_call>``
lacks it (vLLM leaves the stop string out of the text): a final unclosed
``<tool_call>`` whose JSON parses is taken as complete.

Only msgspec and the stdlib are imported (``json`` for its clear error messages).
"""

from __future__ import annotations

import json
from typing import Protocol

import msgspec

__all__ = ["PARSERS", "HermesParser", "ParsedTurn", "ToolCall", "ToolCallParser", "parser"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: dict
    id: str = ""


class ParsedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn's text outside tool calls (stripped), its well-formed calls, and the
    first malformed call's error: the calls before it are in ``tool_calls``, none after
    it; calls count from 1 and a JSON error's char counts from the call's stripped JSON."""

    content: str
    tool_calls: list[ToolCall]
    error: str | None = None


class ToolCallParser(Protocol):
    stop: list[str]

    def parse(self, text: str) -> ParsedTurn: ...


class _CallError(Exception):
    """A malformed call; its message is the ``ParsedTurn.error`` text."""


def _json_error(exc: json.JSONDecodeError) -> str:
    # "Unterminated string starting at" already ends with "at"
    return f"{exc.msg.removesuffix(' at')} at char {exc.pos}"


def _arguments(number: int, obj: dict) -> dict:
    raw = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if raw is None:
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _CallError(
                f'tool call {number} has "arguments" as a string that is not valid JSON: {_json_error(exc)}'
            ) from None
    if not isinstance(raw, dict):
        raise _CallError(f'tool call {number} has "arguments" that is not a JSON object')
    return raw


def _call(number: int, body: str) -> ToolCall:
    """Decode one call's JSON (``number`` counts from 1 within the turn)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise _CallError(f"tool call {number} is not valid JSON: {_json_error(exc)}") from None
    if not isinstance(obj, dict):
        raise _CallError(f"tool call {number} is not a JSON object")
    if "name" not in obj:
        raise _CallError(f'tool call {number} has no "name"')
    name = obj["name"]
    if not isinstance(name, str) or not name:
        raise _CallError(f'tool call {number} has a "name" that is not a non-empty string')
    call_id = obj.get("id")
    return ToolCall(
        name=name, arguments=_arguments(number, obj), id=call_id if isinstance(call_id, str) else ""
    )


class HermesParser:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self.stop: list[str] = [self.CLOSE]

    def instructions(self, tools: list[dict]) -> str:
        """A system-prompt section that describes ``tools`` (OpenAI's ``tools`` entries) and
        this format, for a chat template that does not render tools itself."""
        described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou can call the functions described below, as JSON objects, inside "
                f"<tools></tools>:\n<tools>\n{described}\n</tools>\n\nTo call one, write its name and "
                f"arguments as one JSON object between {self.OPEN} and {self.CLOSE}:\n{self.OPEN}\n"
                f'{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{self.CLOSE}')

    def parse(self, text: str) -> ParsedTurn:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        error: str | None = None
        pos = 0
        while pos < len(text):
            start = text.find(self.OPEN, pos)
            stray = text.find(self.CLOSE, pos)
            if stray != -1 and (start == -1 or stray < start):
                pieces.append(text[pos:])
                error = error or f"{self.CLOSE} without an opening {self.OPEN}"
                break
            if start == -1:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:start])
            body_start = start + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            closed = end != -1
            body = text[body_start:end] if closed else text[body_start:]
            pos = end + len(self.CLOSE) if closed else len(text)
            if error is None:
                error = self._add(calls, body.strip(), closed)
        return ParsedTurn(content="".join(pieces).strip(), tool_calls=calls, error=error)

    def _add(self, calls: list[ToolCall], body: str, closed: bool) -> str | None:
        """Append the call in ``body``; return its error instead when it is malformed."""
        try:
            calls.append(_call(len(calls) + 1, body))
        except _CallError as exc:
            if not closed:
                return f"unclosed {self.OPEN}: {exc}"
            return str(exc)
        return None


PARSERS: dict[str, type] = {"hermes": HermesParser}


def parser(name: str) -> ToolCallParser:
    """A new parser of the named format (a key of ``PARSERS``)."""
    try:
        cls = PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {known}") from None
    return cls()
