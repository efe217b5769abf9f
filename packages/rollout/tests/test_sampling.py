"""The HF engine's sampling math against values worked out by hand."""

from __future__ import annotations

import math

import torch

from treadle.rollout.engine.sampling import (
    mask_stop_tokens,
    processed_logprobs,
    sample,
    top_k_top_p,
)

Z = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
NEG = float("-inf")


def test_top_k_keeps_the_k_largest():
    out = top_k_top_p(Z, torch.tensor([2]), torch.tensor([1.0]))
    assert out.tolist() == [[NEG, NEG, 3.0, 4.0]]


def test_top_p_drops_the_low_tail():
    # softmax([1,2,3,4]) = [0.0321, 0.0871, 0.2369, 0.6439]; ascending cumsum [0.032, 0.119, 0.356, 1.0]
    # p = 0.7 drops entries with cumsum <= 0.3: the first two; p = 0.6 drops <= 0.4: the first three.
    assert top_k_top_p(Z, torch.tensor([-1]), torch.tensor([0.7])).tolist() == [[NEG, NEG, 3.0, 4.0]]
    assert top_k_top_p(Z, torch.tensor([-1]), torch.tensor([0.6])).tolist() == [[NEG, NEG, NEG, 4.0]]


def test_processed_logprobs_temperature_and_greedy_rows():
    logits = torch.cat([Z, Z])
    lp = processed_logprobs(logits, torch.tensor([0.5, 0.0]), torch.tensor([-1, 2]), torch.tensor([1.0, 1.0]))
    # row 0: log_softmax([2,4,6,8]); the last entry: 8 - log(e^2 + e^4 + e^6 + e^8)
    assert math.isclose(lp[0, 3].item(), 8 - math.log(sum(math.exp(v) for v in (2, 4, 6, 8))), rel_tol=1e-6)
    # row 1 is greedy: plain log_softmax, top-k ignored
    assert torch.allclose(lp[1], torch.log_softmax(Z[0], -1))


def test_sample_greedy_is_argmax_and_seeded_rows_repeat():
    lp = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    greedy = torch.tensor([True, False, False])
    fallback = torch.Generator().manual_seed(0)

    def draw(seed):
        return sample(lp, greedy, [None, torch.Generator().manual_seed(seed), None], fallback).tolist()

    a, b = draw(7), draw(7)
    assert a[0] == int(lp[0].argmax()) and a[1] == b[1]


def test_mask_stop_tokens_only_touches_listed_rows():
    logits = torch.zeros(2, 4)
    mask_stop_tokens(logits, [1], [[0, 3]])
    assert logits.tolist() == [[0, 0, 0, 0], [NEG, 0, 0, NEG]]
