"""Format checks: does a response follow the expected layout (R1-style tags, a boxed answer, ...).

``format_ok(response, pattern)`` is a full-match regular-expression check; ``FORMATS`` names
the common layouts; ``format_reward`` is the built-in reward function (``right`` when the
response has the format, else ``wrong``). Not here: whether the answer is correct (``math_reward``).
"""

from __future__ import annotations

import re
from typing import Any

from treadle.rewards.api import RewardBatch, RewardOutput, native

FORMATS: dict[str, str] = {
    # DeepSeek-R1: reasoning in <think>, then the answer in <answer>.
    "think_answer": r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*",
    # Reasoning in <think>, then free text with a \boxed{} answer after it.
    "think_boxed": r"\s*<think>.*?</think>.*\\boxed\{.*\}.*",
    # Any text that contains a \boxed{} answer.
    "boxed": r".*\\boxed\{.*\}.*",
}
"""Named layouts (regular expressions matched against the whole response, DOTALL)."""


def format_ok(response: str, pattern: str) -> bool:
    """True when ``pattern`` (a name in ``FORMATS`` or a regex) matches the whole response."""
    regex = FORMATS.get(pattern, pattern)
    return re.fullmatch(regex, response, flags=re.DOTALL) is not None


def format_reward(*, pattern: str = "think_answer", right: float = 1.0, wrong: float = 0.0) -> Any:
    """The built-in ``format`` reward: ``right`` if ``format_ok(response, pattern)``, else ``wrong``."""
    regex = FORMATS.get(pattern, pattern)
    compiled = re.compile(regex, flags=re.DOTALL)  # fails here, at load, on a bad regex

    @native(version="1")
    def score(batch: RewardBatch) -> RewardOutput:
        ok = [compiled.fullmatch(r) is not None for r in batch.responses]
        return RewardOutput(rewards=[right if o else wrong for o in ok], scores=[float(o) for o in ok],
                            extra_logs={"format_ok": [float(o) for o in ok]})

    return score
