"""Importance-sampling correction for the mismatch between the rollout engine and the trainer.

The engine (vLLM) samples from pi_rollout; the trainer recomputes old_logp under pi_old, and
the two differ (kernels, precision, async staleness), so the batch is off-policy. Per token::

    rho_t = exp(old_logp_t - rollout_logp_t)          (trainer's old policy / sampling policy)

and the policy loss is multiplied by a weight derived from rho (``policy_loss.ppo_clip``'s
``weights``). The three variants, chosen by ``--algo.advantage.is_correction_type``, differ in
what they do outside the band [low, high]: ``tis`` truncates, ``icepop`` drops tokens,
``seq-mask-tis`` drops whole sequences. Weights carry no gradient.

Layout: ``[B, L]`` right-padded, ``mask`` bool with a True prefix per row; weights are 0 and
``keep`` False on padding. Not here: applying the weights (the loss), choosing the band (config).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from treadle.trainer.rl._masked import as_float, check_shapes, row_mean, zero_pad

Correction = Callable[[Tensor, Tensor, float, float], tuple[Tensor, Tensor]]


def tis(log_rho: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Truncated IS: w_t = clamp(rho_t, low, high), keep = mask.

    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training".
    log_rho, mask ``[B, L]`` (log_rho 0 on padding) -> (weights, keep) ``[B, L]``.
    """
    return zero_pad(log_rho.exp().clamp(low, high), mask), mask


def icepop(log_rho: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """IcePop's masked IS (Ling team, "Every step evolves", 2025): w_t = rho_t if low <= rho_t <= high
    else 0; keep = mask & in band. Shapes as ``tis``.
    """
    rho = log_rho.exp()
    keep = mask & (rho >= low) & (rho <= high)
    return zero_pad(rho, keep), keep


def seq_mask_tis(log_rho: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Sequence-masked IS, OpenRLHF's ``seq-mask-tis`` (as in its ``PolicyLoss``)::

        g_i  = exp(mean_{t in mask_i} log rho_t)            geometric-mean ratio of sequence i
        keep = mask & (low <= g_i <= high)                  whole sequences dropped
        w_t  = rho_t on kept sequences, else 0              token ratios NOT truncated

    The band gates sequences; inside a kept sequence each token keeps its raw ratio (OpenRLHF and
    NeMo-RL's port, by the same author, do not clamp it). Shapes as ``tis``.
    """
    g = row_mean(log_rho, mask).exp()
    keep = mask & ((g >= low) & (g <= high))[:, None]
    return zero_pad(log_rho.exp(), keep), keep


def is_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, kind: str, low: float,
                  high: float) -> tuple[Tensor, Tensor]:
    """(weights ``[B, L]``, keep ``[B, L]`` bool) of correction ``kind`` with band [low, high].

    old_logp: the trainer's log-probs of the sampled tokens before the update; rollout_logp: the
    engine's; mask ``[B, L]``. Weights are detached (fp32 or fp64), 0 where ``keep`` is False.
    """
    if kind not in IS_CORRECTIONS:
        raise ValueError(f"unknown IS correction {kind!r}; choose from {sorted(IS_CORRECTIONS)}")
    if not 0 <= low < high:
        raise ValueError(f"IS correction band must satisfy 0 <= low < high, got {low} {high}")
    m = check_shapes(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    with torch.no_grad():
        log_rho = zero_pad(as_float(old_logp) - as_float(rollout_logp), m)
        return IS_CORRECTIONS[kind](log_rho, m, low, high)


def logprob_gap(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[float, float]:
    """(mean, max) of |old_logp_t - rollout_logp_t| over action tokens; (0, 0) without any.

    The mismatch diagnostic to log next to the correction. ``[B, L]`` inputs, python floats out.
    """
    m = check_shapes(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    gap = (as_float(old_logp) - as_float(rollout_logp)).detach().abs()[m]
    if gap.numel() == 0:
        return 0.0, 0.0
    return float(gap.mean()), float(gap.max())


IS_CORRECTIONS: dict[str, Correction] = {"tis": tis, "icepop": icepop, "seq-mask-tis": seq_mask_tis}
"""``--algo.advantage.is_correction_type`` -> ``(log_rho [B, L], mask, low, high) -> (weights, keep)``."""
