"""Length shaping and weighting, against values worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.rewards.shaping import dapo_overlong_penalty, stop_properly_penalty, weighted_sum


def test_dapo_overlong_penalty_by_hand():
    # max_len 10, buffer 4 -> expected = 6. L=6: (6-6)/4 = 0 -> 0; L=7: 1/4 -> -0.25;
    # L=8: 2/4 -> -0.5; L=9: 3/4 -> -0.75; L=10: 4/4 -> -1; L=12: 6/4 clipped to 1 -> -1; L=3 -> 0.
    got = dapo_overlong_penalty([6, 7, 8, 9, 10, 12, 3], max_len=10, buffer_len=4)
    np.testing.assert_allclose(got, [0, -0.25, -0.5, -0.75, -1.0, -1.0, 0])
    assert got.dtype == np.float32


def test_dapo_overlong_penalty_factor_scales_linearly():
    # factor 0.5: L=8 -> -0.5 * 2/4 = -0.25; L=10 -> -0.5.
    np.testing.assert_allclose(dapo_overlong_penalty([8, 10], max_len=10, buffer_len=4, factor=0.5), [-0.25, -0.5])
    # buffer == max_len: the penalty starts at length 0: L=5 of 10 -> -0.5.
    np.testing.assert_allclose(dapo_overlong_penalty([5], max_len=10, buffer_len=10), [-0.5])


@pytest.mark.parametrize("kw", [dict(buffer_len=0), dict(buffer_len=11), dict(buffer_len=4, factor=-1.0)])
def test_dapo_overlong_penalty_rejects_bad_parameters(kw):
    with pytest.raises(ValueError):
        dapo_overlong_penalty([1], max_len=10, **kw)


def test_stop_properly_penalty_by_hand():
    r, stopped = [1.0, 1.0, 0.5, -0.2], [True, False, False, False]
    # coef 0.5 scales truncated samples: [1, 0.5, 0.25, -0.1]
    np.testing.assert_allclose(stop_properly_penalty(r, stopped, 0.5), [1.0, 0.5, 0.25, -0.1], rtol=1e-6)
    # coef 0: truncated samples get nothing
    np.testing.assert_allclose(stop_properly_penalty(r, stopped, 0.0), [1.0, 0.0, 0.0, 0.0])
    # coef -0.5 replaces the truncated samples' rewards
    np.testing.assert_allclose(stop_properly_penalty(r, stopped, -0.5), [1.0, -0.5, -0.5, -0.5])
    # coef 1: no change
    np.testing.assert_allclose(stop_properly_penalty(r, stopped, 1.0), r, rtol=1e-6)


def test_stop_properly_penalty_checks_shapes_and_coef():
    with pytest.raises(ValueError):
        stop_properly_penalty([1.0, 2.0], [True], 0.5)
    with pytest.raises(ValueError):
        stop_properly_penalty([1.0], [True], 1.5)


def test_weighted_sum_by_hand():
    # r = 1.0 * [1, 0, 1] + 0.1 * [1, 1, 0] = [1.1, 0.1, 1.0]
    np.testing.assert_allclose(weighted_sum([[1, 0, 1], [1, 1, 0]], [1.0, 0.1]), [1.1, 0.1, 1.0], rtol=1e-6)
    with pytest.raises(ValueError):
        weighted_sum([[1.0]], [1.0, 2.0])


def test_shaping_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    got = dapo_overlong_penalty(torch.tensor([7, 8]), max_len=10, buffer_len=4)
    np.testing.assert_allclose(got, [-0.25, -0.5])
