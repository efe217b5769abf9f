"""Preference-optimisation losses against a frozen reference: DPO, cDPO, IPO, KTO.

All take summed log-probabilities of whole answers (sum over the answer's tokens of
log pi(y_t | x, y_<t)) for the policy and the reference, and return per-item losses (no
reduction). Notation: h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)).

- DPO (Rafailov et al. 2023, eq. 7): l = -log sigmoid(beta h).
- cDPO (Mitchell 2023, "A note on DPO with noisy preferences"): labels flipped with prob. eps:
  l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
- IPO (Azar et al. 2023, eq. 17): l = (h - 1 / (2 beta))^2, with beta playing IPO's tau.
- KTO (Ethayarajh et al. 2024, eq. 8): see ``kto_loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.functional import logsigmoid


def _h(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor) -> Tensor:
    return (pc.float() - rc.float()) - (pr.float() - rr.float())


def dpo_loss(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """l_i = -(1 - eps) log sigmoid(beta h_i) - eps log sigmoid(-beta h_i)  (eps = 0: DPO; > 0: cDPO).

    pc, pr: policy log-probs of the chosen / rejected answers ``[P]``; rc, rr: the reference's
    ``[P]``; returns ``[P]``.
    """
    z = beta * _h(pc, pr, rc, rr)
    return -(1.0 - label_smoothing) * logsigmoid(z) - label_smoothing * logsigmoid(-z)


def ipo_loss(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """l_i = (h_i - 1 / (2 beta))^2.  Shapes as ``dpo_loss``; ``label_smoothing`` must be 0."""
    if label_smoothing:
        raise ValueError("IPO has no label smoothing (that is cDPO, the sigmoid loss)")
    return (_h(pc, pr, rc, rr) - 1.0 / (2.0 * beta)) ** 2


def implicit_reward(policy: Tensor, ref: Tensor, beta: float) -> Tensor:
    """DPO's implicit reward r_i = beta (log pi(y_i) - log ref(y_i)); ``[P]`` -> ``[P]`` (metrics only)."""
    return beta * (policy.float() - ref.float())


def kto_kl_baseline(policy_kl: Tensor, ref_kl: Tensor) -> Tensor:
    """z_0 = max(0, mean_j (log pi(y'_j | x_j) - log ref(y'_j | x_j))), detached.

    The KL estimate of KTO from mismatched pairs (x_j, y'_j): each prompt with another row's
    answer. ``[M]``, ``[M]`` -> scalar; no gradient flows through it (as in the paper).
    """
    if policy_kl.numel() == 0:
        return policy_kl.new_zeros(())
    return (policy_kl.float() - ref_kl.float()).mean().clamp(min=0).detach()


def kto_loss(policy: Tensor, ref: Tensor, desirable: Tensor, kl: Tensor | float, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> Tensor:
    """Per-answer KTO loss with r_i = log pi(y_i | x_i) - log ref(y_i | x_i):

        desirable:   l_i = lambda_D (1 - sigmoid(beta (r_i - z_0)))
        undesirable: l_i = lambda_U (1 - sigmoid(beta (z_0 - r_i)))

    policy, ref ``[N]`` summed log-probs, desirable ``[N]`` bool, kl: z_0 (``kto_kl_baseline``),
    returns ``[N]``.
    """
    r = policy.float() - ref.float()
    good = desirable_weight * (1.0 - torch.sigmoid(beta * (r - kl)))
    bad = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - r)))
    return torch.where(desirable, good, bad)


PREFERENCE_LOSSES: dict[str, Callable[..., Tensor]] = {"sigmoid": dpo_loss, "ipo": ipo_loss}
"""``--actor.loss_type`` of ``treadle-train dpo`` -> pairwise loss."""
