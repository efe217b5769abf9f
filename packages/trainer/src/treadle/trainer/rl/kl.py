"""Per-token KL estimators between the policy and the reference, and the KL coefficient controller.

With samples y ~ pi and the log-ratio d_t = log pi(y_t) - log ref(y_t), Schulman's estimators
("Approximating KL divergence", 2020) of KL(pi || ref) are k1 = d (unbiased, high variance,
can be negative), k2 = d^2 / 2 (biased, low variance) and k3 = exp(-d) + d - 1 (unbiased, low
variance, always >= 0). All take ``[B, L]`` log-probs and return ``[B, L]`` per-token values,
unreduced and unmasked: the caller masks (``advantages.token_rewards``) or aggregates
(``policy_loss.AGGREGATIONS``) them.

Bounds, as OpenRLHF's ``compute_approx_kl``: each estimator's *value* is clamped to
[-KL_BOUND, KL_BOUND] (k3 also takes d clamped from below at -KL_BOUND first, so that exp(-d)
cannot overflow). Where a clamp is active the gradient is zero: one token the reference finds
near-impossible adds at most KL_BOUND to the reward or the loss, and pushes nothing.

Not here: the reference model's forward pass; whether KL goes in the reward or the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from treadle.trainer.rl._masked import as_float

KL_BOUND = 10.0
"""Largest |value| of a per-token KL estimate (OpenRLHF's); also k3's lower bound on d."""
KL_WEIGHT_CAP = 10.0
"""Largest importance weight pi / pi_old of ``unbiased_kl_gradient`` (OpenRLHF's ``KL_IS_WEIGHT_CLIP``)."""


def _log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return as_float(logp) - as_float(ref_logp)


def _bounded(value: Tensor, bound: float | None) -> Tensor:
    return value if bound is None else value.clamp(-bound, bound)


def kl_k1(logp: Tensor, ref_logp: Tensor, bound: float | None = KL_BOUND) -> Tensor:
    """k1_t = clamp(d_t, -bound, bound), d_t = log pi(y_t) - log ref(y_t); ``[B, L] -> [B, L]``."""
    return _bounded(_log_ratio(logp, ref_logp), bound)


def kl_k2(logp: Tensor, ref_logp: Tensor, bound: float | None = KL_BOUND) -> Tensor:
    """k2_t = min(d_t^2 / 2, bound); its gradient is that of the reverse KL. ``[B, L] -> [B, L]``."""
    return _bounded(0.5 * _log_ratio(logp, ref_logp).square(), bound)


def kl_k3(logp: Tensor, ref_logp: Tensor, bound: float | None = KL_BOUND) -> Tensor:
    """k3_t = min(exp(-d'_t) + d'_t - 1, bound) >= 0 with d'_t = max(d_t, -bound).

    Schulman's unbiased low-variance estimator (used by GRPO, Shao et al. 2024, eq. 4); below
    d = -bound its value already exceeds the cap, so bounding d first changes no value and keeps
    exp finite (and the gradient 0, not 0 * inf). ``[B, L] -> [B, L]``.
    """
    d = _log_ratio(logp, ref_logp)
    if bound is not None:
        d = d.clamp(min=-bound)
    return _bounded((-d).exp() + d - 1.0, bound)


def unbiased_kl_gradient(value: Tensor, logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None,
                         weight_cap: float = KL_WEIGHT_CAP) -> Tensor:
    """Straight-through KL loss term: forward ``value`` (any estimator), backward the reverse KL's::

        w_t   = sg[min(exp(logp_t - old_logp_t), weight_cap)]      (1 when old_logp is None)
        out_t = sg[value_t] + w_t d_t^2 / 2 - sg[w_t d_t^2 / 2]     d_t = logp_t - ref_logp_t
        d out_t / d logp_t = w_t d_t

    E_{y ~ pi_old}[w k1 grad log pi] is the gradient of KL(pi || ref) for samples drawn by the old
    policy (the inner epochs are off-policy), so k1 / k2 / k3 then share one unbiased gradient
    and differ only in the logged value. OpenRLHF's ``--algo.kl.unbiased_gradient``. d is not
    clamped here (the gradient w d stays finite: w <= weight_cap). ``[B, L]`` in and out.
    """
    d = _log_ratio(logp, ref_logp)
    if old_logp is None:
        w = torch.ones((), dtype=d.dtype, device=d.device)
    else:
        w = (as_float(logp) - as_float(old_logp)).exp().clamp(max=weight_cap).detach()
    surrogate = w * 0.5 * d.square()
    return value.detach() + surrogate - surrogate.detach()


@dataclass(frozen=True, slots=True, kw_only=True)
class KLController:
    """The KL coefficient beta: fixed (``target`` None) or adaptive (Ziegler et al. 2019, sec. 2.2).

    Adaptive update after a batch of n samples whose mean KL is ``current``::

        err  = clip(current / target - 1, -0.2, 0.2)
        beta = beta * (1 + err * n / horizon)
    """

    coef: float
    """beta: the weight of the KL penalty (>= 0)."""
    target: float | None = None
    """Target KL per sample (nats) of the adaptive controller; None: beta stays fixed."""
    horizon: int = 10000
    """Samples over which beta can move by about 20% (the proportional gain's time scale)."""

    def __post_init__(self) -> None:
        if not self.coef >= 0:
            raise ValueError(f"KLController coef must be >= 0, got {self.coef}")
        if self.target is not None and not self.target > 0:
            raise ValueError(f"KLController target must be > 0 or None, got {self.target}")
        if self.horizon < 1:
            raise ValueError(f"KLController horizon must be >= 1, got {self.horizon}")

    def updated(self, current_kl: float, n_samples: int) -> KLController:
        """The controller after observing ``current_kl`` (mean per sample) over ``n_samples``."""
        if self.target is None:
            return self
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        return replace(self, coef=self.coef * (1.0 + err * n_samples / self.horizon))


KL_ESTIMATORS: dict[str, Callable[..., Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""``--algo.kl.estimator`` -> ``(logp [B, L], ref_logp [B, L], bound=KL_BOUND) -> [B, L]``."""
