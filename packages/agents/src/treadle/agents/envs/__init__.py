"""Example environments shipped with treadle-agents (native API, ``treadle.agents.api``).

``ENVIRONMENTS`` maps a name to ``(environment class, dataset maker)``: the class builds one
episode's environment (keyword options), the maker returns ``Episode``s for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from treadle.agents.envs.arithmetic import CALCULATOR_TOOL, ArithmeticEnv, problems
from treadle.agents.envs.guessing import GuessingEnv, games

ENVIRONMENTS: dict[str, tuple[type, Callable[..., list[Any]]]] = {
    "arithmetic": (ArithmeticEnv, problems),
    "guessing": (GuessingEnv, games),
}

__all__ = ["CALCULATOR_TOOL", "ENVIRONMENTS", "ArithmeticEnv", "GuessingEnv", "games", "problems"]
