"""OpenRLHF's reward-file math helpers (``openrlhf.utils.extract_boxed_answer`` / ``grade_answer``),
on treadle's math verifier.

OpenRLHF's ``examples/python/math_reward_func.py`` calls ``grade_answer(extract_boxed_answer(response),
label)`` per sample. Here both run on ``treadle.rewards.math_reward``, so a file written that way
scores exactly as ``--functions math`` does: the answer is the last box in the response's last
``MAX_RESPONSE_CHARS`` characters, compared with the label by math-verify (``\\frac12`` = ``0.5``
= ``1/2``). Where that differs from OpenRLHF's own helpers (its string normalisation plus sympy):

- ``extract_boxed_answer`` also reads ``\\fbox{...}`` and ``\\boxed 5`` (OpenRLHF returns None for
  both) and strips the spaces around the answer;
- ``grade_answer`` accepts a label that is a number, or a map with "answer" / "ground_truth";
  an answer longer than ``MAX_ANSWER_CHARS`` is wrong without being parsed, and a label that long
  raises ``ValueError`` (the sample fails instead of scoring 0.0: it cannot be graded in time).

Needs math-verify (``treadle-rewards[math]``): importing this module without it raises
``ImportError`` naming the extra, so a reward file fails when it is loaded, not on its first call.
Not here: the ``openrlhf`` module namespace that serves these names (``namespace``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from treadle.rewards.math_reward import (
    MAX_ANSWER_CHARS,
    answers_match,
    extract_answer,
    label_answer,
)

if importlib.util.find_spec("math_verify") is None:
    raise ImportError("openrlhf.utils.extract_boxed_answer / grade_answer run on treadle's math verifier, "
                      "which needs math-verify: pip install 'treadle-rewards[math]'", name="math_verify")


def extract_boxed_answer(solution: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``solution``; None without one.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``.
    """
    if not isinstance(solution, str):
        return None
    return extract_answer(solution, "boxed")[0]


def grade_answer(given_answer: str | None, ground_truth: Any) -> bool:
    """True when ``given_answer`` (already extracted) equals ``ground_truth`` by math-verify.

    None or empty on either side is False; equal strings are True without parsing. Raises
    ``ValueError`` for a label longer than ``MAX_ANSWER_CHARS`` (see the module docstring).
    """
    gold = label_answer(ground_truth)
    if given_answer is None or gold is None:
        return False
    if len(gold) > MAX_ANSWER_CHARS:
        raise ValueError(f"the label's answer has {len(gold):,} characters, beyond {MAX_ANSWER_CHARS:,}: "
                         "not parsed (math-verify's parse time grows fast with length)")
    given = str(given_answer).strip()
    if not given or len(given) > MAX_ANSWER_CHARS:
        return False
    return given == gold or answers_match(given, gold)


__all__ = ["extract_boxed_answer", "grade_answer"]
