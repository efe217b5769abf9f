"""The engines' own weight checks without an engine: the spec an update must fit, the canary,
and the names a vLLM worker loads from received buckets. (Bucket layout and the broadcast group:
packages/common/tests/test_weights.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.rollout.engine.vllm_worker_ext import _named
from treadle.rollout.engine.weights import (
    TensorSpec,
    WeightMismatch,
    WeightSpec,
    canary_error,
    canary_gap,
    model_eos_ids,
    spec_from_checkpoint,
)

SPEC = WeightSpec(required={"a": TensorSpec((2, 3), "float32"), "b": TensorSpec((4,), "float32")},
                  ignored={"lm_head.weight": TensorSpec((2, 3), "float32")})


def test_spec_accepts_exact_header_and_tied_head():
    SPEC.check_header(["b", "a"], ["float32"] * 2, [[4], [2, 3]])
    SPEC.check_header(["a", "b", "lm_head.weight"], ["float32"] * 3, [[2, 3], [4], [2, 3]])
    assert SPEC.skip == {"lm_head.weight"}


@pytest.mark.parametrize("names,dtypes,shapes,message", [
    (["a", "b", "c"], ["float32"] * 3, [[2, 3], [4], [1]], "c: no such tensor"),
    (["a", "b"], ["float32"] * 2, [[3, 2], [4]], r"a: shape \[3, 2\], the model has \[2, 3\]"),
    (["a", "b"], ["float32", "bfloat16"], [[2, 3], [4]], "b: dtype bfloat16, the engine serves float32"),
    (["a"], ["float32"], [[2, 3]], "missing 1 tensor.*: b"),
    (["a", "a", "b"], ["float32"] * 3, [[2, 3], [2, 3], [4]], "a: sent twice"),
])
def test_spec_refuses_with_a_message_naming_the_problem(names, dtypes, shapes, message):
    with pytest.raises(WeightMismatch, match=message):
        SPEC.check_header(names, dtypes, shapes)


def test_spec_checks_tensors_against_their_header():
    with pytest.raises(WeightMismatch, match="tensor b is float64"):
        SPEC.check_tensors(["a", "b"], ["float32"] * 2, [[2, 3], [4]], [torch.zeros(2, 3), np.zeros(4)])
    SPEC.check_tensors(["a", "b"], ["float32"] * 2, [[2, 3], [4]], [torch.zeros(2, 3), np.zeros(4, np.float32)])


def test_spec_from_checkpoint_reads_safetensors_headers(models):
    spec = spec_from_checkpoint(models["a"])
    assert spec.required["model.embed_tokens.weight"] == TensorSpec((512, 64), "float32")
    assert len(spec.required) == 26 and set(spec.ignored) == {"lm_head.weight"}  # tied: 1 + 2*12 + 1
    assert {s.dtype for s in spec_from_checkpoint(models["a"], dtype="bfloat16").required.values()} == {"bfloat16"}


def test_model_eos_ids_come_from_generation_config(models, tmp_path):
    assert model_eos_ids(models["a"]) == (0, 2)  # the tiny model's <|endoftext|>, <|im_end|>
    (tmp_path / "config.json").write_text('{"eos_token_id": 7}')
    assert model_eos_ids(tmp_path) == (7,)


def test_canary_error():
    e = np.array([-1.0, -2.0, -3.0])
    assert canary_error(e, e + 5e-4, 1e-3) is None
    assert "position 1" in canary_error(e, e + np.array([0, 0.5, 0]), 1e-3)
    assert canary_error(e, np.array([-1.0, np.nan, -3.0]), 1e-3) is not None
    assert "2 prompt logprobs" in canary_error(e, e[:2], 1e-3)


def test_canary_gap_is_the_largest_difference_and_inf_when_it_cannot_be_compared():
    e = np.array([-1.0, -2.0, -3.0])
    assert canary_gap(e, e + np.array([0.0, 0.25, -0.5])) == 0.5
    assert canary_gap(e, e) == 0.0 and canary_gap([], []) == 0.0
    assert canary_gap(e, e[:2]) == float("inf")
    assert canary_gap(e, np.array([-1.0, np.nan, -3.0])) == float("inf")


def test_a_vllm_worker_loads_every_received_tensor_by_name_but_the_skipped_ones():
    buckets = [(0, 2, [torch.zeros(1), torch.ones(2)]), (2, 3, [torch.full((3,), 2.0)])]
    got = list(_named(["t0", "t1", "t2"], frozenset({"t1"}), iter(buckets)))
    assert [n for n, _ in got] == ["t0", "t2"] and [t.tolist() for _, t in got] == [[0.0], [2.0] * 3]
