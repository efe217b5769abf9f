"""``rl.update.actor_step`` wiring, on a stand-in engine (a bigram table as the policy, CPU, one
rank): OpenRLHF's ``ppo_clip_ratio`` / ``ppo_kl`` metrics beside treadle's ``clip_frac``, GSPO's
ratio against the rollout's logprobs with the IS correction (no weights applied), dual clip
reaching GSPO, and the unbiased KL gradient."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from treadle.common.records import Trajectory
from treadle.trainer.models.actor import Actor
from treadle.trainer.rl.experience import collate, from_trajectory
from treadle.trainer.rl.update import Batching, PolicyLoss, actor_step

VOCAB = 8


class BigramEngine(torch.nn.Module):
    """The parts of a DeepSpeed engine ``actor_step`` calls; logits[t] = table[token t]."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float32))

    def forward(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        loss.backward()

    def step(self) -> None:  # gradients accumulate; the weights stay (one step's math, inspectable)
        pass

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        pass

    def get_lr(self) -> list[float]:
        return [0.0]

    def get_global_grad_norm(self) -> None:
        return None


BATCH = Batching(micro_batch=8, token_budget=None, packing=False, pad_id=0, device=torch.device("cpu"))


def experiences(engine: BigramEngine, lengths: list[int]) -> tuple[list, list[np.ndarray]]:
    exps = []
    for k, n in enumerate(lengths):
        response = np.arange(1, n + 1, dtype=np.int32) % VOCAB + k
        traj = Trajectory(prompt_token_ids=np.array([1, 2], dtype=np.int32), response_token_ids=response,
                          rollout_logprobs=np.zeros(n, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8))
        exps.append(from_trajectory(traj))
    with torch.no_grad():
        ab = collate(exps, packing=False, pad_id=0)
        logp = ab.actions(Actor(engine)(ab.batch, targets_only=True).logprobs)
    return exps, [logp[k, :n].numpy().astype(np.float64) for k, n in enumerate(lengths)]


def loss_settings(**kw: object) -> PolicyLoss:
    base = {"kind": "ppo", "clip_low": 0.2, "clip_high": 0.2, "dual_clip": None, "entropy_coef": None,
            "aggregation": "token-mean", "kl_coef": 0.0, "kl_estimator": "k1", "temperature": 1.0}
    return PolicyLoss(**{**base, **kw})


def fill(exps, logp, *, shift, adv, rollout_shift=None, weight=1.0) -> None:
    """old = logp - shift (ratio e^shift), advantages, rollout = logp - rollout_shift, IS weights."""
    for e, lp, s, a in zip(exps, logp, shift, adv, strict=True):
        e.arrays["old_logp"] = (lp - np.asarray(s)).astype(np.float32)
        e.arrays["advantages"] = np.asarray(a, dtype=np.float32)
        r = np.asarray(s if rollout_shift is None else rollout_shift[exps.index(e)])
        e.arrays["rollout_logp"] = (lp - r).astype(np.float32)
        e.arrays["is_weights"] = np.full(e.num_actions, weight, dtype=np.float32)


@pytest.mark.parametrize(("aggregation", "clip_frac"), [("token-mean", 0.5), ("seq-mean-token-mean", (1 / 3 + 1) / 2)])
def test_ppo_clip_ratio_is_the_plain_token_mean(aggregation, clip_frac):
    engine = BigramEngine()
    exps, logp = experiences(engine, [3, 1])
    # ratios [1.5, 1, 1] and [1.5], A = +1: clipped [T, F, F] and [T]
    up = math.log(1.5)
    fill(exps, logp, shift=[[up, 0.0, 0.0], [up]], adv=[[1.0] * 3, [1.0]])
    m = actor_step(engine, exps, BATCH, loss_settings(aggregation=aggregation), world=1)
    assert m["actor/ppo_clip_ratio"] == pytest.approx(0.5)  # 2 of 4 tokens, whatever the aggregation
    assert m["actor/clip_frac"] == pytest.approx(clip_frac)  # treadle's: the loss's aggregation
    assert m["actor/ppo_kl"] == pytest.approx(-2 * up / 4, abs=1e-6)  # mean of old - logp


def test_gspo_with_the_correction_takes_its_ratio_against_the_rollout():
    engine = BigramEngine()
    exps, logp = experiences(engine, [2])
    # old = logp (ratio 1), rollout = logp - 0.2: s = e^0.2 = 1.2214 inside [0.7, 1.3]; IS weights 0
    fill(exps, logp, shift=[[0.0, 0.0]], adv=[[1.0, 1.0]], rollout_shift=[[0.2, 0.2]], weight=0.0)
    m = actor_step(engine, exps, BATCH, loss_settings(kind="gspo", clip_low=0.3, clip_high=0.3,
                                                      aggregation="seq-mean-token-mean", ratio_to_rollout=True), world=1)
    assert m["actor/policy_loss"] == pytest.approx(-math.exp(0.2), abs=1e-5)  # weights not applied
    assert m["actor/ratio"] == pytest.approx(math.exp(0.2), abs=1e-5)
    m = actor_step(engine, exps, BATCH, loss_settings(kind="gspo", clip_low=0.3, clip_high=0.3,
                                                      aggregation="seq-mean-token-mean"), world=1)
    assert m["actor/policy_loss"] == pytest.approx(0.0)  # against old: ratio 1, times the IS weight 0


def test_dual_clip_reaches_gspo():
    engine = BigramEngine()
    exps, logp = experiences(engine, [2])
    # s = e^2 = 7.39, A = -1: loss 7.39 without the dual clip, c = 3 with it
    fill(exps, logp, shift=[[2.0, 2.0]], adv=[[-1.0, -1.0]])
    for dual, expected in ((None, math.exp(2.0)), (3.0, 3.0)):
        m = actor_step(engine, exps, BATCH, loss_settings(kind="gspo", aggregation="seq-mean-token-mean",
                                                          dual_clip=dual), world=1)
        assert m["actor/policy_loss"] == pytest.approx(expected, abs=1e-4)


def test_unbiased_kl_gradient_in_the_step():
    grads = {}
    for unbiased in (False, True):
        engine = BigramEngine()
        exps, logp = experiences(engine, [3])
        fill(exps, logp, shift=[[0.0, 0.0, 0.0]], adv=[[0.0, 0.0, 0.0]])  # no policy-gradient signal
        exps[0].arrays["ref_logp"] = (logp[0] - np.array([3.0, -1.0, 0.5])).astype(np.float32)  # d = [3, -1, 0.5]
        actor_step(engine, exps, BATCH, loss_settings(kl_coef=1.0, kl_estimator="k3",
                                                      kl_unbiased_gradient=unbiased), world=1)
        grads[unbiased] = engine.table.grad.clone()
    # by hand: the loss is sum_t k_t / 3; with the unbiased gradient d k_t / d logp_t = w d_t = d_t (old = logp)
    engine = BigramEngine()
    exps, _ = experiences(engine, [3])
    ab = collate(exps, packing=False, pad_id=0)
    lp = ab.actions(Actor(engine)(ab.batch, targets_only=True).logprobs)
    (lp * torch.tensor([[3.0, -1.0, 0.5]]) / 3).sum().backward()
    torch.testing.assert_close(grads[True], engine.table.grad, atol=1e-5, rtol=1e-5)
    # k3's own gradient 1 - exp(-d) = [0.950, -1.718, 0.393] differs
    assert not torch.allclose(grads[False], grads[True], atol=1e-3)


def test_kl_and_entropy_terms_are_token_means_whatever_the_loss_aggregation():
    engine = BigramEngine()
    exps, logp = experiences(engine, [3, 1])
    fill(exps, logp, shift=[[0.0] * 3, [0.0]], adv=[[0.0] * 3, [0.0]])
    for e, lp in zip(exps, logp, strict=True):
        e.arrays["ref_logp"] = (lp - 0.5).astype(np.float32)  # d = 0.5: k1 = 0.5, d k1 / d logp = 1
    m = actor_step(engine, exps, BATCH, loss_settings(aggregation="seq-mean-token-mean", kl_coef=1.0), world=1)
    assert m["actor/kl_loss"] == pytest.approx(0.5, abs=1e-6)
    # OpenRLHF's aggregate_loss for the KL term: sum over the 4 tokens / 4 (a sequence mean would weigh
    # the one-token row's token 3 times as much as each of the other row's)
    fresh = BigramEngine()
    ab = collate(exps, packing=False, pad_id=0)
    (ab.actions(Actor(fresh)(ab.batch, targets_only=True).logprobs).sum() / 4).backward()
    torch.testing.assert_close(engine.table.grad, fresh.table.grad, atol=1e-6, rtol=1e-6)
