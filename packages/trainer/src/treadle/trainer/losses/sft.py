"""Supervised next-token loss (SFT, continued pre-training, the NLL term of DPO).

Normalisation is token-mean over the whole optimizer step: every micro-batch divides its token
sum by ``N``, the number of target tokens in the step across all micro-batches and all
data-parallel ranks, so summing the micro-batch losses gives exactly the step's token mean,
however the step is split. (Dividing by each micro-batch's own count would weight tokens of
short micro-batches more.)
"""

from __future__ import annotations

from torch import Tensor


def nll_loss(logprobs: Tensor, mask: Tensor, num_tokens: float) -> Tensor:
    """L = -(1 / N) * sum_{r,t} m_{r,t} * log pi(x_{r,t} | x_{r,<t}).

    logprobs ``[R, T]`` (aligned with the tokens, see ``ops.logprobs``), mask ``[R, T]`` bool
    (True on target tokens), ``num_tokens`` N > 0: target tokens in the whole step. Returns a
    scalar; the step's loss is the sum of these over its micro-batches and ranks.
    """
    return -(logprobs * mask).sum() / num_tokens
