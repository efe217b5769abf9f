"""EpisodeBuilder: token layout, masks, logprobs and spans, position by position."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.agents.builder import EpisodeBuilder, spans_of


def test_spans_of_runs() -> None:
    assert spans_of(np.array([1, 1, 0, 0, 1, 0, 1, 1, 1])) == [(0, 2), (4, 5), (6, 9)]
    assert spans_of(np.zeros(4)) == []
    assert spans_of(np.ones(3)) == [(0, 3)]
    assert spans_of(np.zeros(0)) == []


def test_builder_layout_token_by_token() -> None:
    b = EpisodeBuilder([10, 11, 12])
    assert b.add_turn([20, 21], np.array([-0.5, -1.5]), [3]) == (0, 2)
    b.add_observation([30, 31, 32])
    assert b.add_turn([40], np.array([-2.0]), [4]) == (5, 6)
    b.add_turn([50, 51], None, [4])  # two turns back to back stay two spans
    assert b.length == 3 + 8
    assert b.tokens().tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 40, 50, 51]
    t = b.build(reward=1.5, uid="u", info={"k": 1})
    assert t.prompt_token_ids.tolist() == [10, 11, 12]
    assert t.response_token_ids.tolist() == [20, 21, 30, 31, 32, 40, 50, 51]
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 0, 1, 1, 1]
    assert t.rollout_logprobs.tolist() == [-0.5, -1.5, 0, 0, 0, -2.0, 0, 0]
    assert t.info["spans"] == [[0, 2], [5, 6], [6, 8]] and t.info["turns"] == 3 and t.info["k"] == 1
    assert (t.min_policy_version, t.max_policy_version) == (3, 4)
    assert t.loss_mask.dtype == np.uint8 and t.rollout_logprobs.dtype == np.float32
    assert t.response_token_ids.dtype == np.int32


def test_builder_rejects_mismatched_logprobs_and_builds_empty() -> None:
    b = EpisodeBuilder([1])
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        b.add_turn([1, 2], np.array([0.0]), [0])
    t = EpisodeBuilder(np.zeros(0, np.int32)).build(finish_reason="error")
    assert t.response_token_ids.shape == (0,) and t.info["spans"] == []
