"""Masked reductions and shape checks shared by the ``rl`` modules (private).

Layout: ``[B, L]`` right-padded action arrays with a bool ``mask`` whose True entries form a
prefix of each row. Padding is kept out of every result with ``torch.where`` rather than a
multiplication, so a NaN or inf left on a padded slot can never leak (0 * inf is NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor


def as_float(x: Tensor) -> Tensor:
    """fp32 for half / bf16 / integer inputs (ratios and exponentials need it); fp32/fp64 kept."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def check_shapes(mask: Tensor, **tensors: Tensor | None) -> Tensor:
    """Raise ValueError naming the tensor whose shape differs from ``mask``'s; returns mask as bool."""
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, mask has {tuple(mask.shape)}")
    return mask.to(torch.bool)


def zero_pad(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask else 0 (``[B, L]``)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """mean_t x_t over each row's mask ``[B, L] -> [B]``; 0 for a row without action tokens."""
    count = mask.sum(dim=-1).clamp(min=1)
    return zero_pad(x, mask).sum(dim=-1) / count


def last_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(index of each row's last action token ``[B]`` long (0 when empty), row non-empty ``[B]`` bool)."""
    count = mask.sum(dim=-1)
    return (count - 1).clamp(min=0), count > 0
