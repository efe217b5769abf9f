"""Tool-call parsing and formatting, and the safe calculator."""

from __future__ import annotations

import json

import pytest

from treadle.agents.envs.arithmetic import CALCULATOR_TOOL
from treadle.agents.tools import ToolCall, evaluate, format_tool_call, parse_tool_calls


def test_parse_keeps_text_and_skips_invalid_blocks() -> None:
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
            ' and <tool_call>{"name": 3}</tool_call> <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2 + 3"}), ("f", {"x": 1})]
    assert content == 'Let me compute.  and <tool_call>{"name": 3}</tool_call>'
    assert parse_tool_calls("no calls here ") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>")[1] == []


def test_openai_form_and_format_round_trip() -> None:
    c = ToolCall("calculator", {"expression": "1 + 1"})
    o = c.openai()
    assert o["type"] == "function" and o["id"].startswith("call_")
    assert json.loads(o["function"]["arguments"]) == {"expression": "1 + 1"}
    text = format_tool_call("calculator", {"expression": "1 + 1"})
    assert parse_tool_calls(text)[1][0].arguments == {"expression": "1 + 1"}


def test_format_matches_the_builtin_template(chat) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "7 * 6"}'}}
    text = chat.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
                       tools=[CALCULATOR_TOOL], add_generation_prompt=False)
    assert "<|im_start|>assistant\n" + format_tool_call("calculator", {"expression": "7 * 6"}) + "<|im_end|>\n" in text


@pytest.mark.parametrize(("expr", "value"), [("2 + 3", 5), ("(7 + 5) * 3 - 4", 32), ("7 / 2", 3.5), ("8 / 2", 4),
                                             ("-3 ** 2", -9), ("17 // 5 % 2", 1)])
def test_evaluate(expr: str, value: float) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "x + 1", "2 ** 1000", "1 +", "a" * 300, "[1, 2]"])
def test_evaluate_refuses(expr: str) -> None:
    with pytest.raises(ValueError):
        evaluate(expr)


def test_evaluate_division_by_zero() -> None:
    with pytest.raises(ZeroDivisionError):
        evaluate("1 / 0")
