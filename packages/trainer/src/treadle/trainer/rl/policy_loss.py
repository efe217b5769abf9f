"""Per-token policy and value losses of the PPO family, and how a step reduces them.

The losses return per-token values ``[B, L]`` (0 on padding), never a mean: a step's loss is
``sum over micro-batches (and ranks) of Aggregation.total / sum of Aggregation.units``, which
is the same number and the same gradient however the step is split (STYLE habit 3). The
trainer sums ``units`` over the step first and divides each micro-batch's ``total`` by it.

Layout: ``[B, L]`` right-padded action arrays, ``mask`` bool with a True prefix per row. Padded
slots never contribute, not even a NaN: log-ratios, advantages and weights are zeroed there
before any arithmetic.

Not here: log-probs from logits (``treadle.trainer.ops.logprobs``), entropy (the trainer
aggregates ``ops.logprobs.token_entropy`` with the same ``Aggregation``), advantages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.trainer.rl._masked import as_float, check_shapes, row_mean, zero_pad

LOG_RATIO_BOUND = 20.0
"""PPO's per-token log-ratio is clamped to [-20, 20] before exp (OpenRLHF's bound): one token
with log-ratio 25 would otherwise put e^25 into the loss."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyTerms:
    """A policy loss and what the trainer logs about it (clip fractions, ratio statistics)."""

    loss: Tensor
    """``[B, L]`` per-token loss, 0 on padding; reduce with an ``Aggregation``."""
    clipped: Tensor
    """``[B, L]`` bool: action tokens where a clip was active, the dual clip included (their gradient is 0)."""
    ppo_clipped: Tensor
    """``[B, L]`` bool: action tokens where surr2 < surr1, before the dual clip (OpenRLHF's ``ppo_clip_ratio``
    is the plain token mean of this)."""
    ratio: Tensor
    """``[B, L]`` the importance ratio pi / pi_old used (GSPO: the sequence's, per token); 1 on padding."""


def _surrogate(ratio: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float,
               dual_clip: float | None, weights: Tensor | None) -> PolicyTerms:
    """The clipped surrogate shared by PPO and GSPO; every input already zeroed on padding."""
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.min(surr1, surr2)
    ppo_clipped = surr2 < surr1
    clipped = ppo_clipped
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (bound < loss)
        loss, clipped = torch.where(dual, bound, loss), clipped | dual
    if weights is not None:
        loss = loss * zero_pad(as_float(weights), mask)
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    return PolicyTerms(loss=zero_pad(loss, mask), clipped=clipped & mask, ppo_clipped=ppo_clipped & mask,
                       ratio=torch.where(mask, ratio.detach(), one))


def ppo_clip(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float,
             clip_high: float, dual_clip: float | None = None, weights: Tensor | None = None) -> PolicyTerms:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7)::

        rho_t = exp(clamp(logp_t - old_logp_t, -20, 20))
        l_t   = -min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t)
        l_t   = min(l_t, -c A_t)   if A_t < 0 and dual_clip c is set (Ye et al. 2020, dual clip)
        l_t   = w_t l_t            with importance weights w (``correction.is_correction``)

    clip_low != clip_high is DAPO's clip-higher (Yu et al. 2025). The log-ratio bound is
    OpenRLHF's (``LOG_RATIO_BOUND``); outside it the gradient is 0. logp, old_logp, advantages,
    weights, mask ``[B, L]`` -> ``PolicyTerms`` of ``[B, L]``; no reduction.
    """
    m = check_shapes(mask, logp=logp, old_logp=old_logp, advantages=advantages, weights=weights)
    log_ratio = zero_pad(as_float(logp) - as_float(old_logp), m).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return _surrogate(log_ratio.exp(), zero_pad(as_float(advantages), m), m, clip_low, clip_high, dual_clip, weights)


def gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float,
         clip_high: float, dual_clip: float | None = None, weights: Tensor | None = None) -> PolicyTerms:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7), as OpenRLHF's::

        s_i    = exp(mean_{t in mask_i} (logp_t - old_logp_t))       sequence ratio, differentiable
        l_i,t  = -min(s_i A_t, clip(s_i, 1 - clip_low, 1 + clip_high) A_t)   (dual clip as ``ppo_clip``)

    Every token of sequence i back-propagates through the mean: d s_i / d logp_t = s_i / |mask_i|.
    Reduce with ``seq-mean-token-mean`` (the config makes it the default and refuses another):
    with A_t = A_i that is GSPO's -mean_i min(s_i A_i, clip(s_i) A_i). For the IS correction
    against the rollout engine, pass the rollout's logprobs as ``old_logp`` (OpenRLHF's GSPO with
    ``--algo.advantage.is_correction_level token``). The paper's clip widths are ~1e-3 (ratios are
    length-normalised). Shapes as ``ppo_clip``.
    """
    m = check_shapes(mask, logp=logp, old_logp=old_logp, advantages=advantages, weights=weights)
    seq = row_mean(zero_pad(as_float(logp) - as_float(old_logp), m), m).exp()
    ratio = zero_pad(seq[:, None].expand(m.shape), m)
    return _surrogate(ratio, zero_pad(as_float(advantages), m), m, clip_low, clip_high, dual_clip, weights)


def gspo_token(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float,
               clip_high: float, dual_clip: float | None = None, weights: Tensor | None = None) -> PolicyTerms:
    """GSPO-token (Zheng et al. 2025, eq. 13-14)::

        s_i    = exp(mean_{t in mask_i} (logp_t - old_logp_t))         sequence ratio
        s_i,t  = sg[s_i] * exp(logp_t - sg[logp_t])                   value s_i, d/dlogp_t = s_i
        l_i,t  = -min(s_i,t A_t, clip(s_i,t, 1 - clip_low, 1 + clip_high) A_t)

    Each token's gradient carries its own A_t: with A_t = A_i on all tokens and the
    ``seq-mean-token-mean`` aggregation this is exactly ``gspo`` (same value and gradient); with
    per-token advantages (a KL penalty in the reward, process rewards) it differs. Any
    aggregation. ``dual_clip`` and ``weights`` act as in ``ppo_clip``. Shapes as ``ppo_clip``.
    """
    m = check_shapes(mask, logp=logp, old_logp=old_logp, advantages=advantages, weights=weights)
    lp = zero_pad(as_float(logp), m)
    seq = row_mean(lp - as_float(old_logp), m).exp()
    ratio = seq.detach()[:, None] * (lp - lp.detach()).exp()
    return _surrogate(ratio, zero_pad(as_float(advantages), m), m, clip_low, clip_high, dual_clip, weights)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip: float | None) -> Tensor:
    """PPO's clipped value loss per token (as in OpenAI baselines / OpenRLHF)::

        V^clip_t = clip(V_t, V^old_t - c, V^old_t + c)
        l_t      = 0.5 max((V_t - R_t)^2, (V^clip_t - R_t)^2)      (clip None: 0.5 (V_t - R_t)^2)

    values, old_values, returns, mask ``[B, L]`` -> ``[B, L]``, 0 on padding; no reduction.
    """
    m = check_shapes(mask, values=values, old_values=old_values, returns=returns)
    v, r = zero_pad(as_float(values), m), zero_pad(as_float(returns), m)
    loss = (v - r).square()
    if clip is not None:
        old = zero_pad(as_float(old_values), m)
        loss = torch.max(loss, (old + (v - old).clamp(-clip, clip) - r).square())
    return zero_pad(0.5 * loss, m)


@dataclass(frozen=True, slots=True, kw_only=True)
class Aggregation:
    """How per-token values become a step's scalar: sum of ``total`` over the step's micro-batches
    and ranks, divided by the sum of their ``units``."""

    total: Callable[[Tensor, Tensor], Tensor]
    """``(x [B, L], mask [B, L]) -> scalar``: this micro-batch's numerator."""
    units: Callable[[Tensor], float]
    """``mask [B, L] -> float``: this micro-batch's share of the denominator."""


def _token_total(x: Tensor, mask: Tensor) -> Tensor:
    return zero_pad(x, mask.bool()).sum()


def _token_units(mask: Tensor) -> float:
    return float(mask.bool().sum())


def _seq_mean_total(x: Tensor, mask: Tensor) -> Tensor:
    return row_mean(x, mask.bool()).sum()


def _seq_units_nonempty(mask: Tensor) -> float:
    return float(mask.bool().any(dim=-1).sum())


def _seq_units_all(mask: Tensor) -> float:
    return float(mask.shape[0])


AGGREGATIONS: dict[str, Aggregation] = {
    # sum_{i,t} m x / sum m: every token weighs the same (DAPO's token-level loss, Yu et al. 2025).
    "token-mean": Aggregation(total=_token_total, units=_token_units),
    # sum_i mean_t x / rows with tokens: every sequence weighs the same (GRPO, GSPO).
    "seq-mean-token-mean": Aggregation(total=_seq_mean_total, units=_seq_units_nonempty),
    # sum_i sum_t x / rows: no division by a sequence's length (Dr. GRPO, Liu et al. 2025).
    "seq-mean-token-sum": Aggregation(total=_token_total, units=_seq_units_all),
}
"""Loss aggregation name -> ``Aggregation``."""

POLICY_LOSSES: dict[str, Callable[..., PolicyTerms]] = {"ppo": ppo_clip, "gspo": gspo, "gspo_token": gspo_token}
"""``--actor.policy_loss_type`` -> ``(logp, old_logp, advantages, mask, *, clip_low, clip_high,
dual_clip=None, weights=None) -> PolicyTerms``."""
