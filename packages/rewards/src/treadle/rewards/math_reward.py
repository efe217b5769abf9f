"""Math answer verification: the last ``\\boxed{...}`` of a response against the reference answer.

``last_boxed`` extracts the answer (balanced braces, ``\\boxed{}`` and ``\\fbox{}``, the
``\\boxed 5`` form); ``answers_match`` compares it with the label through Hugging Face's
math-verify (``math-verify`` package: LaTeX and plain expressions parsed to sympy, so
``\\frac{1}{2}``, ``0.5`` and ``1/2`` are equal, sets and intervals compare as such);
``math_reward`` is the built-in reward function (1.0 right, 0.0 wrong or no box).

math-verify bounds its parsing time with ``signal.alarm``, which works only on a process's main
thread; elsewhere the bound is off (the daemon runs built-ins in worker processes, on their
main thread, and kills a worker that hangs). Not here: extracting answers that are not boxed
beyond what math-verify itself does (``extraction="any"``).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

from treadle.rewards.api import RewardBatch, RewardOutput, native

Extraction = Literal["boxed", "any"]
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _balanced(text: str, open_at: int) -> str | None:
    """Content of the ``{...}`` group opening at ``text[open_at]``, or None when unbalanced."""
    depth = 0
    for i in range(open_at, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed X``) in ``text``.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``; None when there is none or its braces
    never close.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = start + len(cmd)
    j = rest
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        inner = _balanced(text, j)
        return inner.strip() if inner is not None else None
    if j > rest:  # "\boxed 5": up to the next space or "$"
        token = text[j:].split(" ", 1)[0].split("$", 1)[0]
        return token.strip() or None
    return None


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse(expr: str) -> list[Any]:
    from math_verify import parse  # noqa: PLC0415  (sympy import: ~1 s, paid by users of math only)

    t = _timeout()
    found = parse(f"${expr}$", parsing_timeout=t)
    return found if found else parse(expr, parsing_timeout=t)


def label_answer(label: Any) -> str | None:
    """The reference answer in a label: a string or number, or a map's "answer"/"ground_truth"."""
    if isinstance(label, dict):
        label = label.get("answer", label.get("ground_truth"))
    if label is None or isinstance(label, bool):
        return None
    return str(label).strip() or None


def answers_match(predicted: str, reference: str) -> bool:
    """True when math-verify finds ``predicted`` equal to ``reference`` (both LaTeX or plain)."""
    from math_verify import verify  # noqa: PLC0415

    gold, pred = _parse(reference), _parse(predicted)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=_timeout()))


def _extract(response: str, extraction: Extraction) -> str | None:
    boxed = last_boxed(response)
    if boxed is not None or extraction == "boxed":
        return boxed
    return response  # "any": let math-verify find the answer in the whole response


def math_reward(*, extraction: Extraction = "boxed", wrong: float = 0.0, right: float = 1.0) -> Any:
    """The built-in ``math`` reward: ``right`` when the answer matches the label, else ``wrong``.

    ``extraction="boxed"``: only a ``\\boxed{}`` answer counts (no box scores ``wrong``);
    ``"any"``: without a box, math-verify looks for an answer anywhere in the response.
    A sample whose label has no answer fails (it cannot be scored). extra_logs: ``boxed``
    (1.0 when the response had a box), ``correct`` (1.0 / 0.0).
    """
    if extraction not in ("boxed", "any"):
        raise ValueError(f"extraction must be 'boxed' or 'any', got {extraction!r}")
    import math_verify  # noqa: F401, PLC0415  (load sympy now, in the worker's start, not on the first request)

    @native(version="1")
    def score(batch: RewardBatch) -> RewardOutput:
        rewards, correct, boxed, failed, errors = [], [], [], [], []
        for response, label in zip(batch.responses, batch.labels, strict=True):
            answer, gold = _extract(response, extraction), label_answer(label)
            ok = gold is not None and answer is not None and answers_match(answer, gold)
            rewards.append(right if ok else wrong)
            correct.append(float(ok))
            boxed.append(float(last_boxed(response) is not None))
            failed.append(gold is None)
            errors.append("" if gold is not None else f"label {str(label)[:80]!r} has no answer")
        return RewardOutput(rewards=rewards, scores=correct, extra_logs={"boxed": boxed, "correct": correct},
                            failed=failed if any(failed) else [], errors=errors if any(failed) else [])

    return score
