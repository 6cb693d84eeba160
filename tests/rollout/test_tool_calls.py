"""Qwen's ``<tool_call>`` format, parsed whole and as a stream (asyncrl.agents.tools)."""

from __future__ import annotations

import json

import pytest

from asyncrl.agents.tools import QwenToolCallStream, ToolCall, parse_qwen_tool_calls

NAMES = {"add", "echo"}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_plain_text_is_all_content():
    assert parse_qwen_tool_calls("  hello <tool_call", NAMES) == ("  hello <tool_call", [])


def test_one_call_and_the_content_before_it():
    content, calls = parse_qwen_tool_calls("Let me add.\n" + CALL, NAMES)
    assert content == "Let me add."
    assert calls == [ToolCall(name="add", arguments={"a": 1, "b": 2})]


def test_several_calls_bad_json_and_undeclared_tools_are_dropped():
    text = (
        CALL
        + '\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
        + "\n<tool_call>\n{not json}\n</tool_call>"
        + '\n<tool_call>\n{"name": "echo", "parameters": {"s": "x"}}\n</tool_call> trailing'
    )
    content, calls = parse_qwen_tool_calls(text, NAMES)
    assert content == ""
    assert [c.name for c in calls] == ["add", "echo"]
    assert calls[1].arguments == {"s": "x"}


def test_an_unclosed_call_is_no_call_and_no_content():
    assert parse_qwen_tool_calls('hi <tool_call>\n{"name": "add"', NAMES) == ("hi", [])


def _stream(text: str, step: int) -> tuple[str, list[ToolCall]]:
    s = QwenToolCallStream(NAMES)
    content, calls = "", []
    for end in range(step, len(text) + step, step):
        c, k = s.feed(text[:end], final=end >= len(text))
        content += c
        calls += k
    return content, calls


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize(
    "text",
    [
        "plain text, no call",
        "ends in spaces   ",
        "looks like <tool_ but is not",
        "Let me add.  \n" + CALL,
        CALL + "\n" + CALL.replace("add", "echo") + "\nafter",
        "x <tool_call>\n{broken",
    ],
)
def test_the_stream_adds_up_to_the_parse(text, step):
    assert _stream(text, step) == parse_qwen_tool_calls(text, NAMES)


def test_the_stream_holds_back_only_what_may_be_a_call():
    s = QwenToolCallStream(NAMES)
    assert s.feed("hello <tool") == ("hello", [])
    assert s.feed("hello <tooth") == (" <tooth", [])
    content, calls = s.feed("hello <tooth " + CALL)
    assert (content, json.dumps(calls[0].arguments)) == ("", '{"a": 1, "b": 2}')
