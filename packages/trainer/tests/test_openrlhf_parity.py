"""Parity with OpenRLHF 0.11.2 itself: its math modules against treadle's functions on random
and extreme inputs (hypothesis), values and gradients, for every KL estimator, policy / value /
SFT / preference / RM loss, IS correction, aggregation and advantage estimator treadle shares;
and a test for each deliberate difference (docs/rl.md, "Where treadle differs from OpenRLHF").

The reference is OpenRLHF's wheel, downloaded with ``pip download --no-deps`` and unpacked (never
installed) by ``make test`` into ``.cache/reference/openrlhf-0.11.2``. Its package imports vLLM,
Ray, flash-attn and DeepSpeed at module level, so only the files holding the math are loaded,
each with named stand-ins for the modules it imports but never calls here."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle.trainer.losses.preference import dpo_loss, ipo_loss
from treadle.trainer.losses.rm import logexp_loss, sigmoid_loss
from treadle.trainer.losses.sft import nll_loss, nll_loss_seq_mean
from treadle.trainer.ops.logprobs import token_entropy, token_logprobs
from treadle.trainer.rl._masked import row_mean
from treadle.trainer.rl.advantages import GROUP_BASELINES, compute_advantages, token_rewards
from treadle.trainer.rl.correction import is_correction
from treadle.trainer.rl.kl import KL_ESTIMATORS, KLController, unbiased_kl_gradient
from treadle.trainer.rl.policy_loss import AGGREGATIONS, POLICY_LOSSES, value_loss
from treadle.trainer.rl.shaping import clip_rewards

REFERENCE = Path(__file__).resolve().parents[3] / ".cache" / "reference" / "openrlhf-0.11.2"
"""Where ``make test`` unpacks OpenRLHF 0.11.2's wheel (Makefile: OPENRLHF_REF)."""


def _package_dir() -> Path | None:
    for sub in ("openrlhf-0.11.2.data/purelib/openrlhf", "openrlhf"):
        if (REFERENCE / sub / "models" / "loss.py").is_file():
            return REFERENCE / sub
    return None


PKG = _package_dir()
pytestmark = pytest.mark.skipif(
    PKG is None, reason=f"OpenRLHF 0.11.2 is not unpacked at {REFERENCE}: `make test` fetches it with "
    "`pip download --no-deps openrlhf==0.11.2` (needs PyPI); without it this parity suite cannot run")


def _stand_in(name: str, **attrs: object) -> types.ModuleType:
    """An empty module named ``name`` (a package when ``__path__`` is given), marked as a stand-in."""
    mod = types.ModuleType(name, f"stand-in for {name}: imported by OpenRLHF's math modules, never called by these tests")
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _never_called(*_: object, **__: object) -> None:
    raise AssertionError("a stand-in was called: the parity suite must not reach this OpenRLHF code path")


@contextlib.contextmanager
def _modules(entries: dict[str, types.ModuleType]):
    """sys.modules with ``entries`` added while OpenRLHF's files load; restored afterwards, so the rest
    of the session (which imports the real deepspeed) never sees a stand-in."""
    saved = {name: sys.modules.get(name) for name in entries}
    sys.modules.update(entries)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
        for name in [n for n in sys.modules if n == "openrlhf" or n.startswith("openrlhf.")]:
            del sys.modules[name]


def _load(name: str, relative: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, PKG / relative)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def orl() -> SimpleNamespace:
    """OpenRLHF's ``models.utils``, ``models.loss`` and ``trainer.ppo_utils.experience_maker``."""
    packages = {n: _stand_in(n, __path__=[]) for n in ("openrlhf", "openrlhf.models", "openrlhf.trainer",
                                                        "openrlhf.trainer.ppo_utils", "openrlhf.trainer.ray",
                                                        "openrlhf.utils")}
    leaves = {
        "deepspeed": _stand_in("deepspeed", utils=SimpleNamespace(set_z3_leaf_modules=_never_called)),
        "ray": _stand_in("ray", get=_never_called, put=_never_called),
        "openrlhf.trainer.ppo_utils.experience": _stand_in("openrlhf.trainer.ppo_utils.experience", Experience=object),
        "openrlhf.trainer.ray.launcher": _stand_in("openrlhf.trainer.ray.launcher", RayActorGroup=object),
        "openrlhf.utils.seqlen_balancing": _stand_in(
            "openrlhf.utils.seqlen_balancing", get_minimum_num_micro_batch_size=_never_called,
            get_seqlen_balanced_partitions=_never_called),
    }
    with _modules({**packages, **leaves}):
        _load("openrlhf.utils.logging_utils", "utils/logging_utils.py")
        utils = _load("openrlhf.models.utils", "models/utils.py")
        loss = _load("openrlhf.models.loss", "models/loss.py")
        _load("openrlhf.trainer.ppo_utils.length_penalty", "trainer/ppo_utils/length_penalty.py")
        maker = _load("openrlhf.trainer.ppo_utils.experience_maker", "trainer/ppo_utils/experience_maker.py")
    return SimpleNamespace(utils=utils, loss=loss, maker=maker)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-7, rtol: float = 1e-7) -> None:
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=rtol, equal_nan=False)


# ---- inputs ------------------------------------------------------------------------------------

VALUE = st.one_of(st.sampled_from([-30.0, 30.0, 0.0]), st.floats(-30.0, 30.0, allow_nan=False))


@st.composite
def batches(draw, nonempty: bool = True):
    """float64 (logp, old, ref, rollout) [B, L] with log-ratios in [-30, 30] (log-probs <= 0),
    advantages [B, L] up to 1e4, rewards [B] up to 1e4, mask [B, L] (prefix; rows of >= 1 token), n."""
    groups, n, width = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4])), draw(st.integers(1, 5))
    b = groups * n
    lo = 1 if nonempty else 0
    lengths = draw(st.lists(st.sampled_from([lo, 1, width]) | st.integers(lo, width), min_size=b, max_size=b))
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]

    def grid(scale: float = 1.0) -> torch.Tensor:
        vals = draw(st.lists(VALUE, min_size=b * width, max_size=b * width))
        return torch.tensor(vals, dtype=torch.float64).view(b, width) * scale

    logp, old, ref, rollout = (grid() / 2 - 15.0 for _ in range(4))  # in [-30, 0]: ratios of e^+-30
    adv = grid(1e4 / 30.0)
    rewards = torch.tensor(draw(st.lists(st.sampled_from([1e4, -1e4, 0.0, 1.0, 0.5]) | st.floats(-1e4, 1e4),
                                         min_size=b, max_size=b)), dtype=torch.float64)
    return SimpleNamespace(logp=logp, old=old, ref=ref, rollout=rollout, adv=adv, rewards=rewards, mask=mask, n=n)


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])


# ---- KL ----------------------------------------------------------------------------------------


@SETTINGS
@given(batches())
def test_kl_estimators_match(orl, x):
    for name, est in KL_ESTIMATORS.items():
        for unbiased in (False, True):
            a = x.logp.float().requires_grad_()
            b = x.logp.float().requires_grad_()
            theirs = orl.utils.compute_approx_kl(a, x.ref.float(), x.old.float(), kl_estimator=name, unbiased_gradient=unbiased)
            mine = est(b, x.ref.float())
            if unbiased:
                mine = unbiased_kl_gradient(mine, b, x.ref.float(), x.old.float())
            close(mine, theirs, tol=1e-5, rtol=1e-6)  # float32 (OpenRLHF casts), operations in another order
            (ga,) = torch.autograd.grad((theirs * x.mask).sum(), a)
            (gb,) = torch.autograd.grad((mine * x.mask).sum(), b)
            close(gb, ga, tol=1e-4, rtol=1e-5)


def test_kl_controller_matches(orl):
    cls = _load_kl_controller()
    theirs = cls(0.1, 6.0, 10000)
    mine = KLController(coef=0.1, target=6.0, horizon=10000)
    for current, n in ((9.0, 100), (5.4, 64), (6.0, 1000), (0.0, 10)):
        theirs.update(current, n)
        mine = mine.updated(current, n)
        assert mine.coef == pytest.approx(theirs.value, rel=1e-12)


def _load_kl_controller():
    with _modules({"openrlhf": _stand_in("openrlhf", __path__=[]), "openrlhf.trainer": _stand_in("openrlhf.trainer", __path__=[]),
                   "openrlhf.trainer.ppo_utils": _stand_in("openrlhf.trainer.ppo_utils", __path__=[])}):
        return _load("openrlhf.trainer.ppo_utils.kl_controller", "trainer/ppo_utils/kl_controller.py").AdaptiveKLController


# ---- policy loss, corrections, aggregations ----------------------------------------------------

CORRECTIONS = [  # (level, mode, gating, threshold): TIS, IcePop, seq-mask-tis, trust regions
    ("off", "mask", "ratio", (0.5, 5.0)), ("token", "clip", "ratio", (0.5, 5.0)), ("token", "mask", "ratio", (0.5, 5.0)),
    ("seq", "mask", "ratio", (0.5, 5.0)), ("token", "mask", "binary_kl", (0.0, 0.05)), ("seq", "mask", "binary_kl", (0.0, 0.5)),
    ("token", "mask", "tv", (0.0, 0.3)), ("seq", "mask", "tv", (0.0, 0.5)),
]


def _treadle_policy_loss(kind, x, logp, level, mode, gating, band, dual, aggregation):
    old, weights = x.old, None
    if level != "off" and kind == "ppo":
        weights, _ = is_correction(x.old, x.rollout, x.mask, level=level, mode=mode, gating=gating, low=band[0], high=band[1])
    if level != "off" and kind == "gspo":
        old = x.rollout  # OpenRLHF's GSPO correction: the sequence ratio against the rollout
    terms = POLICY_LOSSES[kind](logp, old, x.adv, x.mask, clip_low=0.2, clip_high=0.28, dual_clip=dual, weights=weights)
    agg = AGGREGATIONS[aggregation]
    return agg.total(terms.loss, x.mask) / agg.units(x.mask), terms


@SETTINGS
@given(batches(), st.sampled_from(CORRECTIONS), st.sampled_from([None, 3.0]), st.booleans())
def test_policy_losses_match(orl, x, correction, dual, token_level):
    level, mode, gating, band = correction
    for kind in ("ppo", "gspo"):
        loss_fn = orl.loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual, token_level_loss=token_level,
                                      policy_loss_type=kind, is_correction_level=level, is_correction_mode=mode,
                                      is_correction_gating=gating, is_correction_threshold=list(band))
        a, b = x.logp.clone().requires_grad_(), x.logp.clone().requires_grad_()
        theirs, clip_ratio, ppo_kl, _, _ = loss_fn(a, x.old, x.adv, action_mask=x.mask.double(), rollout_log_probs=x.rollout)
        aggregation = "token-mean" if token_level and kind == "ppo" else "seq-mean-token-mean"  # GSPO forces seq
        mine, terms = _treadle_policy_loss(kind, x, b, level, mode, gating, band, dual, aggregation)
        # to 1e-7 relative: OpenRLHF's sequence mean divides by (count + 1e-8)
        close(mine, theirs, tol=1e-7 * max(1.0, float(theirs.detach().abs())), rtol=1e-7)
        (ga,) = torch.autograd.grad(theirs, a)
        (gb,) = torch.autograd.grad(mine, b)
        close(gb, ga, tol=1e-7 * max(1.0, float(ga.abs().max())), rtol=1e-7)
        units = float(x.mask.sum())
        assert float(terms.ppo_clipped.sum()) / units == pytest.approx(float(clip_ratio), abs=1e-12)
        assert float(((x.old - x.logp) * x.mask).sum()) / units == pytest.approx(float(ppo_kl), abs=1e-9)


@SETTINGS
@given(batches(), st.sampled_from([None, 0.2, 0.5]))
def test_value_loss_matches(orl, x, clip):
    a, b = x.logp.clone().requires_grad_(), x.logp.clone().requires_grad_()
    theirs = orl.loss.ValueLoss(clip_eps=clip)(a, x.old, x.adv / 1e3, action_mask=x.mask.double())
    agg = AGGREGATIONS["token-mean"]
    mine = agg.total(value_loss(b, x.old, x.adv / 1e3, x.mask, clip=clip), x.mask) / agg.units(x.mask)
    close(mine, theirs, tol=1e-9 * max(1.0, float(theirs.detach())), rtol=1e-9)
    close(torch.autograd.grad(mine, b)[0], torch.autograd.grad(theirs, a)[0], tol=1e-9, rtol=1e-9)


@SETTINGS
@given(batches())
def test_aggregations_and_sft_loss_match(orl, x):
    for token_level, name in ((True, "token-mean"), (False, "seq-mean-token-mean")):
        theirs = orl.loss.aggregate_loss(x.adv, x.mask.double(), token_level_loss=token_level)
        agg = AGGREGATIONS[name]
        close(agg.total(x.adv, x.mask) / agg.units(x.mask), theirs, tol=1e-7 * max(1.0, float(theirs.abs())), rtol=1e-7)
    sft = orl.loss.SFTLoss(token_level_loss=True)(x.logp, x.mask.double())
    close(nll_loss(x.logp, x.mask, float(x.mask.sum())), sft, tol=1e-10, rtol=1e-10)
    sft_seq = orl.loss.SFTLoss(token_level_loss=False)(x.logp, x.mask.double())
    rows = torch.arange(x.mask.shape[0])[:, None].expand(x.mask.shape)
    mine = nll_loss_seq_mean(x.logp, x.mask, rows, x.mask.shape[0], float(x.mask.any(-1).sum()))
    close(mine, sft_seq, tol=1e-7, rtol=1e-7)  # OpenRLHF divides by count + 1e-8


@SETTINGS
@given(st.lists(st.floats(-20, 20), min_size=8, max_size=8), st.sampled_from([0.0, 0.1]), st.booleans())
def test_preference_and_rm_losses_match(orl, vals, smoothing, ipo):
    pc, pr, rc, rr = torch.tensor(vals, dtype=torch.float64).view(4, 2)
    theirs, _, _ = orl.loss.DPOLoss(0.1, 0.0 if ipo else smoothing, ipo=ipo)(pc, pr, rc, rr)
    mine = (ipo_loss(pc, pr, rc, rr, 0.1) if ipo else dpo_loss(pc, pr, rc, rr, 0.1, smoothing)).mean()
    close(mine, theirs, tol=1e-6, rtol=1e-6)  # treadle computes in fp32
    close(sigmoid_loss(pc, pr).mean(), orl.loss.PairWiseLoss()(pc, pr), tol=1e-6, rtol=1e-6)
    close(logexp_loss(pc, pr).mean(), orl.loss.LogExpLoss()(pc, pr), tol=1e-6, rtol=1e-6)


def test_logprobs_and_entropy_match_in_fp32(orl):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=gen) * 5
    ids = torch.randint(0, 11, (2, 6), generator=gen)
    theirs = orl.utils.log_probs_from_logits(logits[:, :-1].clone(), ids[:, 1:], temperature=0.7)
    close(token_logprobs(logits, ids, 0.7)[:, 1:], theirs, tol=1e-5, rtol=1e-6)
    ent = orl.utils.compute_entropy.__wrapped__(logits[:, :-1])  # the function under its torch.compile
    close(token_entropy(logits)[:, 1:], ent, tol=1e-5, rtol=1e-6)


# ---- advantages and returns --------------------------------------------------------------------


def _openrlhf_advantages(orl, estimator, x, *, kl, mask, values, gamma, lambd, no_std_norm, kl_coef, clip=(-10.0, 10.0)):
    """OpenRLHF's compute_advantages_and_returns on one experience holding the whole batch."""
    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=gamma, lambd=lambd, no_std_norm=no_std_norm)),
        rollout=SimpleNamespace(n_samples_per_prompt=x.n, max_new_tokens=None),
        reward=SimpleNamespace(clip_range=clip, overlong_buffer_len=None, stop_properly_penalty_coef=None))
    maker = SimpleNamespace(strategy=SimpleNamespace(args=args), kl_ctl=SimpleNamespace(value=kl_coef),
                            advantage_estimator=estimator)
    for name in ("get_advantages_and_returns", "get_cumulative_returns"):
        setattr(maker, name, getattr(orl.maker.RemoteExperienceMaker, name).__get__(maker))
    exp = SimpleNamespace(index=list(range(len(x.rewards))), rewards=x.rewards.clone(), info={}, kl=kl,
                          action_mask=mask, values=values, truncated=None)
    orl.maker.RemoteExperienceMaker.compute_advantages_and_returns(maker, [exp])
    return exp.advantages, exp.returns


ESTIMATORS = ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo", "flash_reinforce"]


@SETTINGS
@given(batches(), st.sampled_from(ESTIMATORS), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.95]), st.booleans())
def test_advantage_estimators_match(orl, x, estimator, gamma, lambd, no_std_norm):
    kl = KL_ESTIMATORS["k1"](x.old, x.ref) * x.mask
    values = x.adv / 1e3 * x.mask
    theirs = _openrlhf_advantages(orl, estimator, x, kl=kl, mask=x.mask, values=values, gamma=gamma, lambd=lambd,
                                  no_std_norm=no_std_norm, kl_coef=0.05)
    g = gamma if estimator in ("gae", "reinforce") else 1.0  # OpenRLHF forces 1 for the others (a documented difference)
    final = clip_rewards(GROUP_BASELINES[estimator](x.rewards, x.n), -10.0, 10.0)
    r = token_rewards(final, x.mask, kl, 0.05)
    mine = compute_advantages(estimator, token_rewards=r, mask=x.mask, values=values, gamma=g, lambd=lambd,
                              std_norm=not no_std_norm)
    whitened = estimator in ("gae", "reinforce", "reinforce_baseline")
    for m_, t_ in zip(mine, theirs, strict=True):
        # OpenRLHF whitens with float32 statistics: agreement to float32 precision there
        close(m_ * x.mask, t_ * x.mask, tol=1e-5 if whitened else 1e-9, rtol=1e-5 if whitened else 1e-9)


@SETTINGS
@given(batches(), st.sampled_from(["gae", "reinforce"]), st.data())
def test_multi_turn_layout_matches_with_discount_env_tokens(orl, x, estimator, data):
    """OpenRLHF's layout: environment tokens are response positions with action mask 0; treadle's
    arrays hold only the actions, plus the gaps (``--algo.advantage.discount_env_tokens``)."""
    b, width = x.mask.shape
    gaps = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=b * width, max_size=b * width)),
                        dtype=torch.float64).view(b, width) * x.mask
    last = x.mask.sum(-1) - 1
    for i in range(b):  # no gap after a row's last action
        gaps[i, last[i]] = 0
    full = int((x.mask.sum(-1) + gaps.sum(-1)).max())
    where = (torch.cumsum(gaps + 1, dim=-1) - 1 - gaps).long()  # position of each action in the full response
    pmask = torch.zeros(b, full, dtype=torch.bool)

    def spread(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(b, full, dtype=torch.float64)
        for i in range(b):
            out[i, where[i][x.mask[i]]] = v[i][x.mask[i]]
        return out

    for i in range(b):
        pmask[i, where[i][x.mask[i]]] = True
    kl = KL_ESTIMATORS["k1"](x.old, x.ref) * x.mask
    values = x.adv / 1e3 * x.mask
    theirs = _openrlhf_advantages(orl, estimator, x, kl=spread(kl), mask=pmask, values=spread(values), gamma=0.9,
                                  lambd=0.8, no_std_norm=False, kl_coef=0.05)
    r = token_rewards(clip_rewards(x.rewards, -10.0, 10.0), x.mask, kl, 0.05)
    mine = compute_advantages(estimator, token_rewards=r, mask=x.mask, values=values, gamma=0.9, lambd=0.8, gaps=gaps)
    for m_, t_ in zip(mine, theirs, strict=True):
        close(spread(m_), t_ * pmask, tol=1e-5, rtol=1e-5)


# ---- the deliberate differences (docs/rl.md) ---------------------------------------------------


def test_difference_gamma_is_honoured_by_group_estimators(orl):
    x = SimpleNamespace(rewards=torch.tensor([1.0, 0.0], dtype=torch.float64), n=2)
    mask = torch.ones(2, 3, dtype=torch.bool)
    theirs, _ = _openrlhf_advantages(orl, "rloo", x, kl=torch.zeros(2, 3, dtype=torch.float64), mask=mask,
                                     values=torch.zeros(2, 3, dtype=torch.float64), gamma=0.5, lambd=1.0,
                                     no_std_norm=False, kl_coef=0.0)
    close(theirs, torch.tensor([[1.0] * 3, [-1.0] * 3]))  # OpenRLHF: gamma forced to 1
    r = token_rewards(GROUP_BASELINES["rloo"](x.rewards, 2), mask, None, 0.0)
    mine, _ = compute_advantages("rloo", token_rewards=r, mask=mask, gamma=0.5)
    close(mine, torch.tensor([[0.25, 0.5, 1.0], [-0.25, -0.5, -1.0]]))  # treadle: discounted
    same, _ = compute_advantages("rloo", token_rewards=r, mask=mask, gamma=1.0)  # --algo.advantage.gamma 1
    close(same, theirs)


def test_difference_rows_without_action_tokens_give_zero(orl):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, False]])
    theirs = orl.utils.masked_mean(x, mask.double(), dim=-1)
    assert torch.isnan(theirs[1])  # OpenRLHF: 0 / 0
    close(row_mean(x, mask), torch.tensor([1.5, 0.0]))  # treadle: 0
    # OpenRLHF's per-sequence KL metric (info["kl"]) is this masked mean: NaN for such a row; the
    # losses agree (both leave the row out)
    w, keep = is_correction(x, x, mask, level="seq", low=0.5, high=5.0)
    assert torch.isfinite(w).all() and not keep[1].any()


def test_difference_bf16_logprobs_are_computed_in_fp32(orl):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 9, 50, generator=gen) * 4).bfloat16()
    ids = torch.randint(0, 50, (2, 9), generator=gen)
    exact = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    theirs = orl.utils.log_probs_from_logits(logits[:, :-1].clone(), ids[:, 1:])
    mine = token_logprobs(logits, ids)[:, 1:]
    assert theirs.dtype == torch.bfloat16 and mine.dtype == torch.float32
    assert (mine.double() - exact).abs().max() < 1e-5  # fp32 of the bf16 logits
    assert (theirs.double() - exact).abs().max() > 1e-3  # OpenRLHF's log-softmax rounds in bf16
