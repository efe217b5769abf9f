"""The example environments, driven by hand (no model)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from treadle.agents.api import Action, Episode
from treadle.agents.envs import ENVIRONMENTS, ArithmeticEnv, GuessingEnv, games, problems
from treadle.agents.tools import format_tool_call


def act(text: str, turn: int = 0) -> Action:
    return Action(text=text, token_ids=np.zeros(1, np.int32), finish_reason="stop", turn=turn, stopped=True)


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_arithmetic_tool_calls_then_answer() -> None:
    ep = problems(1, steps=2, seed=3)[0]
    assert ep.label == eval(ep.info["expression"]) and ep.tools[0]["function"]["name"] == "calculator"
    env = ArithmeticEnv(max_turns=4)
    obs = run(env.reset(ep))
    assert obs[0]["role"] == "user" and ep.info["expression"] in obs[0]["content"]
    r = run(env.step(act(format_tool_call("calculator", {"expression": ep.info["expression"]}))))
    assert not r.done and r.reward == 0 and r.observation[0]["role"] == "tool"
    assert r.observation[0]["content"] == str(ep.label)
    r = run(env.step(act("oops <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1/0\"}}</tool_call>")))
    assert r.observation[0]["content"].startswith("error:") and r.extra_logs["tool_errors"] == 1
    r = run(env.step(act(f"<answer>{ep.label}</answer>")))
    assert r.done and r.reward == 1.0 and r.score == 1.0
    assert r.extra_logs == {"tool_calls": 2.0, "tool_errors": 1.0, "turns": 3.0, "correct": 1.0}


def test_arithmetic_wrong_answer_nudge_and_turn_limit() -> None:
    env = ArithmeticEnv(max_turns=2)
    run(env.reset(Episode(prompt="Compute 1 + 1.", label=2)))
    r = run(env.step(act("hmm")))
    assert not r.done and r.observation[0]["role"] == "user" and "<answer>" in r.observation[0]["content"]
    r = run(env.step(act("still thinking")))
    assert r.done and r.reward == 0 and r.observation == []
    env = ArithmeticEnv()
    run(env.reset(Episode(prompt="Compute 1 + 1.", label=2)))
    assert run(env.step(act("<answer>3</answer>"))).reward == 0.0


def test_guessing_hints_and_solution() -> None:
    env = GuessingEnv(max_turns=4)
    run(env.reset(Episode(prompt="guess", label=42)))
    assert run(env.step(act("I say 10"))).observation[0]["content"] == "Higher."
    assert run(env.step(act("90"))).observation[0]["content"] == "Lower."
    assert run(env.step(act("no idea"))).observation[0]["content"] == "Answer with one number."
    r = run(env.step(act("42!")))
    assert r.done and r.reward == 1.0 and r.extra_logs["solved"] == 1.0 and r.extra_logs["guesses"] == 4.0


def test_guessing_gives_up_and_needs_a_label() -> None:
    env = GuessingEnv(max_turns=1)
    run(env.reset(games(1, seed=1)[0]))
    r = run(env.step(act("0")))
    assert r.done and r.reward == 0.0
    with pytest.raises(ValueError, match="label"):
        run(GuessingEnv().reset(Episode(prompt="x")))
    assert set(ENVIRONMENTS) == {"arithmetic", "guessing"}
