"""The code-execution reward: code extraction, test-case formats, pass rates, limits hit."""

from __future__ import annotations

import json

import pytest

from treadle.rewards.api import RewardBatch
from treadle.rewards.code_reward import (
    CodeTest,
    code_reward,
    extract_code,
    parse_tests,
    same_output,
)

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"},
                   {"input": "2 2\n", "output": "5\n"}]}  # the last expectation is wrong on purpose


def test_extract_code_takes_the_last_fenced_block():
    text = "first:\n```py\nprint(1)\n```\nthen\n```python\nprint(2)\n```\nand ```no newline```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("no code at all") is None


def test_parse_tests_forms():
    assert parse_tests(json.dumps(TESTS))[1] == CodeTest(stdin="5 5\n", expected="10")
    apps = parse_tests({"input_output": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})})
    assert apps == [CodeTest(stdin="1\n", expected="1\n")]
    asserts = parse_tests({"asserts": ["assert f(1) == 2", "assert f(2) == 3"]})
    assert len(asserts) == 2 and asserts[0].expected is None and "assert f(1) == 2" in asserts[0].suffix
    humaneval = parse_tests({"test": "def check(c):\n    assert c(1) == 2", "entry_point": "f"})
    assert humaneval[0].suffix.rstrip().endswith("check(f)")
    for bad in ("not json", {"nothing": 1}, {"tests": []}, {"inputs": ["1"], "outputs": []}):
        with pytest.raises(ValueError):
            parse_tests(bad)


def test_same_output_ignores_trailing_whitespace_only():
    assert same_output("3 \n\n", "3")
    assert same_output("a\r\nb\n", "a\nb")
    assert not same_output("3 4", "3  4")


@pytest.fixture(scope="module")
def score():
    return code_reward(cpu_s=1, wall_s=20, memory_mb=256, nproc=8)


def test_pass_rate_and_binary(score):
    batch = RewardBatch(queries=[f"Q{ADD}", "Q no code", f"Q{ADD}"], prompts=["Q", "Q", "Q"],
                        labels=[TESTS, TESTS, {"asserts": ["assert 1 == 1"]}])
    out = score(batch)
    assert out.rewards == pytest.approx([2 / 3, 0.0, 0.0])  # 2 of 3 pass; no code; asserts: input() hits EOF
    assert out.scores == [0.0, 0.0, 0.0] and out.extra_logs["has_code"] == [1.0, 0.0, 1.0]
    binary = code_reward(cpu_s=1, wall_s=20, memory_mb=256, binary=True)
    both_right = {"tests": TESTS["tests"][:2]}
    assert binary(RewardBatch(queries=[ADD], prompts=[""], labels=[both_right])).rewards == [1.0]


def test_asserts_and_humaneval_labels(score):
    code = "```python\ndef inc(x):\n    return x + 1\n```"
    out = score(RewardBatch(queries=[code, code], prompts=["", ""], labels=[
        {"asserts": ["assert inc(1) == 2", "assert inc(1) == 3"]},
        {"test": "def check(f):\n    assert f(41) == 42", "entry_point": "inc"}]))
    assert out.rewards == [0.5, 1.0]


def test_escapes_score_zero_and_count_limit_hits(score):
    hog = "```python\nwhile True:\n    pass\n```"
    out = score(RewardBatch(queries=[hog], prompts=[""], labels=[{"tests": [{"input": "", "output": ""}]}]))
    assert out.rewards == [0.0] and out.extra_logs["limit_hits"] == [1.0] and out.failed == []


def test_a_label_without_tests_fails_the_sample(score):
    out = score(RewardBatch(queries=[ADD], prompts=[""], labels=[{"nothing": 1}]))
    assert out.failed == [True] and "no tests" in out.errors[0]
    assert score.__treadle_info__["sandbox"]["cpu_s"] == 1
