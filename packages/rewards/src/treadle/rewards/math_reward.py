"""Math answer verification: the last ``\\boxed{...}`` of a response against the reference answer.

``last_boxed`` extracts the answer (balanced braces, ``\\boxed{}`` and ``\\fbox{}``, the
``\\boxed 5`` form); ``answers_match`` compares it with the label through Hugging Face's
math-verify (``math-verify`` package: LaTeX and plain expressions parsed to sympy, so
``\\frac{1}{2}``, ``0.5`` and ``1/2`` are equal, sets and intervals compare as such);
``math_reward`` is the built-in reward function (1.0 right, 0.0 wrong or no box).

math-verify bounds its parsing time with ``signal.alarm``, which works only on a process's main
thread; elsewhere the bound is off (the daemon runs built-ins in worker processes, on their
main thread, and kills a worker that hangs). Its parse time grows faster than the text's length
(measured here: ~0.3 s for 1 KiB of garbage, 2.5 s for 4 KiB, its 5 s timeout from 16 KiB), so
each sample is capped before it gets there: only the last ``max_response_chars`` of a response
are searched for the answer (the answer comes at the end; verl's math scorers keep the last 300
characters), and an answer or label longer than ``max_answer_chars`` is never parsed (the
answer scores ``wrong``, the label fails the sample). Not here: extracting answers that are not
boxed beyond what math-verify itself does (``extraction="any"``).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

from treadle.rewards.api import RewardBatch, RewardOutput, native

Extraction = Literal["boxed", "any"]
_BOX_COMMANDS = ("\\boxed", "\\fbox")
MAX_RESPONSE_CHARS = 8192
"""Default: characters at the end of a response searched for its answer."""
MAX_ANSWER_CHARS = 1024
"""Default: the longest answer (or label) handed to math-verify."""


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


def extract_answer(response: str, extraction: Extraction, *, max_response_chars: int = MAX_RESPONSE_CHARS,
                   max_answer_chars: int = MAX_ANSWER_CHARS) -> tuple[str | None, bool]:
    """(the answer to verify, whether the response had a box), from the response's last
    ``max_response_chars`` characters: the last box's content; with ``extraction="any"`` and no
    box, the last ``max_answer_chars`` characters, for math-verify to search."""
    tail = response[-max_response_chars:]
    boxed = last_boxed(tail)
    if boxed is not None or extraction == "boxed":
        return boxed, boxed is not None
    return tail[-max_answer_chars:], False


def _label_error(label: Any, gold: str | None, max_answer_chars: int) -> str:
    """Why a label cannot be scored ("" when it can)."""
    if gold is None:
        return f"label {str(label)[:80]!r} has no answer"
    if len(gold) > max_answer_chars:
        return (f"the label's answer has {len(gold):,} characters, beyond math.max_answer_chars "
                f"({max_answer_chars:,}): not parsed")
    return ""


def math_reward(*, extraction: Extraction = "boxed", wrong: float = 0.0, right: float = 1.0,
                max_response_chars: int = MAX_RESPONSE_CHARS, max_answer_chars: int = MAX_ANSWER_CHARS) -> Any:
    """The built-in ``math`` reward: ``right`` when the answer matches the label, else ``wrong``.

    ``extraction="boxed"``: only a ``\\boxed{}`` answer counts (no box scores ``wrong``);
    ``"any"``: without a box, math-verify looks for an answer at the end of the response.
    Only the last ``max_response_chars`` of a response are looked at; an answer longer than
    ``max_answer_chars`` scores ``wrong`` unparsed (see the module docstring). A sample whose
    label has no answer, or one longer than ``max_answer_chars``, fails (it cannot be scored).
    extra_logs: ``boxed`` (1.0 when the response had a box), ``correct`` (1.0 / 0.0),
    ``too_long`` (1.0 when the answer was past ``max_answer_chars``).
    """
    if extraction not in ("boxed", "any"):
        raise ValueError(f"extraction must be 'boxed' or 'any', got {extraction!r}")
    if max_response_chars < 1 or max_answer_chars < 1:
        raise ValueError(f"max_response_chars and max_answer_chars must be >= 1, got {max_response_chars} "
                         f"and {max_answer_chars}")
    import math_verify  # noqa: F401, PLC0415  (load sympy now, in the worker's start, not on the first request)

    @native(version="2")  # 2: the length caps
    def score(batch: RewardBatch) -> RewardOutput:
        rewards, correct, boxed, too_long, errors = [], [], [], [], []
        for response, label in zip(batch.responses, batch.labels, strict=True):
            answer, had_box = extract_answer(response, extraction, max_response_chars=max_response_chars,
                                             max_answer_chars=max_answer_chars)
            gold = label_answer(label)
            error = _label_error(label, gold, max_answer_chars)
            long = answer is not None and len(answer) > max_answer_chars
            ok = not error and not long and answer is not None and answers_match(answer, gold)  # type: ignore[arg-type]
            rewards.append(right if ok else wrong)
            correct.append(float(ok))
            boxed.append(float(had_box))
            too_long.append(float(long))
            errors.append(error)
        failed = [bool(e) for e in errors]
        return RewardOutput(rewards=rewards, scores=correct,
                            extra_logs={"boxed": boxed, "correct": correct, "too_long": too_long},
                            failed=failed if any(failed) else [], errors=errors if any(failed) else [])

    return score
