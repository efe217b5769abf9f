"""Supervised next-token loss (SFT, continued pre-training, the NLL term of DPO).

Normalisation is token-mean over the whole optimizer step: every micro-batch divides its token
sum by ``N``, the number of target tokens in the step across all micro-batches and all
data-parallel ranks, so summing the micro-batch losses gives exactly the step's token mean,
however the step is split. (Dividing by each micro-batch's own count would weight tokens of
short micro-batches more.) ``nll_loss_seq_mean`` is the seq-mean-token-mean alternative
(``--actor.loss_agg_mode``): every sequence weighs the same, whatever its length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def nll_loss(logprobs: Tensor, mask: Tensor, num_tokens: float) -> Tensor:
    """L = -(1 / N) * sum_{r,t} m_{r,t} * log pi(x_{r,t} | x_{r,<t}).

    logprobs ``[R, T]`` (aligned with the tokens, see ``ops.logprobs``), mask ``[R, T]`` bool
    (True on target tokens), ``num_tokens`` N > 0: target tokens in the whole step. Returns a
    scalar; the step's loss is the sum of these over its micro-batches and ranks.
    """
    return -(logprobs * mask).sum() / num_tokens


def nll_loss_seq_mean(logprobs: Tensor, mask: Tensor, seq_index: Tensor, num_seqs: int, num_sequences: float) -> Tensor:
    """L = -(1 / S) * sum_k (sum_{t in k} m_t log pi(x_t | x_<t)) / (sum_{t in k} m_t).

    The token mean of each sequence k, averaged over the step's S sequences (OpenRLHF's
    ``SFTLoss(token_level_loss=False)``). logprobs, mask ``[R, T]`` as ``nll_loss``; seq_index
    ``[R, T]`` long (the sequence of each token, -1 on padding; packed rows hold several);
    num_seqs: sequences in this micro-batch; ``num_sequences`` S > 0: sequences with a target
    token in the whole step. A sequence without targets adds 0. Returns a scalar.
    """
    keep = mask.bool() & (seq_index >= 0)
    idx = seq_index[keep]
    sums = logprobs.new_zeros(num_seqs).index_add(0, idx, logprobs[keep])
    counts = torch.zeros(num_seqs, dtype=logprobs.dtype, device=logprobs.device).index_add(
        0, idx, torch.ones_like(logprobs[keep]))
    return -(sums / counts.clamp(min=1)).sum() / num_sequences
