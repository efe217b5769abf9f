"""Pairwise reward-model losses (Bradley-Terry), with an optional per-pair margin.

Ouyang et al. 2022 (InstructGPT) eq. 1; the margin variant is Llama 2's (Touvron et al. 2023,
eq. 2). Both functions compute the same quantity, -log sigmoid(d) = log(1 + exp(-d)), and are
kept apart because users pick them by name (OpenRLHF's ``--loss sigmoid|logexp``);
``logexp`` is written with softplus so it never overflows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

RMLoss = Literal["sigmoid", "logexp"]


def _gap(chosen: Tensor, rejected: Tensor, margin: Tensor | None) -> Tensor:
    gap = chosen.float() - rejected.float()
    return gap if margin is None else gap - margin.float()


def sigmoid_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None) -> Tensor:
    """l_i = -log sigmoid(r_c,i - r_r,i - m_i).

    chosen, rejected ``[P]`` scalar rewards of the pairs, margin ``[P]`` or None (m = 0) ->
    ``[P]`` per-pair losses (no reduction).
    """
    return -torch.nn.functional.logsigmoid(_gap(chosen, rejected, margin))


def logexp_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None) -> Tensor:
    """l_i = log(1 + exp(r_r,i - r_c,i + m_i)) = softplus(-(r_c,i - r_r,i - m_i)).

    Shapes as ``sigmoid_loss``; ``[P]`` per-pair losses.
    """
    return torch.nn.functional.softplus(-_gap(chosen, rejected, margin))


def pair_accuracy(chosen: Tensor, rejected: Tensor) -> Tensor:
    """a_i = 1 if r_c,i > r_r,i else 0 (ties count as wrong); ``[P]`` -> ``[P]`` float."""
    return (chosen > rejected).float()


RM_LOSSES: dict[str, Callable[..., Tensor]] = {"sigmoid": sigmoid_loss, "logexp": logexp_loss}
"""``--actor.loss_type`` -> per-pair loss function."""
