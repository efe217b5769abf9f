"""The RL options added for OpenRLHF 0.11.2 parity, against values worked out by hand: GSPO
back-propagated through the sequence mean (and GSPO-token beside it), dual clip with GSPO, the
clip-fraction terms, the unbiased KL gradient, FlashREINFORCE's baseline, the binary-KL / TV
trust-region gates at token and sequence level, and the two multi-turn layouts of returns/GAE."""

from __future__ import annotations

import math

import pytest
import torch

from treadle.trainer.rl.advantages import (
    GROUP_BASELINES,
    compute_advantages,
    discounted_returns,
    gae,
)
from treadle.trainer.rl.correction import is_correction
from treadle.trainer.rl.kl import kl_k1, kl_k3, unbiased_kl_gradient
from treadle.trainer.rl.policy_loss import AGGREGATIONS, gspo, gspo_token, ppo_clip

T = torch.tensor
LN = math.log


def close(actual: torch.Tensor, expected, tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# ---- GSPO --------------------------------------------------------------------------------------


def test_gspo_backpropagates_through_the_sequence_mean():
    # one sequence, log-ratios [0.2, 0.4]: s = exp(0.3); advantages vary inside it: [1, 3]
    s = math.exp(0.3)
    logp = T([[0.2, 0.4]], dtype=torch.float64, requires_grad=True)
    old, adv, mask = torch.zeros(1, 2, dtype=torch.float64), T([[1.0, 3.0]], dtype=torch.float64), T([[True, True]])
    terms = gspo(logp, old, adv, mask, clip_low=0.5, clip_high=0.5)
    close(terms.loss, [[-s, -3 * s]])
    agg = AGGREGATIONS["seq-mean-token-mean"]
    (grad,) = torch.autograd.grad(agg.total(terms.loss, mask), logp)
    # L = -(s*1 + s*3) / 2 = -2s; dL/dlogp_t = -2 * ds/dlogp_t = -2 * s / 2 = -s for both tokens
    close(grad, [[-s, -s]])
    # GSPO-token: l_t = -s A_t with d s_t / d logp_t = s: dL/dlogp = [-s * 1 / 2, -s * 3 / 2]
    tok = gspo_token(logp, old, adv, mask, clip_low=0.5, clip_high=0.5)
    (grad_tok,) = torch.autograd.grad(agg.total(tok.loss, mask), logp)
    close(grad_tok, [[-s / 2, -3 * s / 2]])


@pytest.mark.parametrize("loss", [gspo, gspo_token])
def test_dual_clip_acts_on_gspo(loss):
    # s = exp(mean(2, 2)) = e^2 = 7.389, A = -1: plain loss -min(-7.389, -1.2) = 7.389 > c = 3 -> 3
    logp = T([[2.0, 2.0], [0.1, 0.0]], dtype=torch.float64, requires_grad=True)
    adv = T([[-1.0, -1.0], [-1.0, 0.0]], dtype=torch.float64)
    mask = T([[True, True], [True, False]])
    terms = loss(logp, torch.zeros_like(logp), adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    # row 1: s = e^0.1 = 1.105 in band, A = -1: 1.105 < 3, unchanged
    close(terms.loss, [[3.0, 3.0], [math.exp(0.1), 0.0]])
    assert terms.clipped.tolist() == [[True, True], [False, False]]
    assert terms.ppo_clipped.tolist() == [[False, False], [False, False]]  # surr2 < surr1 is false for A < 0, s > 1.2


def test_ppo_clipped_excludes_the_dual_clip():
    # r = 5, A = -1: surr1 = -5 < surr2 = -1.2, so not ppo-clipped, but dual-clipped (loss 5 > 3)
    # r = 1.5, A = +1: surr2 = 1.2 < surr1 = 1.5: ppo-clipped
    logp = T([[LN(5.0), LN(1.5), 0.0]])
    terms = ppo_clip(logp, torch.zeros_like(logp), T([[-1.0, 1.0, 1.0]]), T([[True, True, True]]),
                     clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert terms.ppo_clipped.tolist() == [[False, True, False]]
    assert terms.clipped.tolist() == [[True, True, False]]


# ---- unbiased KL gradient ----------------------------------------------------------------------


def test_unbiased_kl_gradient_by_hand():
    # d = logp - ref = [0.5, -2]; w = min(exp(logp - old), 10) = [exp(0.3), 10 (exp(3) capped)]
    logp = T([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref, old = T([[-0.5, 2.0]], dtype=torch.float64), T([[-0.3, -3.0]], dtype=torch.float64)
    value = kl_k3(logp, ref)
    out = unbiased_kl_gradient(value, logp, ref, old)
    close(out, value.detach())  # the forward value is the estimator's
    (grad,) = torch.autograd.grad(out.sum(), logp)
    close(grad, [[math.exp(0.3) * 0.5, 10.0 * -2.0]])  # w d
    # without old log-probs w = 1; with k1 the same gradient as with k3
    (g1,) = torch.autograd.grad(unbiased_kl_gradient(kl_k1(logp, ref), logp, ref, None).sum(), logp)
    close(g1, [[0.5, -2.0]])


# ---- FlashREINFORCE ----------------------------------------------------------------------------


def test_flash_reinforce_baseline_is_the_batch_mean():
    r = T([1.0, 2.0, 3.0, 6.0])  # mean 3, whatever the group size
    close(GROUP_BASELINES["flash_reinforce"](r, 1), [-2.0, -1.0, 0.0, 3.0])
    close(GROUP_BASELINES["flash_reinforce"](r, 2), [-2.0, -1.0, 0.0, 3.0])
    # no whitening after it: advantages are the returns
    rewards, mask = T([[0.0, -2.0], [3.0, 0.0]]), T([[True, True], [True, False]])
    adv, ret = compute_advantages("flash_reinforce", token_rewards=rewards, mask=mask)
    close(adv, [[-2.0, -2.0], [3.0, 0.0]])
    close(ret, adv)


# ---- trust-region gates ------------------------------------------------------------------------


def _bkl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_binary_kl_and_tv_gates_by_hand():
    # sampled-token probabilities: rollout p = [0.5, 0.9, 0.2], trainer q = [0.5, 0.6, 0.25]
    p, q = [0.5, 0.9, 0.2], [0.5, 0.6, 0.25]
    rollout, old = T([[LN(x) for x in p]], dtype=torch.float64), T([[LN(x) for x in q]], dtype=torch.float64)
    mask = T([[True, True, True]])
    rho = [qi / pi for pi, qi in zip(p, q, strict=True)]  # [1, 0.6667, 1.25]
    # binary KL per token: 0, 0.9 ln 1.5 + 0.1 ln 0.25 = 0.226289, 0.2 ln 0.8 + 0.8 ln(0.8/0.75) = 0.007002
    kls = [_bkl(a, b) for a, b in zip(p, q, strict=True)]
    assert kls[1] == pytest.approx(0.226289, abs=1e-6) and kls[2] == pytest.approx(0.007002, abs=1e-6)
    w, keep = is_correction(old, rollout, mask, level="token", gating="binary_kl", low=0.0, high=0.01)
    close(w, [[rho[0], 0.0, rho[2]]])  # token 1 is outside the trust region
    assert keep.tolist() == [[True, False, True]]
    # sequence level: mean 0.077764 > 0.01 -> the whole sequence goes; <= 0.1 keeps it with its ratios
    assert sum(kls) / 3 == pytest.approx(0.077764, abs=1e-6)
    w, _ = is_correction(old, rollout, mask, level="seq", gating="binary_kl", low=0.0, high=0.01)
    close(w, [[0.0, 0.0, 0.0]])
    w, _ = is_correction(old, rollout, mask, level="seq", gating="binary_kl", low=0.0, high=0.1)
    close(w, [rho])
    # total variation |p - q| = [0, 0.3, 0.05]; token bound 0.1 drops token 1; seq mean 0.1167 > 0.1
    w, _ = is_correction(old, rollout, mask, level="token", gating="tv", low=0.0, high=0.1)
    close(w, [[rho[0], 0.0, rho[2]]])
    w, _ = is_correction(old, rollout, mask, level="seq", gating="tv", low=0.0, high=0.1)
    close(w, [[0.0, 0.0, 0.0]])


def test_divergence_gates_clamp_probabilities_of_one():
    # p = 1 (log-prob 0) would make log(1 - p) infinite; both are clamped to 1 - 1e-6
    w, keep = is_correction(T([[0.0]]), T([[0.0]]), T([[True]]), gating="binary_kl", low=0.0, high=0.01)
    assert torch.isfinite(w).all() and keep.tolist() == [[True]]


# ---- multi-turn layouts ------------------------------------------------------------------------


def _expanded(x: torch.Tensor, gaps: list[int]) -> torch.Tensor:
    """One row of action values, with gaps[j] zeros (environment tokens) after action j."""
    out = []
    for v, g in zip(x.tolist(), gaps, strict=True):
        out += [v] + [0.0] * g
    return T([out], dtype=torch.float64)


def test_returns_with_environment_tokens_by_hand():
    rewards = T([[1.0, 2.0, 3.0]], dtype=torch.float64)
    mask, gaps = T([[True, True, True]]), T([[2.0, 0.0, 0.0]], dtype=torch.float64)
    # policy-token steps, gamma 0.5: G = [1 + 0.5 * 3.5, 2 + 0.5 * 3, 3] = [2.75, 3.5, 3]
    close(discounted_returns(rewards, mask, 0.5), [[2.75, 3.5, 3.0]])
    # two environment tokens after action 0: G_0 = 1 + 0.5^3 * 3.5 = 1.4375
    close(discounted_returns(rewards, mask, 0.5, gaps), [[1.4375, 3.5, 3.0]])
    # the same as every position a step (OpenRLHF's layout), read at the action positions
    flat = discounted_returns(_expanded(rewards[0], [2, 0, 0]), torch.ones(1, 5, dtype=torch.bool), 0.5)
    close(flat[:, [0, 3, 4]], [[1.4375, 3.5, 3.0]])


def test_gae_with_environment_tokens_by_hand():
    rewards, values = T([[0.0, 1.0]], dtype=torch.float64), T([[0.5, 0.4]], dtype=torch.float64)
    mask, gaps = T([[True, True]]), T([[1.0, 0.0]], dtype=torch.float64)
    g, lam = 0.9, 0.8
    # policy-token steps: d1 = 1 - 0.4 = 0.6; d0 = 0 + 0.9 * 0.4 - 0.5 = -0.14; A0 = -0.14 + 0.72 * 0.6 = 0.292
    adv, ret = gae(rewards, values, mask, g, lam)
    close(adv, [[0.292, 0.6]])
    # one environment token e (r 0, V 0) between them: d0 = 0 + 0.9 * 0 - 0.5 = -0.5;
    # A_e = 0 + 0.9 * 0.4 - 0 + 0.72 * 0.6 = 0.792; A0 = -0.5 + 0.72 * 0.792 = 0.07024
    adv, ret = gae(rewards, values, mask, g, lam, gaps)
    close(adv, [[0.07024, 0.6]])
    close(ret, [[0.07024 + 0.5, 1.0]])
    # the same as every position a step, the environment token's reward and value 0 (OpenRLHF's layout)
    flat, _ = gae(_expanded(rewards[0], [1, 0]), _expanded(values[0], [1, 0]), torch.ones(1, 3, dtype=torch.bool), g, lam)
    close(flat[:, [0, 2]], [[0.07024, 0.6]])


def test_the_layouts_agree_when_gamma_and_lambda_are_one():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = torch.arange(4)[None, :] < T([4, 2, 1])[:, None]
    gaps = T([[3.0, 0.0, 5.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    for est in ("gae", "reinforce", "group_norm"):
        a = compute_advantages(est, token_rewards=rewards, mask=mask, values=values)
        b = compute_advantages(est, token_rewards=rewards, mask=mask, values=values, gaps=gaps)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y)
