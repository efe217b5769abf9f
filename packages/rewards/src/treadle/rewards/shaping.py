"""Reward shaping as pure functions: DAPO's overlong penalty, the stop-properly penalty, weights.

Inputs are 1-D arrays (numpy, lists, or CPU torch tensors: anything ``np.asarray`` takes) of
batch size B; outputs are float32 numpy arrays [B]. No config objects, no state. The trainer
applies these with exact token counts; the reward daemon can apply them to texts (``service``).

Not here: choosing the parameters (configs), reward functions themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def dapo_overlong_penalty(lengths: Any, max_len: int, buffer_len: int, factor: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), scaled by ``factor``::

        expected  = max_len - buffer_len
        penalty_i = -factor * clip((L_i - expected) / buffer_len, 0, 1)

    Responses up to ``expected`` tokens get 0; inside the last ``buffer_len`` tokens the penalty
    grows linearly to ``-factor`` at ``max_len``; longer responses stay at ``-factor``. It is
    *added* to the reward (OpenRLHF's ``--overlong_buffer_len`` / ``--overlong_penalty_factor``).

    lengths: [B] response lengths in tokens. Returns float32 [B] in [-factor, 0].
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    length = np.asarray(lengths, dtype=np.float64)
    exceed = (length - (max_len - buffer_len)) / buffer_len
    return (-factor * np.clip(exceed, 0.0, 1.0)).astype(np.float32)


def stop_properly_penalty(rewards: Any, stopped: Any, coef: float) -> np.ndarray:
    """OpenRLHF's ``--stop_properly_penalty_coef`` for samples that did not stop by themselves::

        r'_i = r_i                   if stopped_i (ended with a stop token)
        r'_i = coef * r_i            if not stopped_i and coef >= 0   (coef in [0, 1] scales)
        r'_i = coef                  if not stopped_i and coef < 0    (coef replaces the reward)

    rewards: [B] floats; stopped: [B] bools (False: truncated at the length limit).
    Returns float32 [B].
    """
    r = np.asarray(rewards, dtype=np.float64)
    ok = np.asarray(stopped, dtype=bool)
    if r.shape != ok.shape:
        raise ValueError(f"rewards {r.shape} and stopped {ok.shape} must have the same shape")
    if coef > 1:
        raise ValueError(f"coef must be <= 1 (a scale in [0, 1], or a negative replacement reward), got {coef}")
    penalised = coef * r if coef >= 0 else np.full_like(r, coef)
    return np.where(ok, r, penalised).astype(np.float32)


def weighted_sum(components: Sequence[Any], weights: Sequence[float]) -> np.ndarray:
    """Combine K reward components of B samples: ``r_i = sum_k w_k * c_k,i``.

    components: K arrays [B]; weights: K floats. Returns float32 [B] (computed in float64).
    """
    if len(components) != len(weights):
        raise ValueError(f"{len(components)} components but {len(weights)} weights")
    if not components:
        raise ValueError("weighted_sum needs at least one component")
    stacked = np.stack([np.asarray(c, dtype=np.float64) for c in components])  # [K, B]
    return (np.asarray(weights, dtype=np.float64) @ stacked).astype(np.float32)
