"""Episode-level reward shaping on tensors, and DAPO's dynamic filtering of prompt groups.

Scalar rewards ``[B]`` in, ``[B]`` out (same device); groups are the ``n`` consecutive samples
of one prompt. DAPO's overlong penalty and the stop-properly penalty live in
``treadle.rewards.shaping`` (numpy, shared with the reward daemon); here they are wrapped for
tensors, not re-implemented, so the trainer and the daemon cannot disagree.

Not here: group baselines (``advantages``), per-token rewards, choosing the parameters (config).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from treadle.rewards.shaping import dapo_overlong_penalty, stop_properly_penalty
from treadle.trainer.rl._masked import as_float


def clip_rewards(r: Tensor, low: float, high: float) -> Tensor:
    """r'_i = clip(r_i, low, high); ``[B] -> [B]`` (OpenRLHF's ``--reward_clip_range``)."""
    if not low < high:
        raise ValueError(f"clip_rewards needs low < high, got {low} {high}")
    return as_float(r).clamp(low, high)


def normalize(r: Tensor, mean: float | Tensor, std: float | Tensor, eps: float = 1e-8) -> Tensor:
    """r'_i = (r_i - mean) / (std + eps) with given (e.g. running) statistics; ``[B] -> [B]``."""
    return (as_float(r) - mean) / (std + eps)


def dynamic_filter(scores: Tensor, group_size: int, low: float, high: float) -> Tensor:
    """keep_g = low < mean_{i in group g} score_i < high  (strict); ``[B] -> [G]`` bool.

    DAPO's dynamic sampling (Yu et al. 2025, eq. 11): a group whose samples all succeed or all
    fail has zero group-relative advantage and only dilutes the batch.
    """
    b = scores.shape[0]
    if group_size < 1 or b % group_size:
        raise ValueError(f"batch size {b} is not a multiple of group_size {group_size}")
    mean = as_float(scores).view(b // group_size, group_size).mean(dim=1)
    return (mean > low) & (mean < high)


def _to_tensor(x: np.ndarray, like: Tensor) -> Tensor:
    return torch.from_numpy(x).to(like.device)


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: float, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward (Yu et al. 2025, eq. 13)::

        p_i = -factor * clip((L_i - (max_len - buffer_len)) / buffer_len, 0, 1)

    lengths ``[B]`` response lengths in tokens -> float32 ``[B]`` in [-factor, 0] on the same
    device. Wraps ``treadle.rewards.shaping.dapo_overlong_penalty``.
    """
    return _to_tensor(dapo_overlong_penalty(lengths.detach().cpu().double().numpy(), max_len, buffer_len, factor), lengths)


def stop_properly(rewards: Tensor, stopped: Tensor, coef: float) -> Tensor:
    """OpenRLHF's stop-properly penalty for truncated samples::

        r'_i = r_i if stopped_i;  coef * r_i if coef >= 0;  coef if coef < 0

    rewards ``[B]``, stopped ``[B]`` bool -> float32 ``[B]`` on the same device. Wraps
    ``treadle.rewards.shaping.stop_properly_penalty``.
    """
    out = stop_properly_penalty(rewards.detach().cpu().double().numpy(), stopped.detach().cpu().numpy(), coef)
    return _to_tensor(out, rewards)
