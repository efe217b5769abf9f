"""A multi-step arithmetic environment with a calculator tool (an example and a test fixture).

Each problem is an integer expression of a few operations, e.g. ``(7 + 5) * 3 - 4``. The policy
may call the ``calculator`` tool (``CALCULATOR_TOOL``, Hermes-style ``<tool_call>`` blocks; see
``treadle.agents.tools``) as many times as it likes; each call's result comes back as a ``tool``
message. It ends the episode by writing ``<answer>N</answer>``: reward 1.0 when N is the value,
else 0.0. A turn with neither a call nor an answer gets a user message asking for one; after
``max_turns`` turns the episode ends with reward 0.

Observations are chat messages, so the prompt and every tool result go through the chat
template (``chatml_tools`` renders tools). ``problems(n, steps, seed)`` makes a dataset of
``Episode``s (prompt, label = the value, tools = [CALCULATOR_TOOL]).
"""

from __future__ import annotations

import random
import re
from typing import Any

from treadle.agents.api import Action, Episode, Message, Observation, StepResult
from treadle.agents.tools import evaluate, parse_tool_calls

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
ANSWER = re.compile(r"<answer>\s*(-?\d+(?:\.\d+)?)\s*</answer>")
NUDGE = "Call the calculator, or give the final answer as <answer>N</answer>."


def question(expression: str) -> str:
    return f"Compute {expression}. Use the calculator tool, then answer as <answer>N</answer>."


def make_problem(rng: random.Random, steps: int) -> tuple[str, int]:
    """(expression of ``steps`` operations on integers 1..20, its value)."""
    expr = str(rng.randint(1, 20))
    for i in range(steps):
        op = rng.choice("+-*")
        expr = f"{expr} {op} {rng.randint(1, 20)}" if i == 0 else f"({expr}) {op} {rng.randint(1, 20)}"
    return expr, int(evaluate(expr))


def problems(n: int, *, steps: int = 2, seed: int = 0) -> list[Episode]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        expr, value = make_problem(rng, steps)
        out.append(Episode(prompt=[{"role": "user", "content": question(expr)}], label=value,
                           tools=[CALCULATOR_TOOL], info={"expression": expr, "index": i}))
    return out


class ArithmeticEnv:
    """One episode of the calculator game (see the module docstring)."""

    def __init__(self, max_turns: int = 4) -> None:
        self.max_turns = max_turns
        self.answer: float | None = None
        self.turns = self.calls = self.errors = 0

    async def reset(self, episode: Episode) -> Observation:
        self.answer = None if episode.label is None else float(episode.label)
        self.turns = self.calls = self.errors = 0
        if isinstance(episode.prompt, str):
            return [{"role": "user", "content": episode.prompt}]
        return list(episode.prompt)

    def _run(self, arguments: dict[str, Any]) -> str:
        try:
            return str(evaluate(str(arguments.get("expression", ""))))
        except (ValueError, ZeroDivisionError, TypeError) as e:
            self.errors += 1
            return f"error: {e}"

    def _logs(self, correct: float) -> dict[str, float]:
        return {"tool_calls": float(self.calls), "tool_errors": float(self.errors), "turns": float(self.turns),
                "correct": correct}

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        content, calls = parse_tool_calls(action.text)
        m = ANSWER.search(content)
        if m is not None:
            correct = float(self.answer is not None and abs(float(m.group(1)) - self.answer) < 1e-9)
            return StepResult(reward=correct, score=correct, done=True, extra_logs=self._logs(correct))
        done = self.turns >= self.max_turns
        if calls:
            self.calls += len(calls)
            obs: list[Message] = [{"role": "tool", "tool_call_id": c.id, "content": self._run(c.arguments)}
                                  if c.name == "calculator" else
                                  {"role": "tool", "tool_call_id": c.id, "content": f"error: no tool {c.name!r}"}
                                  for c in calls]
        else:
            obs = [{"role": "user", "content": NUDGE}]
        return StepResult(observation=[] if done else obs, done=done, score=0.0, extra_logs=self._logs(0.0))
