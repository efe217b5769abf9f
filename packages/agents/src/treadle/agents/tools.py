"""Tool calls in text (Hermes / Qwen style) and a safe calculator for the arithmetic environment.

A model calls a tool by writing, anywhere in its turn::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

``parse_tool_calls`` finds such blocks (the gateway turns them into OpenAI ``tool_calls``; the
arithmetic environment executes them); a block that is not a JSON object with a string "name"
and object "arguments" is not a call and stays in the content. ``format_tool_call`` writes the
exact text the built-in ``chatml_tools`` template renders for a call, so a conversation that
goes through the template and back is token-stable.

``evaluate`` computes + - * / // % ** and parentheses over numbers from a Python AST (no names,
no calls, bounded sizes). Not here: running tools in general (the environment or agent does).
"""

from __future__ import annotations

import ast
import json
import operator
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**18


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        """The OpenAI chat-completions form (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def _call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text without the valid call blocks, stripped; the calls in order)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in TOOL_CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call, as the ``chatml_tools`` template renders it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
        return _UN[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        out = _BIN[type(node.op)](left, right)
        if abs(out) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return out
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError / ZeroDivisionError for bad ones."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _eval(tree.body)
    return int(value) if isinstance(value, float) and value.is_integer() else value
