"""Math verification on a table of known answers, boxed-answer extraction, format checks."""

from __future__ import annotations

import re

import pytest

from treadle.rewards.api import RewardBatch
from treadle.rewards.format_reward import format_ok, format_reward
from treadle.rewards.math_reward import answers_match, label_answer, last_boxed, math_reward

pytest.importorskip("math_verify")


@pytest.mark.parametrize("text, boxed", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),           # the last one counts
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),           # nested braces
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$", "5"),                                                # the brace-less form
    ("\\boxed{ x = 3 }", "x = 3"),
    ("no box here: 42", None),
    ("\\boxed{unclosed", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("pred, gold", [
    ("0.5", "\\frac{1}{2}"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"),
    ("\\sqrt{18}", "3\\sqrt{2}"), ("(x+1)^2", "x^2+2x+1"), ("42.0", "42"), ("1000", "1,000"),
    ("\\{2,1\\}", "\\{1,2\\}"), ("(1, 2)", "(1,2)"), ("3", "x=3"), ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
])
def test_equivalent_forms_match(pred, gold):
    assert answers_match(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("41", "42"), ("[0,1]", "[0,1)"), ("-1", "1"), ("\\frac{1}{3}", "\\frac{1}{2}"), ("x^2", "x^3"),
])
def test_wrong_answers_do_not_match(pred, gold):
    assert not answers_match(pred, gold)


def test_math_reward_scores_a_batch():
    fn = math_reward()
    batch = RewardBatch(
        queries=["P1 so \\boxed{0.5}", "P2 so \\boxed{3}", "P3 the answer is 0.5", "P4 \\boxed{7}"],
        prompts=["P1", "P2", "P3", "P4"],
        labels=["\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}", {"answer": 7}])
    out = fn(batch)
    assert out.rewards == [1.0, 0.0, 0.0, 1.0]  # right, wrong, missing box, right (label as a map)
    assert out.extra_logs["boxed"] == [1.0, 1.0, 0.0, 1.0]
    assert out.failed == []


def test_math_reward_any_extraction_and_unscorable_labels():
    out = math_reward(extraction="any")(RewardBatch(queries=["the answer is $0.5$", "\\boxed{1}"], prompts=["", ""],
                                                    labels=["\\frac{1}{2}", None]))
    assert out.rewards == [1.0, 0.0]
    assert out.failed == [False, True] and "no answer" in out.errors[1]
    assert label_answer({"ground_truth": " 3 "}) == "3" and label_answer(True) is None


# ------------------------------------------------------------------ length caps


@pytest.fixture
def parsed(monkeypatch):
    """Every (answer, label) pair handed to math-verify, which is still called."""
    from treadle.rewards import math_reward as module

    seen = []
    real = module.answers_match

    def spy(predicted, reference):
        seen.append((predicted, reference))
        return real(predicted, reference)

    monkeypatch.setattr(module, "answers_match", spy)
    return seen


def _score(queries, labels, **kw):
    return math_reward(**kw)(RewardBatch(queries=queries, prompts=[""] * len(queries), labels=labels))


def test_only_the_tail_of_a_long_response_is_searched(parsed):
    filler = "lorem ipsum " * 5000  # 60 KB of reasoning, then the answer
    out = _score([filler + "so \\boxed{4}", "\\boxed{4} " + filler], ["4", "4"])
    assert out.rewards == [1.0, 0.0] and out.extra_logs["boxed"] == [1.0, 0.0]  # an early box is past the tail
    assert parsed == [("4", "4")]  # the second never reached math-verify
    out = _score(["so \\boxed{4}" + "." * 20], ["4"], max_response_chars=25)
    assert out.rewards == [0.0]  # the box opens 31 characters before the end


def test_an_answer_or_label_past_max_answer_chars_is_not_parsed(parsed):
    huge = "x" * 5000  # inside the default tail; math-verify took ~3 s over it (5 s, its timeout, at 16 KiB)
    out = _score(["\\boxed{" + huge + "}", "\\boxed{4}", "\\boxed{" + "1" * 64 + "}", "\\boxed{4}"],
                 ["4", "x" * 20_000, "4", "4"], max_answer_chars=63)
    assert out.rewards == [0.0, 0.0, 0.0, 1.0] and out.extra_logs["too_long"] == [1.0, 0.0, 1.0, 0.0]
    assert out.failed == [False, True, False, False] and "math.max_answer_chars (63)" in out.errors[1]
    assert "20,000 characters" in out.errors[1]
    assert parsed == [("4", "4")]


def test_any_extraction_hands_math_verify_only_the_end_of_the_response(parsed):
    out = _score(["x" * 50_000 + " the answer is $0.5$"], ["\\frac{1}{2}"], extraction="any", max_answer_chars=100)
    assert out.rewards == [1.0] and out.extra_logs["too_long"] == [0.0]
    [(answer, _)] = parsed
    assert len(answer) == 100 and answer.endswith("the answer is $0.5$")


def test_the_caps_are_checked_and_reach_the_function_from_the_flags():
    from treadle.common.config import ConfigError, parse
    from treadle.rewards.config import MathConfig, ServeConfig
    from treadle.rewards.daemon import builtin_params

    with pytest.raises(ValueError, match="max_response_chars and max_answer_chars must be >= 1"):
        math_reward(max_answer_chars=0)
    with pytest.raises(ConfigError, match="--math.max_response_chars"):
        MathConfig(max_response_chars=0)
    cfg = parse(ServeConfig, ["--functions", "math", "--math.max_answer_chars", "64"])
    assert builtin_params(cfg, "math") == {"extraction": "boxed", "max_response_chars": 8192, "max_answer_chars": 64}


def test_format_checks():
    assert format_ok("<think>a</think> <answer>b</answer>", "think_answer")
    assert not format_ok("<answer>b</answer>", "think_answer")
    assert format_ok("<think>x\ny</think>so \\boxed{2}.", "think_boxed")
    assert format_ok("abc123", r"[a-z]+\d+")  # a custom regex, full match
    out = format_reward(pattern="boxed")(RewardBatch(queries=["Q \\boxed{1}", "Q 1"], prompts=["Q", "Q"], labels=[None, None]))
    assert out.rewards == [1.0, 0.0] and out.extra_logs == {"format_ok": [1.0, 0.0]}
    with pytest.raises(re.error):
        format_reward(pattern="(unclosed")
