"""An OpenAI call turned into a trajectory's next turn (``controlplane/agent_calls.py``) on
the pure scheduler core: a call that repeats the conversation and adds to it appends the
template's diff; one that rewrote earlier messages starts a new segment (the old tokens
kept apart, its KV dropped, the engine given only the new prompt); a rewrite past the
trajectory's limits is refused and changes nothing; a call's ``tools`` reach the prompt
(the template's own tool section, or the parser's instructions where it has none)."""

from __future__ import annotations

import pytest

from seer.controlplane import turns
from seer.controlplane.agent_calls import CallRefused, ChatCall, parse_call, start_turn
from seer.controlplane.state import RequestState
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import ChatMessage, unpack_token_ids
from seer.tool_calls import HermesParser
from tests.unit.test_chunked_policies import scheduler
from tests.unit.test_turns import end_turn, trajectory_rollout

TOK = ByteTokenizer()
FIRST = [ChatMessage(role="system", content="add"), ChatMessage(role="user", content="1 and 2")]
RETRY = [ChatMessage(role="system", content="add"), ChatMessage(role="user", content="3 and 4")]


def agent_trajectory(max_turns: int = 4, max_total: int | None = None):
    """A scheduler and one agent trajectory waiting for its first call."""
    sched = scheduler("request")
    r = trajectory_rollout("request", max_turns=max_turns, max_total=max_total)
    r.agent = True
    q = r.groups[0].requests[0]
    q.state = RequestState.TOOL_WAIT  # an agent rollout's samples wait for their first call
    sched.submit(r)
    return sched, q


def call(sched, q, messages: list[ChatMessage], tokens: list[int]) -> bool:
    """One call: its turn started, run on an engine that samples ``tokens``."""
    segment = start_turn(q, ChatCall(messages=messages), TOK, TOK.vocab_size)
    sched.resume(q, new_segment=segment)
    [d] = sched.schedule()
    context = unpack_token_ids(d.task.prompt_token_ids)
    assert context == q.prompt_token_ids + q.generated_token_ids  # what the engine is given
    end_turn(sched, d, tokens)
    return segment


def test_appending_calls_extend_one_segment():
    sched, q = agent_trajectory()
    assert not call(sched, q, FIRST, [7, 8, TOK.EOS])
    assert q.prompt_token_ids == TOK.encode_chat(FIRST)
    later = [*FIRST, ChatMessage(role="assistant", content="anything"), ChatMessage(role="tool", content="3")]
    assert not call(sched, q, later, [9, TOK.EOS])
    appended = TOK.encode_turn_suffix([ChatMessage(role="tool", content="3")], ended_with_eos=True)
    assert q.generated_token_ids == [7, 8, TOK.EOS, *appended, 9, TOK.EOS]
    assert q.trajectory.segments == [] and [t.segment for t in q.trajectory.turns] == [0, 0]


@pytest.mark.parametrize("second", [
    RETRY,  # the same length, another question: a retry
    FIRST[:1] + [ChatMessage(role="user", content="only this")],  # a truncating agent
    [*FIRST, ChatMessage(role="assistant", content="x"), ChatMessage(role="assistant", content="my own")],
])
def test_a_rewritten_history_starts_a_new_segment(second):
    sched, q = agent_trajectory()
    call(sched, q, FIRST, [7, 8, TOK.EOS])
    q.kv_valid_tokens = 5  # as if the pool held the first segment's KV
    assert call(sched, q, second, [5, 6])  # the engine was given the new prompt alone (``call`` checks)
    t = q.trajectory
    (old,) = t.segments
    assert old.prompt_token_ids == TOK.encode_chat(FIRST) and old.token_ids == [7, 8, TOK.EOS]
    assert old.loss_mask == [1, 1, 1] and old.logprobs == [-0.5] * 3
    assert q.prompt_token_ids == TOK.encode_chat(second) and q.generated_token_ids == [5, 6]
    assert turns.loss_mask(q) == [1, 1] and q.kv_valid_tokens == 0
    assert [(r.segment, r.start, r.end, r.outcome) for r in t.turns] == [(0, 0, 3, "continue"), (1, 0, 2, "")]
    # The new segment goes on appending as usual.
    assert not call(sched, q, [*second, ChatMessage(role="assistant", content=""),
                               ChatMessage(role="tool", content="ok")], [4])
    assert [r.segment for r in t.turns] == [0, 1, 1] and len(t.segments) == 1


def test_a_rewrite_past_the_limits_is_refused_and_changes_nothing():
    sched, q = agent_trajectory(max_turns=1)
    call(sched, q, FIRST, [7, TOK.EOS])
    with pytest.raises(CallRefused) as refused:
        start_turn(q, ChatCall(messages=RETRY), TOK, TOK.vocab_size)
    assert (refused.value.status, refused.value.code) == (400, "max_turns")
    sched, q = agent_trajectory(max_total=64)
    call(sched, q, FIRST, [7, TOK.EOS])
    with pytest.raises(CallRefused) as refused:
        start_turn(q, ChatCall(messages=[ChatMessage(role="user", content="x" * 80)]), TOK, TOK.vocab_size)
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    assert q.state is RequestState.TOOL_WAIT and q.trajectory.segments == [] and q.generated_token_ids == [7, TOK.EOS]
    assert q.prompt_token_ids == TOK.encode_chat(FIRST) and len(q.trajectory.turns) == 1


TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two numbers",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


class ToolTemplate(ByteTokenizer):
    """A chat template with a tool section of its own."""

    def encode_chat(self, messages, tools=None):
        head = [ChatMessage(role="tools", content=str([t["function"]["name"] for t in tools]))] if tools else []
        return super().encode_chat([*head, *messages])


@pytest.mark.parametrize("system", [False, True])
def test_tools_reach_the_prompt_where_the_template_ignores_them(system):
    """SmolLM2's template (like the byte tokenizer's) has no tool section: the parser's
    instructions describe the tools in the system message; the turn stops at a call."""
    parser = HermesParser()
    messages = ([ChatMessage(role="system", content="be brief")] if system else []) + FIRST[1:]
    sched, q = agent_trajectory()
    start_turn(q, ChatCall(messages=messages, tools=TOOLS), TOK, TOK.vocab_size, parser)
    system_text = ("be brief\n\n" if system else "") + parser.instructions(TOOLS)
    assert q.prompt_token_ids == TOK.encode_chat([ChatMessage(role="system", content=system_text), *FIRST[1:]])
    assert '"name": "add"' in system_text and "</tool_call>" in q.sampling.stop
    # Without tools, nothing is added and the turn has no parser stop.
    sched, q = agent_trajectory()
    start_turn(q, ChatCall(messages=messages), TOK, TOK.vocab_size, parser)
    assert q.prompt_token_ids == TOK.encode_chat(messages) and "</tool_call>" not in q.sampling.stop


def test_a_template_that_renders_tools_gets_them_as_they_are():
    tok = ToolTemplate()
    sched, q = agent_trajectory()
    start_turn(q, ChatCall(messages=FIRST, tools=TOOLS), tok, tok.vocab_size, HermesParser())
    assert q.prompt_token_ids == tok.encode_chat(FIRST, tools=TOOLS) != tok.encode_chat(FIRST)


@pytest.mark.parametrize("tools", [{"name": "add"}, [{"type": "function"}], [{"function": {"name": 3}}]])
def test_malformed_tools_are_refused(tools):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with pytest.raises(CallRefused) as refused:
        parse_call(body, "m")
    assert (refused.value.status, refused.value.code) == (400, "invalid_tools")
