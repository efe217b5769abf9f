"""Numerical safety of the RL math: the clamps OpenRLHF applies (KL estimates bounded to
[-10, 10], PPO's log-ratio to [-20, 20]) with values worked out by hand, and extreme inputs
(log-ratios of +-30, all-masked rows, one-token rows, rewards of 1e4) through every loss,
estimator, correction and aggregation: no inf or NaN in any value or gradient."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle.trainer.rl.advantages import (
    ADVANTAGES,
    GROUP_BASELINES,
    compute_advantages,
    token_rewards,
)
from treadle.trainer.rl.correction import IS_GATES, IS_LEVELS, is_correction
from treadle.trainer.rl.kl import KL_ESTIMATORS, kl_k2, kl_k3, unbiased_kl_gradient
from treadle.trainer.rl.policy_loss import AGGREGATIONS, POLICY_LOSSES, ppo_clip, value_loss

T = torch.tensor


def close(actual: torch.Tensor, expected, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=1e-6)


# ---- item 1: the KL estimate is bounded, not the log-ratio -------------------------------------


def test_kl_estimates_are_bounded_where_the_log_ratio_clamp_let_them_through():
    # k3 at d = -4.5: exp(4.5) - 4.5 - 1 = 84.517 (the old [-10, 10] clamp of d let it through) -> 10
    close(kl_k3(T([-4.5]), T([0.0])), [10.0])
    # k3 at d = -12: exp(10) - 10 - 1 = 22015 before (d clamped at -10) -> 10
    close(kl_k3(T([-12.0]), T([0.0])), [10.0])
    # k2 at d = 10: 10^2 / 2 = 50 before -> 10; d = 4: 8, under the bound, unchanged
    close(kl_k2(T([10.0, 4.0]), T([0.0, 0.0])), [10.0, 8.0])
    # k3 at d = 2: exp(-2) + 2 - 1 = 1.135335, unchanged
    close(kl_k3(T([2.0]), T([0.0])), [math.exp(-2) + 1.0])


def test_kl_gradient_is_zero_where_a_bound_is_active():
    d = T([-30.0, -4.5, 0.5, 5.0, 30.0], dtype=torch.float64, requires_grad=True)
    for name, est in KL_ESTIMATORS.items():
        (g,) = torch.autograd.grad(est(d, torch.zeros_like(d)).sum(), d)
        assert torch.isfinite(g).all(), name
        if name == "k1":  # d / dd clamp(d): 1 inside [-10, 10]
            close(g, [0.0, 1.0, 1.0, 1.0, 0.0])
        elif name == "k2":  # d inside |d| <= sqrt(20) = 4.47: gradient d
            close(g, [0.0, 0.0, 0.5, 0.0, 0.0])
        else:  # k3' = 1 - exp(-d) where the value is under 10 (d = 0.5, and d = 5: 4.0067)
            close(g, [0.0, 0.0, 1 - math.exp(-0.5), 1 - math.exp(-5.0), 0.0])


# ---- item 2: PPO's log-ratio clamp -------------------------------------------------------------


def test_ppo_log_ratio_is_clamped_before_exp():
    logp = T([[25.0, -25.0, 0.1]], dtype=torch.float64, requires_grad=True)
    adv = T([[-1.0, 1.0, -1.0]], dtype=torch.float64)
    terms = ppo_clip(logp, torch.zeros_like(logp), adv, torch.ones(1, 3, dtype=torch.bool), clip_low=0.2, clip_high=0.2)
    # d 25 -> 20, A -1: -min(-e^20, -1.2) = e^20 = 4.85e8 (was e^25 = 7.2e10);
    # d -25 -> -20, A +1: -min(e^-20, 0.8) = -e^-20; d 0.1: -min(-e^0.1, -1.105..) = e^0.1 (inside the band)
    close(terms.loss, [[math.exp(20), -math.exp(-20), math.exp(0.1)]], tol=1e-3)
    terms.loss.sum().backward()
    close(logp.grad, [[0.0, 0.0, math.exp(0.1)]])  # the clamp stops the gradient


# ---- extreme inputs ----------------------------------------------------------------------------

EXTREME = st.one_of(st.sampled_from([-30.0, 30.0, 0.0]), st.floats(-30.0, 30.0, allow_nan=False, width=32))


@st.composite
def batches(draw):
    """(log-probs x4 [B, L], advantages [B, L], rewards [B], mask [B, L]) with rows of 0, 1 or more tokens."""
    groups, n, width = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4])), draw(st.integers(1, 5))
    b = groups * n
    lengths = draw(st.lists(st.sampled_from([0, 1, width]) | st.integers(0, width), min_size=b, max_size=b))
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]

    def grid() -> torch.Tensor:
        return torch.tensor(draw(st.lists(EXTREME, min_size=b * width, max_size=b * width)),
                            dtype=torch.float32).view(b, width)

    logp, old, ref, rollout = grid(), grid(), grid(), grid()
    # log-probs are <= 0; shifting by the max keeps log-ratios of +-30 between them
    logp, old, ref, rollout = (x - 30.0 for x in (logp, old, ref, rollout))
    adv = grid() * (1e4 / 30.0)  # advantages of up to 1e4
    rewards = torch.tensor(draw(st.lists(st.sampled_from([1e4, -1e4, 0.0, 1.0]), min_size=b, max_size=b)))
    return logp, old, ref, rollout, adv, rewards, mask, n


def _finite(name: str, *xs: torch.Tensor) -> None:
    for x in xs:
        assert torch.isfinite(x).all(), f"{name}: {x}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_extreme_inputs_give_finite_losses_and_gradients(batch):
    logp0, old, ref, rollout, adv, rewards, mask, n = batch
    for lv in IS_LEVELS:
        for gate in IS_GATES:
            w, _ = is_correction(old, rollout, mask, level=lv, gating=gate, low=0.0, high=5.0)
            _finite(f"is {lv} {gate}", w)
    weights, _ = is_correction(old, rollout, mask, mode="clip", low=0.5, high=5.0)
    for kind, fn in POLICY_LOSSES.items():
        for dual in (None, 3.0):
            for agg_name, agg in AGGREGATIONS.items():
                logp = logp0.clone().requires_grad_()
                terms = fn(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual, weights=weights)
                loss = agg.total(terms.loss, mask) / max(agg.units(mask), 1.0)
                kl = sum(est(logp, ref) for est in KL_ESTIMATORS.values())
                kl = kl + unbiased_kl_gradient(KL_ESTIMATORS["k3"](logp, ref), logp, ref, old)
                loss = loss + 0.1 * agg.total(kl * mask, mask) / max(agg.units(mask), 1.0)
                (grad,) = torch.autograd.grad(loss, logp)
                _finite(f"{kind} dual={dual} {agg_name}", loss, grad, terms.ratio)
    values = logp0.clone().requires_grad_()
    v_loss = value_loss(values, old, adv, mask, clip=0.5).sum()
    _finite("value loss", v_loss, torch.autograd.grad(v_loss, values)[0])
    gaps = torch.ones_like(adv)
    for est in ADVANTAGES:
        final = GROUP_BASELINES[est](rewards, n)
        r = token_rewards(final, mask, KL_ESTIMATORS["k1"](old, ref), 0.1)
        for g in (None, gaps):
            out = compute_advantages(est, token_rewards=r, mask=mask, values=old, gamma=0.99, lambd=0.95, gaps=g)
            _finite(est, *out)


def test_one_token_and_all_masked_rows_by_hand():
    # row 0: no action token, row 1: one token with log-ratio 30 and A = -1e4
    mask = T([[False, False], [True, False]])
    logp = T([[np.nan, np.nan], [0.0, np.inf]], requires_grad=True)
    old = T([[0.0, 0.0], [-30.0, 0.0]])
    adv = T([[5.0, 5.0], [-1e4, 0.0]])
    for fn in POLICY_LOSSES.values():
        terms = fn(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
        for agg in AGGREGATIONS.values():
            (grad,) = torch.autograd.grad(agg.total(terms.loss, mask), logp, retain_graph=True)
            _finite("grad", grad)
            assert (grad[~mask] == 0).all()
        assert terms.loss[0].eq(0).all()  # the empty row adds 0 (OpenRLHF's masked mean: NaN)
