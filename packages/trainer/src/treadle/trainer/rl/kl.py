"""Per-token KL estimators between the policy and the reference, and the KL coefficient controller.

With samples y ~ pi and the log-ratio d_t = log pi(y_t) - log ref(y_t), Schulman's estimators
("Approximating KL divergence", 2020) of KL(pi || ref) are k1 = d (unbiased, high variance,
can be negative), k2 = d^2 / 2 (biased, low variance) and k3 = exp(-d) + d - 1 (unbiased, low
variance, always >= 0). All take ``[B, L]`` log-probs and return ``[B, L]`` per-token values,
unreduced and unmasked: the caller masks (``advantages.token_rewards``) or aggregates
(``policy_loss.AGGREGATIONS``) them.

Not here: the reference model's forward pass; whether KL goes in the reward or the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor

from treadle.trainer.rl._masked import as_float


def _log_ratio(logp: Tensor, ref_logp: Tensor, clamp: float | None) -> Tensor:
    # A rare token the reference finds near-impossible gives |d| of tens; exp(-d) in k3 then
    # overflows and one token's penalty swamps the batch. Clamping d bounds every estimator.
    d = as_float(logp) - as_float(ref_logp)
    return d if clamp is None else d.clamp(-clamp, clamp)


def kl_k1(logp: Tensor, ref_logp: Tensor, clamp: float | None = 10.0) -> Tensor:
    """k1_t = d_t = log pi(y_t) - log ref(y_t), d clamped to [-clamp, clamp]; ``[B, L] -> [B, L]``."""
    return _log_ratio(logp, ref_logp, clamp)


def kl_k2(logp: Tensor, ref_logp: Tensor, clamp: float | None = 10.0) -> Tensor:
    """k2_t = d_t^2 / 2 (d clamped); its gradient is that of the reverse KL. ``[B, L] -> [B, L]``."""
    return 0.5 * _log_ratio(logp, ref_logp, clamp).square()


def kl_k3(logp: Tensor, ref_logp: Tensor, clamp: float | None = 10.0) -> Tensor:
    """k3_t = exp(ref - logp) - (ref - logp) - 1 = exp(-d_t) + d_t - 1 >= 0 (d clamped).

    Schulman's unbiased low-variance estimator (used by GRPO, Shao et al. 2024, eq. 4).
    ``[B, L] -> [B, L]``.
    """
    neg = -_log_ratio(logp, ref_logp, clamp)
    return neg.exp() - neg - 1.0


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
"""``--algo.kl.estimator`` -> ``(logp [B, L], ref_logp [B, L], clamp=10.0) -> [B, L]``."""
