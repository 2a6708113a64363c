"""Tool-call parsing: the tagged (Hermes/Qwen), short python and bare JSON formats, complete calls
only, malformed calls as errors, several calls in order, code with braces, quotes and tags."""

from __future__ import annotations

import json

import pytest

from services.runner.toolcalls import (
    FORMATS,
    HERMES,
    JSON,
    PYTHON_TAG,
    ToolCall,
    end_markers,
    formats_of,
    parse_tool_calls,
)

TRICKY_CODE = 'd = {"a": {"b": [1, 2]}}\nprint(f"{d[\'a\']}", "}{", \'"\\\\n"\')\nprint("</tool_call>")'
"""Braces, both quotes, an escaped backslash and the closing tag itself inside a string."""


def hermes(name: str, arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_hermes_call_with_tricky_code_round_trips() -> None:
    text = f"Let me compute.\n{hermes('python', {'code': TRICKY_CODE})}"
    assert parse_tool_calls(text) == [ToolCall("python", {"code": TRICKY_CODE})]
    [call] = parse_tool_calls(text, [HERMES])
    assert json.loads(call.arguments_json) == {"code": TRICKY_CODE}


def test_hermes_qwen_layout_with_newlines_and_string_arguments() -> None:
    qwen = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    openai = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x = 1\\"}"}</tool_call>'
    llama = '<tool_call>{"name": "search", "parameters": {"q": "cats"}}</tool_call>'
    assert parse_tool_calls(qwen) == [ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls(openai) == [ToolCall("python", {"code": "x = 1"})]
    assert parse_tool_calls(llama) == [ToolCall("search", {"q": "cats"})]


def test_python_tag_is_the_code_as_written() -> None:
    text = "First:\n<python>\n    for i in range(2):\n        print({i: '}'})\n</python>\nthen more"
    assert parse_tool_calls(text) == [ToolCall("python", {"code": "for i in range(2):\n    print({i: '}'})"})]
    assert parse_tool_calls(text, [HERMES, JSON]) == [], "a format not asked for is text"


def test_several_calls_in_order_across_formats() -> None:
    text = f"<python>a = 1</python> and {hermes('python', {'code': 'print(a)'})} <python>b</python>"
    assert [call.arguments["code"] for call in parse_tool_calls(text)] == ["a = 1", "print(a)", "b"]
    assert [c.arguments["code"] for c in parse_tool_calls(text, [PYTHON_TAG])] == ["a = 1", "b"]


def test_bare_json_calls() -> None:
    one = '  {"name": "python", "arguments": {"code": "print(\'{}\')"}}\n'
    assert parse_tool_calls(one) == [ToolCall("python", {"code": "print('{}')"})]
    two = json.dumps([{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}])
    assert parse_tool_calls(two, [JSON]) == [ToolCall("a", {}), ToolCall("b", {"x": 1})]
    assert parse_tool_calls(one, [HERMES, PYTHON_TAG]) == [], "bare JSON only when the format is read"


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",
        '{"answer": 42}',  # JSON, but not a call
        '[1, 2, {"name": "x"}]',
        'Here: {"name": "python", "arguments": {}}',  # prose around bare JSON
        '{"name": "python", "arguments": {"code": "1"}',  # unbalanced: not JSON, so an answer
        '<tool_call>{"name": "python", "arguments": {"code": "1"}}',  # no closing tag yet
        "<python>print(1)",
        "",
    ],
)
def test_text_without_a_complete_call_calls_nothing(text: str) -> None:
    assert parse_tool_calls(text) == []


def test_an_unclosed_call_after_a_complete_one_is_ignored() -> None:
    text = f'{hermes("python", {"code": "1"})}<tool_call>{{"name": "python"'
    assert parse_tool_calls(text) == [ToolCall("python", {"code": "1"})]


@pytest.mark.parametrize(
    ("body", "name", "error"),
    [
        ("print(1)", "", "not valid JSON"),
        ('{"name": "python", "arguments": {"code": "1"}', "", "not valid JSON"),
        ('["python"]', "", "must be a JSON object"),
        ('{"arguments": {"code": "1"}}', "", 'no "name" string'),
        ('{"name": "", "arguments": {}}', "", 'no "name" string'),
        ('{"name": "python", "arguments": ["print(1)"]}', "python", '"arguments" must be a JSON object'),
        ('{"name": "python", "arguments": "not json"}', "python", "arguments string is not valid JSON"),
    ],
)
def test_malformed_calls_are_returned_with_an_error(body: str, name: str, error: str) -> None:
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert error in call.error and call.arguments == {}
    assert call.name == name, "the name is kept when it can be read"


def test_a_malformed_call_does_not_hide_the_next_one() -> None:
    text = f"<tool_call>{{oops}}</tool_call>{hermes('python', {'code': 'print(2)'})}"
    first, second = parse_tool_calls(text)
    assert "not valid JSON" in first.error
    assert second == ToolCall("python", {"code": "print(2)"})


def test_a_malformed_bare_call_is_an_error() -> None:
    [call] = parse_tool_calls('{"name": "python", "arguments": 3}', [JSON])
    assert call.name == "python" and '"arguments" must be a JSON object' in call.error


def test_formats_and_their_end_markers() -> None:
    assert formats_of("auto") == FORMATS and formats_of("json") == (JSON,)
    assert end_markers(FORMATS) == ["</tool_call>", "</python>"]
    assert end_markers([JSON]) == [], "a bare JSON call ends with the turn"
    with pytest.raises(ValueError, match="unknown tool call format"):
        formats_of("xml")
