"""The RL math of ``treadle.trainer.rl`` against values worked out by hand (the arithmetic is in
the comments or the expressions), plus its invariances: padding never contributes, gradients
match the formulas, a step's aggregated loss does not depend on the micro-batch split, and the
variant dicts are keyed exactly by the config's names."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from treadle.trainer.config.algo import ADVANTAGE_ESTIMATORS, ISGating, ISLevel, ISMode, KLEstimator
from treadle.trainer.config.model import PolicyConfig
from treadle.trainer.rl.advantages import (
    ADVANTAGES,
    GROUP_BASELINES,
    compute_advantages,
    discounted_returns,
    gae,
    token_rewards,
    whiten,
)
from treadle.trainer.rl.correction import IS_GATES, IS_LEVELS, IS_MODES, is_correction, logprob_gap
from treadle.trainer.rl.kl import KL_ESTIMATORS, KLController, kl_k1, kl_k2, kl_k3
from treadle.trainer.rl.policy_loss import (
    AGGREGATIONS,
    POLICY_LOSSES,
    gspo,
    gspo_token,
    ppo_clip,
    value_loss,
)
from treadle.trainer.rl.shaping import (
    clip_rewards,
    dynamic_filter,
    normalize,
    overlong_penalty,
    stop_properly,
)

T = torch.tensor
LN = math.log


def close(actual: torch.Tensor, expected, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# ---- names -------------------------------------------------------------------------------------


def test_variant_dicts_are_keyed_by_the_config_literals():
    assert tuple(ADVANTAGES) == ADVANTAGE_ESTIMATORS
    assert tuple(GROUP_BASELINES) == ADVANTAGE_ESTIMATORS
    assert tuple(KL_ESTIMATORS) == typing.get_args(KLEstimator)
    assert tuple(IS_GATES) == typing.get_args(ISGating)
    assert tuple(IS_MODES) == typing.get_args(ISMode)
    assert ("off", *IS_LEVELS) == typing.get_args(ISLevel)
    assert tuple(POLICY_LOSSES) == typing.get_args(typing.get_type_hints(PolicyConfig)["policy_loss_type"])


# ---- group baselines ---------------------------------------------------------------------------


def test_group_baselines_by_hand():
    r = T([1.0, 2.0, 3.0, 6.0])  # one group of n = 4: sum 12, mean 3
    close(GROUP_BASELINES["gae"](r, 4), [1, 2, 3, 6])
    close(GROUP_BASELINES["reinforce"](r, 4), [1, 2, 3, 6])
    close(GROUP_BASELINES["reinforce_baseline"](r, 4), [-2, -1, 0, 3])
    close(GROUP_BASELINES["dr_grpo"](r, 4), [-2, -1, 0, 3])
    # leave-one-out: baseline_i = (12 - r_i) / 3 = [11/3, 10/3, 3, 2]
    close(GROUP_BASELINES["rloo"](r, 4), [1 - 11 / 3, 2 - 10 / 3, 0, 6 - 2])
    # two groups of 2: [1, 2] -> others' mean [2, 1]; [3, 6] -> [6, 3]
    close(GROUP_BASELINES["rloo"](r, 2), [-1, 1, -3, 3])


def test_group_norm_uses_the_unbiased_std():
    # [1, 0, 0, 1]: mean 1/2, unbiased var = 4 * (1/2)^2 / (4 - 1) = 1/3, std = 0.57735...
    out = GROUP_BASELINES["group_norm"](T([1.0, 0.0, 0.0, 1.0]), 4)
    s = math.sqrt(1 / 3) + 1e-9  # OpenRLHF's eps
    close(out, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])
    assert out[0].item() == pytest.approx(0.866024, abs=1e-5)
    # an all-equal group has std 0: eps keeps it at 0 instead of NaN
    close(GROUP_BASELINES["group_norm"](T([2.0, 2.0]), 2), [0, 0])


def test_group_baselines_reject_bad_groups():
    with pytest.raises(ValueError, match="batch size 3 is not a multiple of group_size 2"):
        GROUP_BASELINES["rloo"](T([1.0, 2.0, 3.0]), 2)
    with pytest.raises(ValueError, match="group_size >= 2, got 1"):
        GROUP_BASELINES["rloo"](T([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="group_size >= 2, got 1"):
        GROUP_BASELINES["group_norm"](T([1.0, 2.0]), 1)
    close(GROUP_BASELINES["dr_grpo"](T([1.0, 2.0]), 1), [0, 0])  # n = 1 is legal, if useless


# ---- per-token rewards, returns, GAE, whitening ------------------------------------------------

MASK = T([[True, True, True, False], [True, False, False, False]])


def test_token_rewards_by_hand():
    final = T([1.0, 2.0])
    kl = T([[0.1, 0.2, 0.3, 9.0], [0.4, 9.0, 9.0, 9.0]])
    process = T([[0.0, 0.5, 0.0, 7.0], [0.0, 7.0, 7.0, 7.0]])
    out = token_rewards(final, MASK, kl, 0.5, process)
    # row 0: [-0.5*0.1, -0.5*0.2 + 0.5, -0.5*0.3 + final 1, pad]; row 1: [-0.5*0.4 + final 2, pads]
    close(out, [[-0.05, 0.4, 0.85, 0.0], [1.8, 0.0, 0.0, 0.0]])
    close(token_rewards(final, MASK, None, 0.5), [[0, 0, 1, 0], [2, 0, 0, 0]])
    # a row with no action token has nowhere to put its reward
    close(token_rewards(T([5.0]), T([[False, False]]), None, 0.1), [[0, 0]])


def test_discounted_returns_by_hand():
    # gamma 0.5: G2 = 3, G1 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75; the pad's 100 never counts
    out = discounted_returns(T([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]]), MASK, 0.5)
    close(out, [[2.75, 3.5, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])


def test_gae_by_hand():
    rewards = T([[0.0, 0.0, 1.0, 50.0]])
    values = T([[0.5, 0.4, 0.3, 60.0]])
    mask = T([[True, True, True, False]])
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    # deltas (V after the last action token is 0, not the pad's 60):
    d2 = 1.0 + 0.9 * 0.0 - 0.3  # 0.7
    d1 = 0.0 + 0.9 * 0.3 - 0.4  # -0.13
    d0 = 0.0 + 0.9 * 0.4 - 0.5  # -0.14
    a2 = d2  # 0.7
    a1 = d1 + 0.9 * 0.8 * a2  # -0.13 + 0.504 = 0.374
    a0 = d0 + 0.9 * 0.8 * a1  # -0.14 + 0.26928 = 0.12928
    close(adv, [[a0, a1, a2, 0.0]])
    close(ret, [[a0 + 0.5, a1 + 0.4, a2 + 0.3, 0.0]])  # [0.62928, 0.774, 1.0, 0]


def test_gae_with_lambda_one_is_returns_minus_values():
    # lambda = 1: A_t = G_t - V_t (the value terms telescope)
    rewards, values = T([[0.3, -0.2, 1.0]]), T([[0.1, 0.7, -0.4]])
    mask = T([[True, True, True]])
    adv, ret = gae(rewards, values, mask, 0.9, 1.0)
    close(adv, discounted_returns(rewards, mask, 0.9) - values)
    close(ret, discounted_returns(rewards, mask, 0.9))


def test_whiten_by_hand():
    x = T([[1.0, 2.0, 3.0, 100.0]])
    mask = T([[True, True, True, False]])
    # masked mean 2; biased var (1 + 0 + 1) / 3 = 2/3; std 0.816497
    s = math.sqrt(2 / 3)  # (x - mu) / sqrt(max(var, 1e-8)), OpenRLHF's normalisation
    close(whiten(x, mask), [[-1 / s, 0.0, 1 / s, 0.0]])
    close(whiten(x, mask, std=False), [[-1.0, 0.0, 1.0, 0.0]])
    close(whiten(x, mask, shift_mean=False), [[-1 / s + 2, 2.0, 1 / s + 2, 0.0]])


def test_compute_advantages_dispatch():
    r = T([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    mask = T([[True, True, False], [True, False, False]])
    # returns with gamma 1: row 0 [1, 1, pad], row 1 [2, pad, pad]; masked values {1, 1, 2}
    ret = [[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]]
    for name in ("rloo", "group_norm", "dr_grpo", "flash_reinforce"):
        adv, got = compute_advantages(name, token_rewards=r, mask=mask)
        close(adv, ret)
        close(got, ret)
    # reinforce: whitened returns. mean 4/3, biased var ((1/3)^2*2 + (2/3)^2) / 3 = 2/9
    s = math.sqrt(2 / 9)
    for name in ("reinforce", "reinforce_baseline"):
        adv, got = compute_advantages(name, token_rewards=r, mask=mask)
        close(got, ret)
        close(adv, [[-1 / 3 / s, -1 / 3 / s, 0.0], [2 / 3 / s, 0.0, 0.0]])
    adv, _ = compute_advantages("reinforce", token_rewards=r, mask=mask, std_norm=False)
    close(adv, [[-1 / 3, -1 / 3, 0.0], [2 / 3, 0.0, 0.0]])
    # gae with zero values and lambda 1 is the returns, then whitened like reinforce
    adv, got = compute_advantages("gae", token_rewards=r, mask=mask, values=torch.zeros(2, 3))
    close(got, ret)
    close(adv, [[-1 / 3 / s, -1 / 3 / s, 0.0], [2 / 3 / s, 0.0, 0.0]])
    with pytest.raises(ValueError, match="gae estimator needs values"):
        compute_advantages("gae", token_rewards=r, mask=mask)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", token_rewards=r, mask=mask)


# ---- KL ----------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp, ref = T([LN(0.5)]), T([LN(0.25)])
    close(kl_k1(logp, ref), [LN(2)])  # d = ln 0.5 - ln 0.25 = ln 2 = 0.693147
    close(kl_k2(logp, ref), [0.5 * LN(2) ** 2])  # 0.240227
    close(kl_k3(logp, ref), [0.5 + LN(2) - 1])  # exp(ln 0.5) - ln 0.5 - 1 = 0.193147
    # the estimate is bounded to [-10, 10] (OpenRLHF's compute_approx_kl): d = 20 -> 10
    close(kl_k1(T([0.0]), T([-20.0])), [10.0])
    close(kl_k3(T([-20.0]), T([0.0])), [10.0])  # exp(20) - 20 - 1 capped
    close(kl_k1(T([0.0]), T([-20.0]), bound=None), [20.0])
    assert tuple(KL_ESTIMATORS) == ("k1", "k2", "k3")


def test_kl_controller():
    fixed = KLController(coef=0.1)
    assert fixed.updated(100.0, 1000) is fixed
    adaptive = KLController(coef=0.1, target=6.0, horizon=10000)
    # KL 9 over target 6: err = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; coef = 0.1 (1 + 0.2*100/10000)
    assert adaptive.updated(9.0, 100).coef == pytest.approx(0.1 * 1.002)
    # KL 5.4: err = 5.4/6 - 1 = -0.1; coef = 0.1 (1 - 0.1*100/10000) = 0.0999
    nxt = adaptive.updated(5.4, 100)
    assert nxt.coef == pytest.approx(0.0999) and nxt.target == 6.0 and adaptive.coef == 0.1
    with pytest.raises(ValueError, match="target must be > 0"):
        KLController(coef=0.1, target=0.0)


# ---- policy and value losses -------------------------------------------------------------------


def _ppo_row(ratios, advs, **kw):
    logp = T([[LN(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    terms = ppo_clip(logp, torch.zeros_like(logp), T([advs], dtype=torch.float64),
                     torch.ones_like(logp, dtype=torch.bool), **kw)
    terms.loss.sum().backward()
    return terms, logp.grad


def test_ppo_clip_by_hand():
    terms, grad = _ppo_row([1.5, 1.5, 0.5, 0.5, 1.1], [1.0, -1.0, 1.0, -1.0, 2.0], clip_low=0.2, clip_high=0.2)
    # -min(rA, clip(r, 0.8, 1.2) A):
    #   r 1.5 A +1: -min(1.5, 1.2) = -1.2 (clipped)   r 1.5 A -1: -min(-1.5, -1.2) = 1.5
    #   r 0.5 A +1: -min(0.5, 0.8) = -0.5             r 0.5 A -1: -min(-0.5, -0.8) = 0.8 (clipped)
    #   r 1.1 A +2: -2.2
    close(terms.loss, [[-1.2, 1.5, -0.5, 0.8, -2.2]])
    assert terms.clipped.tolist() == [[True, False, False, True, False]]
    close(terms.ratio, [[1.5, 1.5, 0.5, 0.5, 1.1]])
    # d l / d logp = -A r where unclipped (dr/dlogp = r), 0 where clipped
    close(grad, [[0.0, 1.5, -0.5, 0.0, -2.2]])


def test_ppo_clip_higher_dual_clip_and_weights():
    terms, _ = _ppo_row([1.5], [1.0], clip_low=0.2, clip_high=0.28)
    close(terms.loss, [[-1.28]])  # DAPO clip-higher: clip(1.5, 0.8, 1.28) = 1.28
    terms, grad = _ppo_row([5.0, 1.5, 5.0], [-1.0, -1.0, 1.0], clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    # r 5 A -1: plain loss -min(-5, -1.2) = 5 > -c A = 3 -> 3 (dual clip, no gradient)
    # r 1.5 A -1: 1.5 < 3, unchanged; r 5 A +1: dual clip ignores positive A -> -1.2
    close(terms.loss, [[3.0, 1.5, -1.2]])
    assert terms.clipped.tolist() == [[True, False, True]]
    close(grad, [[0.0, 1.5, 0.0]])
    logp = T([[LN(1.5), LN(1.1)]])
    w = ppo_clip(logp, torch.zeros_like(logp), T([[-1.0, 2.0]]), T([[True, True]]),
                 clip_low=0.2, clip_high=0.2, weights=T([[0.5, 2.0]]))
    close(w.loss, [[1.5 * 0.5, -2.2 * 2.0]])
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        _ppo_row([1.0], [1.0], clip_low=0.2, clip_high=0.2, dual_clip=0.5)


def test_gspo_token_value_and_gradient():
    # row 0: log-ratios [0.2, 0.4] -> s = exp(0.3) = 1.349859 (inside [0.6, 1.4]); row 1: [-0.5] + pad
    s0, s1 = math.exp(0.3), math.exp(-0.5)  # 1.349859 and 0.606531, both inside [0.6, 1.4]
    old = T([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    logp = T([[0.2, 0.4], [-0.5, 123.0]], dtype=torch.float64, requires_grad=True)
    adv = T([[1.0, 1.0], [-2.0, 9.0]], dtype=torch.float64)
    mask = T([[True, True], [True, False]])
    terms = gspo_token(logp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    close(terms.ratio, [[s0, s0], [s1, 1.0]])
    close(terms.loss, [[-s0, -s0], [2 * s1, 0.0]])
    assert not terms.clipped.any()
    terms.loss.sum().backward()
    # each token's gradient is -A_t s_i (the detached sequence ratio times d logp_t), pad 0
    close(logp.grad, [[-s0, -s0], [2 * s1, 0.0]])
    # tighter band: s0 = 1.35 > 1.2 with A > 0 -> clipped at -1.2, s1 = 0.61 < 0.8 with A < 0 -> 2 * 0.8
    tight = gspo_token(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    close(tight.loss, [[-1.2, -1.2], [1.6, 0.0]])
    assert tight.clipped.tolist() == [[True, True], [True, False]]


@pytest.mark.parametrize("loss", [gspo, gspo_token])
def test_gspo_with_seq_mean_token_mean_is_the_sequence_objective(loss):
    # GSPO's objective -mean_i s_i A_i (s_i not detached) has the gradient of gspo, and of
    # GSPO-token reduced with seq-mean-token-mean, when A is constant in a sequence (inside the band).
    old = T([[0.1, -0.2, 0.3], [0.0, 0.2, 0.0]], dtype=torch.float64)
    base = T([[0.15, -0.1, 0.2], [0.05, 9.0, 9.0]], dtype=torch.float64)
    mask = T([[True, True, True], [True, False, False]])
    adv = T([[1.5] * 3, [-0.5] * 3], dtype=torch.float64)
    a = base.clone().requires_grad_()
    agg = AGGREGATIONS["seq-mean-token-mean"]
    (agg.total(loss(a, old, adv, mask, clip_low=0.5, clip_high=0.5).loss, mask) / agg.units(mask)).backward()
    b = base.clone().requires_grad_()
    seq = ((b - old) * mask).sum(-1).div(mask.sum(-1)).exp()
    (-(seq * adv[:, 0]).mean()).backward()
    close(a.grad, b.grad, tol=1e-10)


def test_value_loss_by_hand():
    v, old, mask = T([[1.0, 0.2, 1.0, 7.0]]), T([[0.5, 0.5, 0.5, 7.0]]), T([[True, True, True, False]])
    ret = T([[0.0, 1.0, 2.0, -7.0]])
    # V 1.0, old 0.5, R 0, c 0.2: V^clip 0.7; 0.5 max(1, 0.49) = 0.5
    # V 0.2, old 0.5, R 1: V^clip 0.3; 0.5 max(0.64, 0.49) = 0.32
    # V 1.0, old 0.5, R 2: V^clip 0.7; 0.5 max(1, 1.69) = 0.845 (the clipped term wins)
    close(value_loss(v, old, ret, mask, clip=0.2), [[0.5, 0.32, 0.845, 0.0]])
    close(value_loss(v, old, ret, mask, clip=None), [[0.5, 0.32, 0.5, 0.0]])


def test_padding_never_contributes():
    mask = T([[True, True, False], [True, False, False]])
    pad = ~mask

    def inputs(junk: float) -> list[torch.Tensor]:
        base = [T([[-0.3, -0.9, 0.0], [-1.2, 0.0, 0.0]]), T([[-0.4, -0.7, 0.0], [-1.0, 0.0, 0.0]]),
                T([[0.8, -0.5, 0.0], [1.3, 0.0, 0.0]])]
        # a different junk value per tensor, so that differences of inputs are junk too
        return [torch.where(pad, junk * k, x).double().requires_grad_() for x, k in zip(base, (1, -0.5, 0.3), strict=True)]

    def everything(x, y, z):
        wts, keep = is_correction(y, z, mask, mode="clip", low=0.5, high=5.0)
        adv, ret = compute_advantages("gae", token_rewards=token_rewards(z[:, 0], mask, x - y, 0.1),
                                      mask=mask, values=y, gamma=0.9, lambd=0.8)
        outs = [ppo_clip(x, y, adv, mask, clip_low=0.2, clip_high=0.3, dual_clip=3.0, weights=wts).loss,
                gspo(x, y, adv, mask, clip_low=0.2, clip_high=0.3, dual_clip=3.0).loss,
                gspo_token(x, y, adv, mask, clip_low=0.2, clip_high=0.3, weights=wts).loss,
                value_loss(x, y, ret, mask, clip=0.2), wts, keep.double(),
                whiten(x, mask), discounted_returns(x, mask, 0.7)]
        outs += [f(x, y) * mask for f in KL_ESTIMATORS.values()]
        outs += [is_correction(x, z, mask, level=lv, gating=g, low=0.0, high=5.0)[0]
                 for lv in IS_LEVELS for g in IS_GATES]
        return outs

    results = []
    for junk in (0.0, 1e4):
        xyz = inputs(junk)
        outs = everything(*xyz)
        sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
        results.append((outs, [t.grad for t in xyz]))
    (outs_a, grads_a), (outs_b, grads_b) = results
    for a, b in zip(outs_a + grads_a, outs_b + grads_b, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)
    for g in grads_b:
        assert (g[pad] == 0).all()


# ---- aggregations ------------------------------------------------------------------------------


def test_aggregations_by_hand():
    x = T([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = T([[True, True, True], [True, False, False], [False, False, False]])
    tok, seq, dr = (AGGREGATIONS[k] for k in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    close(tok.total(x, mask), 10.0)  # 1 + 2 + 3 + 4
    assert tok.units(mask) == 4.0
    close(seq.total(x, mask), 6.0)  # mean(1, 2, 3) + mean(4) = 2 + 4; the empty row adds 0
    assert seq.units(mask) == 2.0  # rows with any action token
    close(dr.total(x, mask), 10.0)  # (1 + 2 + 3) + 4
    assert dr.units(mask) == 3.0  # all rows


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_aggregation_is_invariant_to_the_micro_batch_split(name):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    old = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    mask = torch.arange(4)[None, :] < T([4, 1, 3, 2, 4])[:, None]
    agg = AGGREGATIONS[name]

    def step(splits):
        logp = base.clone().requires_grad_()
        units = sum(agg.units(mask[s]) for s in splits)  # the step-wide denominator comes first
        loss = sum(agg.total(ppo_clip(logp[s], old[s], adv[s], mask[s], clip_low=0.2, clip_high=0.2).loss,
                             mask[s]) / units for s in splits)
        loss.backward()
        return loss.detach(), logp.grad

    whole = step([slice(0, 5)])
    for split in ([slice(0, 2), slice(2, 5)], [slice(0, 1), slice(1, 4), slice(4, 5)]):
        got = step(split)
        torch.testing.assert_close(got[0], whole[0])
        torch.testing.assert_close(got[1], whole[1])


# ---- IS correction -----------------------------------------------------------------------------


def test_is_corrections_by_hand():
    # rho = exp(old - rollout): row 0 [2, 0.25, 8], row 1 [8, 8, pad]; band [0.5, 5]
    rollout = torch.zeros(2, 3)
    old = T([[LN(2), LN(0.25), LN(8)], [LN(8), LN(8), 50.0]])
    mask = T([[True, True, True], [True, True, False]])
    w, keep = is_correction(old, rollout, mask, level="token", mode="clip", low=0.5, high=5.0)  # TIS
    close(w, [[2.0, 0.5, 5.0], [5.0, 5.0, 0.0]])  # clamped into the band
    assert keep.tolist() == mask.tolist()
    w, keep = is_correction(old, rollout, mask, level="token", mode="mask", low=0.5, high=5.0)  # IcePop
    close(w, [[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # 0.25 and 8 are out of band: dropped
    assert keep.tolist() == [[True, False, False], [False, False, False]]
    w, keep = is_correction(old, rollout, mask, level="seq", mode="mask", low=0.5, high=5.0)  # seq-mask-tis
    # row 0: g = (2 * 0.25 * 8)^(1/3) = 4^(1/3) = 1.587 in band -> kept with raw ratios
    # row 1: g = (8 * 8)^(1/2) = 8 > 5 -> the whole sequence is masked
    close(w, [[2.0, 0.25, 8.0], [0.0, 0.0, 0.0]])
    assert keep.tolist() == [[True, True, True], [False, False, False]]
    with pytest.raises(ValueError, match="unknown IS correction"):
        is_correction(old, rollout, mask, mode="tis", low=0.5, high=5.0)
    with pytest.raises(ValueError, match="needs level token and gating ratio"):
        is_correction(old, rollout, mask, level="seq", mode="clip", low=0.5, high=5.0)
    with pytest.raises(ValueError, match="0 <= low < high"):
        is_correction(old, rollout, mask, low=5.0, high=0.5)


def test_is_weights_are_detached_and_gap_by_hand():
    old = T([[-1.0, -2.0, 0.0]], requires_grad=True)
    rollout = T([[-1.5, -1.0, 30.0]])
    mask = T([[True, True, False]])
    w, _ = is_correction(old, rollout, mask, mode="clip", low=0.5, high=5.0)
    assert not w.requires_grad
    mean_abs, max_abs = logprob_gap(old, rollout, mask)  # |0.5|, |-1.0|; the pad's 30 is ignored
    assert mean_abs == pytest.approx(0.75) and max_abs == pytest.approx(1.0)
    assert logprob_gap(old, rollout, torch.zeros_like(mask)) == (0.0, 0.0)


# ---- shaping -----------------------------------------------------------------------------------


def test_shaping_by_hand():
    close(clip_rewards(T([-20.0, 0.5, 20.0]), -10.0, 10.0), [-10.0, 0.5, 10.0])
    close(normalize(T([3.0, 5.0]), 4.0, 2.0), [-0.5, 0.5])
    # groups [1, 1 | 0, 1 | 0, 0]: means 1, 0.5, 0; strictly inside (0, 1) keeps only the middle
    assert dynamic_filter(T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2, 0.0, 1.0).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="not a multiple of group_size 4"):
        dynamic_filter(T([1.0, 0.0]), 4, 0.0, 1.0)
    # max_len 20, buffer 4: expected 16; L = 10 -> 0, 18 -> -(2/4), 25 -> -1 (capped)
    pen = overlong_penalty(T([10, 18, 25]), 20, 4, 1.0)
    assert pen.dtype == torch.float32
    close(pen, [0.0, -0.5, -1.0])
    # truncated sample: coef 0.5 scales its reward, coef -1 replaces it
    close(stop_properly(T([1.0, 1.0]), T([True, False]), 0.5), [1.0, 0.5])
    close(stop_properly(T([1.0, 1.0]), T([True, False]), -1.0), [1.0, -1.0])
