"""Offline knowledge distillation: the student's cross-entropy to a frozen teacher's token distributions.

``kd_loss`` is OpenRLHF's ``KDLoss`` (``openrlhf/models/loss.py``, used by ``train_kd`` /
``KDTrainer``): at every target token the teacher's full next-token distribution p_T is the soft
label of the student's log-softmax, -sum_v p_T(v) log p_S(v). That is the forward KL(p_T || p_S)
plus the teacher's entropy, a constant of the student, so both have the same gradient;
``kd_kl`` reports the KL itself (the figure that falls as the student moves toward the teacher).
The recipe mixes it with the NLL as OpenRLHF does: L = (1 - kd_coef) * NLL + kd_coef * KD.

Normalisation is token-mean over the optimizer step, as ``losses.sft``: each micro-batch divides
its sum by N, the step's target tokens over every micro-batch and rank. OpenRLHF divides by the
micro-batch's own count; the two agree when every micro-batch holds as many target tokens.
Not here: a temperature, or the generalised JSD of TRL's GKD (OpenRLHF's trainer has neither).
"""

from __future__ import annotations

import torch
from torch import Tensor


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, num_tokens: float) -> Tensor:
    """L = -(1 / N) * sum_i sum_v softmax(z_T,i)_v * log_softmax(z_S,i)_v.

    student_logits, teacher_logits ``[K, V]``: the logits predicting each of the micro-batch's K
    target tokens (same vocabulary V); ``num_tokens`` N > 0: target tokens in the whole step.
    Vocabulary entries where the student's logit is -inf (masked) add 0, as in OpenRLHF. fp32.
    Returns a scalar.
    """
    teacher = torch.softmax(teacher_logits.float(), dim=-1)
    logp = torch.log_softmax(student_logits.float(), dim=-1)
    cross = (teacher * logp).masked_fill(torch.isinf(student_logits), 0.0)
    return -cross.sum() / num_tokens


def kd_kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """``[K]`` KL(p_T || p_S)_i = sum_v p_T(v) (log p_T(v) - log p_S(v)) at each of K positions (shapes as
    ``kd_loss``; fp32; terms with p_T(v) = 0 add 0)."""
    log_t = torch.log_softmax(teacher_logits.float(), dim=-1)
    log_s = torch.log_softmax(student_logits.float(), dim=-1)
    return (log_t.exp() * (log_t - log_s)).nan_to_num(nan=0.0).sum(-1)


def mixed_kd_loss(nll: Tensor, kd: Tensor, kd_coef: float) -> Tensor:
    """L = (1 - c) * NLL + c * KD with c = ``kd_coef`` in [0, 1] (OpenRLHF's KDTrainer); scalars in, scalar out."""
    return (1.0 - kd_coef) * nll + kd_coef * kd
