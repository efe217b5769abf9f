"""A number-guessing game (an example and a test fixture).

The environment holds a secret integer in ``[low, high]`` (the episode's label); each turn the
policy's first integer is its guess and the environment answers "Higher." or "Lower." as a user
message. Guessing right ends the episode with reward 1.0; after ``max_turns`` wrong guesses it
ends with reward 0.0. A turn without a number gets a reminder. ``games(n, seed)`` makes a
dataset of ``Episode``s. Observations are chat messages (rendered by the chat template).
"""

from __future__ import annotations

import random
import re

from treadle.agents.api import Action, Episode, Observation, StepResult

NUMBER = re.compile(r"-?\d+")


def instructions(low: int, high: int) -> str:
    return f"I am thinking of a number between {low} and {high}. Guess it: answer with one number."


def games(n: int, *, low: int = 1, high: int = 100, seed: int = 0) -> list[Episode]:
    rng = random.Random(seed)
    return [Episode(prompt=[{"role": "user", "content": instructions(low, high)}], label=rng.randint(low, high),
                    info={"index": i}) for i in range(n)]


class GuessingEnv:
    """One game (see the module docstring)."""

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 6) -> None:
        self.low, self.high, self.max_turns = low, high, max_turns
        self.secret = low
        self.turns = 0
        self.distance = float(high - low)

    async def reset(self, episode: Episode) -> Observation:
        if episode.label is None:
            raise ValueError("GuessingEnv needs the secret number as the episode's label")
        self.secret, self.turns, self.distance = int(episode.label), 0, float(self.high - self.low)
        return [{"role": "user", "content": episode.prompt}] if isinstance(episode.prompt, str) else list(episode.prompt)

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        m = NUMBER.search(action.text)
        guess = int(m.group()) if m else None
        if guess is not None:
            self.distance = float(abs(guess - self.secret))
        solved = guess == self.secret
        done = solved or self.turns >= self.max_turns
        logs = {"guesses": float(self.turns), "solved": float(solved), "distance": self.distance}
        if done:
            return StepResult(reward=float(solved), score=float(solved), done=True, extra_logs=logs)
        hint = ("Answer with one number." if guess is None else "Higher." if guess < self.secret else "Lower.")
        return StepResult(observation=[{"role": "user", "content": hint}], extra_logs=logs)
