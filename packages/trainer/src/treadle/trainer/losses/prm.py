"""Process reward model (PRM) loss: binary cross-entropy on one logit per labelled reasoning step.

A PRM scores each step of a solution at the step's last token (its separator or placeholder
token): one logit z_k whose sigmoid is the probability that step k is correct (Lightman et al.
2023, "Let's Verify Step by Step"; Uesato et al. 2022). The label y_k is 1 (correct) / 0
(wrong), or a soft label in [0, 1] (Math-Shepherd's estimated correctness, Wang et al. 2024).

This is the same loss as TRL's ``PRMTrainer`` (two-class token classification, cross-entropy at
the labelled tokens) and as OpenRLHF's ``PRMLoss`` (cross-entropy over the two reward-token
logits, soft labels as targets [y, 1 - y]): a softmax over two logits (a, b) is
sigmoid(a - b), so both are this function of z = a - b. treadle's PRM has a single-logit head
(``models.reward_model.ProcessRewardModel``), the one logit being that difference.
"""

from __future__ import annotations

import torch
from torch import Tensor


def step_bce_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """l_k = -[y_k log sigmoid(z_k) + (1 - y_k) log(1 - sigmoid(z_k))] = softplus(z_k) - y_k z_k.

    logits ``[K]`` step logits z (any float dtype; computed in fp32), labels ``[K]`` y in [0, 1]
    -> ``[K]`` per-step losses (no reduction: the trainer divides the step's sum by its step count).
    """
    z = logits.float()
    return torch.nn.functional.binary_cross_entropy_with_logits(z, labels.to(z.dtype), reduction="none")


def step_accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    """a_k = 1 if (z_k > 0) == (y_k > 0.5) else 0: the predicted class (sigmoid > 1/2) is the
    label's (a soft label counts as its nearer class, 0.5 as class 0). ``[K]`` -> ``[K]`` float."""
    return ((logits > 0) == (labels > 0.5)).float()
