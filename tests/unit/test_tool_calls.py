"""seer.tool_calls: the Hermes parser's calls, content and errors, and the registry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from seer.tool_calls import PARSERS, HermesParser, ParsedTurn, ToolCall, parser

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def parse(text: str) -> ParsedTurn:
    return HermesParser().parse(text)


def test_text_without_calls_is_content_stripped_and_no_error():
    assert parse("  The answer is 4.\n") == ParsedTurn(content="The answer is 4.", tool_calls=[])


def test_one_call_with_text_before_it():
    turn = parse("Let me check the weather.\n" + WEATHER)
    assert turn.content == "Let me check the weather."
    assert turn.tool_calls == [ToolCall(name="get_weather", arguments={"city": "Paris"})]
    assert turn.error is None


def test_several_calls_keep_their_order_and_the_text_between_and_after_is_content():
    turn = parse("First.\n" + WEATHER + "\nthen\n" + TIME + "\nDone.")
    assert [c.name for c in turn.tool_calls] == ["get_weather", "get_time"]
    assert turn.tool_calls[1].arguments == {"tz": "CET"}
    assert turn.content == "First.\n\nthen\n\nDone."
    assert turn.error is None


def test_calls_on_one_line_without_newlines_and_nested_arguments():
    turn = parse('<tool_call>{"name": "f", "arguments": {"a": [1, {"b": null}]}, "id": "c1"}</tool_call>')
    assert turn.tool_calls == [ToolCall(name="f", arguments={"a": [1, {"b": None}]}, id="c1")]
    assert turn.content == ""


def test_malformed_json_says_which_call_and_where_and_keeps_the_calls_before_it():
    bad = '<tool_call>\n{"name": "f" "arguments": {}}\n</tool_call>'
    turn = parse(WEATHER + bad + TIME)
    assert turn.error == "tool call 2 is not valid JSON: Expecting ',' delimiter at char 13"
    assert [c.name for c in turn.tool_calls] == ["get_weather"]  # nothing after the malformed call
    assert turn.content == ""


def test_missing_name():
    turn = parse('<tool_call>{"arguments": {"x": 1}}</tool_call>')
    assert turn.error == 'tool call 1 has no "name"' and turn.tool_calls == []


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": 3, "arguments": {}}', 'tool call 1 has a "name" that is not a non-empty string'),
        ('{"name": "", "arguments": {}}', 'tool call 1 has a "name" that is not a non-empty string'),
        ('["f", {}]', "tool call 1 is not a JSON object"),
        ('{"name": "f", "arguments": [1]}', 'tool call 1 has "arguments" that is not a JSON object'),
        ('{"name": "f", "arguments": "[1]"}', 'tool call 1 has "arguments" that is not a JSON object'),
        (
            '{"name": "f", "arguments": "{\\"a\\": }"}',
            'tool call 1 has "arguments" as a string that is not valid JSON: Expecting value at char 6',
        ),
        ("", "tool call 1 is not valid JSON: Expecting value at char 0"),
    ],
)
def test_other_malformed_calls(body, error):
    turn = parse(f"<tool_call>{body}</tool_call>")
    assert turn.error == error and turn.tool_calls == []


def test_arguments_as_a_json_string_holding_an_object_are_decoded():
    turn = parse('<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>')
    assert turn.tool_calls == [ToolCall(name="f", arguments={"city": "Paris"})] and turn.error is None


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "f"}', {}),
        ('{"name": "f", "arguments": null}', {}),
        ('{"name": "f", "parameters": {"k": 1}}', {"k": 1}),
    ],
)
def test_missing_or_null_arguments_are_empty_and_parameters_is_read(body, arguments):
    assert parse(f"<tool_call>{body}</tool_call>").tool_calls == [ToolCall(name="f", arguments=arguments)]


def test_a_turn_cut_at_the_stop_string_lacks_the_closing_tag_and_its_call_counts():
    cut = "Checking.\n" + WEATHER.removesuffix("</tool_call>")
    turn = parse(cut)
    assert turn == ParsedTurn(
        content="Checking.", tool_calls=[ToolCall(name="get_weather", arguments={"city": "Paris"})]
    )
    two = parse(TIME + "\n" + WEATHER.removesuffix("</tool_call>"))
    assert [c.name for c in two.tool_calls] == ["get_time", "get_weather"] and two.error is None


def test_an_unclosed_call_whose_json_is_cut_short_is_an_error():
    turn = parse(WEATHER + '\n<tool_call>\n{"name": "get_time", "argu')
    assert (
        turn.error
        == "unclosed <tool_call>: tool call 2 is not valid JSON: Unterminated string starting at char 21"
    )
    assert [c.name for c in turn.tool_calls] == ["get_weather"]


def test_a_closing_tag_without_an_opening_one_is_an_error_and_stays_in_content():
    turn = parse(WEATHER + "oops</tool_call>")
    assert turn.error == "</tool_call> without an opening <tool_call>"
    assert [c.name for c in turn.tool_calls] == ["get_weather"] and turn.content == "oops</tool_call>"


def test_stop_strings_and_the_registry():
    hermes = parser("hermes")
    assert isinstance(hermes, HermesParser) and hermes.stop == ["</tool_call>"]
    hermes.stop.append("x")  # instances do not share their stop list
    assert parser("hermes").stop == ["</tool_call>"]
    assert PARSERS == {"hermes": HermesParser}
    with pytest.raises(ValueError, match=r"unknown tool call parser 'mistral'; known parsers: hermes"):
        parser("mistral")


def test_parsed_turns_round_trip_through_msgspec_json():
    import msgspec

    turn = parse("hi " + WEATHER)
    assert msgspec.json.decode(msgspec.json.encode(turn), type=ParsedTurn) == turn


def test_the_module_imports_msgspec_and_the_stdlib_only():
    heavy = ("transformers", "torch", "numpy", "jinja2")
    code = f"import sys, seer.tool_calls; print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
