"""Importance-sampling correction for the mismatch between the rollout engine and the trainer.

The engine (vLLM) samples from pi_rollout; the trainer recomputes old_logp under pi_old, and
the two differ (kernels, precision, async staleness), so the batch is off-policy. Per token::

    rho_t = exp(old_logp_t - rollout_logp_t)          (trainer's old policy / sampling policy)

and the policy loss is multiplied by a weight derived from rho (``policy_loss.ppo_clip``'s
``weights``). OpenRLHF 0.11.2's three choices, the ``--algo.advantage.is_correction_*`` flags:

- the statistic a gate reads (``gating``, ``IS_GATES``): the ratio rho_t itself, or a divergence
  between the two policies at the sampled token, ``binary_kl`` or ``tv`` (a trust region);
- its ``level``: each token, or the sequence (the ratio's geometric mean, a divergence's mean);
- its ``mode`` (``IS_MODES``): ``mask`` drops out-of-band units (weight 0) and keeps rho_t on
  the others; ``clip`` clamps rho_t into the band (token level, ratio gate only).

The named schemes: TIS (Yao et al. 2025) = token / clip / ratio; IcePop = token / mask / ratio;
seq-mask-tis = seq / mask / ratio; FlashREINFORCE's trust region = seq / mask / binary_kl with an
upper bound only. Weights carry no gradient.

Layout: ``[B, L]`` right-padded, ``mask`` bool with a True prefix per row; weights are 0 and
``keep`` False on padding. Not here: applying the weights (the loss), choosing the band (config).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from treadle.trainer.rl._masked import as_float, check_shapes, row_mean, zero_pad

PROB_FLOOR = 1e-6
"""Probabilities enter the divergences clamped to [PROB_FLOOR, 1 - PROB_FLOOR] (their logs stay finite)."""


def _probs(logp: Tensor) -> Tensor:
    return logp.exp().clamp(PROB_FLOOR, 1.0 - PROB_FLOOR)


def ratio_gate(old_logp: Tensor, rollout_logp: Tensor) -> tuple[Tensor, bool]:
    """log rho_t = old_logp_t - rollout_logp_t; (``[B, L]`` log-statistic, True: it is a log).

    A sequence's statistic is then exp(mean_t log rho_t), the geometric mean of its ratios."""
    return old_logp - rollout_logp, True


def binary_kl_gate(old_logp: Tensor, rollout_logp: Tensor) -> tuple[Tensor, bool]:
    """KL(Bern(p_t) || Bern(q_t)) = p log(p / q) + (1 - p) log((1 - p) / (1 - q)), p = pi_rollout(y_t),
    q = pi_old(y_t), both clamped to [1e-6, 1 - 1e-6]; (``[B, L]``, False: not a log)."""
    p, q = _probs(rollout_logp), _probs(old_logp)
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log(), False


def tv_gate(old_logp: Tensor, rollout_logp: Tensor) -> tuple[Tensor, bool]:
    """|p_t - q_t|, the total variation of the two Bernoulli(sampled token) laws (p, q as
    ``binary_kl_gate``); (``[B, L]``, False)."""
    return (_probs(rollout_logp) - _probs(old_logp)).abs(), False


def mask_mode(rho: Tensor, stat: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """keep = mask & (low <= stat <= high); w_t = rho_t where kept, else 0 (IcePop, seq-mask-tis)."""
    keep = mask & (stat >= low) & (stat <= high)
    return zero_pad(rho, keep), keep


def clip_mode(rho: Tensor, stat: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """w_t = clamp(rho_t, low, high), keep = mask (TIS); ``stat`` is rho itself here."""
    return zero_pad(rho.clamp(low, high), mask), mask


def is_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, level: str = "token",
                  mode: str = "mask", gating: str = "ratio", low: float, high: float) -> tuple[Tensor, Tensor]:
    """(weights ``[B, L]``, keep ``[B, L]`` bool) of the correction (level, mode, gating), band [low, high]::

        rho_t  = exp(old_logp_t - rollout_logp_t)
        stat_t = gate(t)                                  level token
        stat_i = exp(mean_t log rho_t) | mean_t gate(t)   level seq (ratio | divergence), per token of i
        w_t    = rho_t if low <= stat <= high else 0      mode mask
        w_t    = clamp(rho_t, low, high)                  mode clip (token, ratio)

    old_logp: the trainer's log-probs of the sampled tokens before the update; rollout_logp: the
    engine's; mask ``[B, L]``. Weights are detached (fp32 or fp64), 0 where ``keep`` is False.
    """
    if level not in IS_LEVELS or mode not in IS_MODES or gating not in IS_GATES:
        raise ValueError(f"unknown IS correction level={level!r} mode={mode!r} gating={gating!r}; choose from "
                         f"{list(IS_LEVELS)}, {sorted(IS_MODES)}, {sorted(IS_GATES)}")
    if mode == "clip" and (level != "token" or gating != "ratio"):
        raise ValueError("the clip mode clamps token ratios: it needs level token and gating ratio")
    if not 0 <= low < high:
        raise ValueError(f"IS correction band must satisfy 0 <= low < high, got {low} {high}")
    m = check_shapes(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    with torch.no_grad():
        old, rollout = zero_pad(as_float(old_logp), m), zero_pad(as_float(rollout_logp), m)
        log_rho = old - rollout
        stat, is_log = IS_GATES[gating](old, rollout)
        if level == "seq":
            stat = row_mean(stat, m)[:, None].expand(m.shape)
        if is_log:
            stat = stat.exp()
        return IS_MODES[mode](log_rho.exp(), stat, m, low, high)


def logprob_gap(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[float, float]:
    """(mean, max) of |old_logp_t - rollout_logp_t| over action tokens; (0, 0) without any.

    The mismatch diagnostic to log next to the correction. ``[B, L]`` inputs, python floats out.
    """
    m = check_shapes(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    gap = (as_float(old_logp) - as_float(rollout_logp)).detach().abs()[m]
    if gap.numel() == 0:
        return 0.0, 0.0
    return float(gap.mean()), float(gap.max())


IS_LEVELS: tuple[str, ...] = ("token", "seq")
"""``--algo.advantage.is_correction_level`` other than "off": where the gate reads its statistic."""

IS_GATES: dict[str, Callable[[Tensor, Tensor], tuple[Tensor, bool]]] = {
    "ratio": ratio_gate, "binary_kl": binary_kl_gate, "tv": tv_gate,
}
"""``--algo.advantage.is_correction_gating`` -> ``(old_logp, rollout_logp) -> (statistic [B, L], is a log)``."""

IS_MODES: dict[str, Callable[[Tensor, Tensor, Tensor, float, float], tuple[Tensor, Tensor]]] = {
    "mask": mask_mode, "clip": clip_mode,
}
"""``--algo.advantage.is_correction_mode`` -> ``(rho, statistic, mask, low, high) -> (weights, keep)``."""
