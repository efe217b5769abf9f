"""Normalising what reward functions return: OpenRLHF dicts (tensors or lists) and native outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from treadle.rewards.api import (
    RewardBatch,
    RewardOutput,
    concat_outputs,
    normalize_output,
    response_of,
)


def test_openrlhf_dict_with_torch_tensors():
    torch = pytest.importorskip("torch")
    r = torch.tensor([1.0, 0.0, 0.5])
    out = normalize_output({"rewards": r, "scores": r > 0.4, "extra_logs": {"acc": r.mean(), "len": torch.tensor([3, 4, 5])}}, 3)
    assert out.rewards == [1.0, 0.0, 0.5]
    assert out.scores == [1.0, 0.0, 1.0]
    assert out.extra_logs == {"acc": [0.5, 0.5, 0.5], "len": [3.0, 4.0, 5.0]}  # scalar broadcast per sample
    assert out.failed == [] and out.errors == []


def test_lists_numpy_and_bare_results():
    assert normalize_output({"rewards": [1, 0]}, 2).rewards == [1.0, 0.0]
    assert normalize_output({"rewards": np.array([0.25, 2.0], dtype=np.float32)}, 2).scores is None
    assert normalize_output([0.5, True], 2).rewards == [0.5, 1.0]  # a bare list: the rewards


@pytest.mark.parametrize("bad, match", [
    ({"scores": [1.0]}, "without 'rewards'"),
    ({"rewards": [1.0, 2.0]}, "expected 1 values"),
    ({"rewards": ["x"]}, "expected a number"),
    ({"rewards": [[0.1, 0.2]]}, "per-token"),
    ({"rewards": [1.0], "extra_logs": [1]}, "extra_logs must be a dict"),
    ("nope", "expected 1 numbers"),
])
def test_malformed_results_raise_with_the_reason(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        normalize_output(bad, 1)


def test_non_finite_rewards_fail_their_sample_only():
    out = normalize_output({"rewards": [1.0, math.nan, math.inf]}, 3)
    assert out.rewards == [1.0, 0.0, 0.0]
    assert out.failed == [False, True, True]
    assert "non-finite" in out.errors[1] and out.errors[0] == ""


def test_concat_outputs_fills_missing_logs_and_scores():
    a = RewardOutput(rewards=[1.0], scores=[0.5], extra_logs={"x": [2.0]})
    b = RewardOutput.failure(2, "boom")
    out = concat_outputs([a, b])
    assert out.rewards == [1.0, 0.0, 0.0]
    assert out.scores == [0.5, 0.0, 0.0]  # b had none: its rewards stand in
    assert out.extra_logs == {"x": [2.0, 0.0, 0.0]}
    assert out.failed == [False, True, True] and out.errors == ["", "boom", "boom"]


def test_batch_responses_and_select():
    b = RewardBatch(queries=["Q: 1 A: 2", "other"], prompts=["Q: 1 A: ", "no match"], labels=[1, 2])
    assert b.responses == ["2", "other"]
    assert response_of("abc", "") == "abc"
    assert b.select([1]).labels == [2]
    with pytest.raises(ValueError):
        RewardBatch(queries=["a"], prompts=[], labels=[None])
