"""Per-token log-probabilities and entropies from logits, and per-sequence sums.

Pure functions on tensors. Every ``[R, T]`` result is aligned with ``input_ids``: column ``t``
holds the quantity of token ``t`` as predicted from tokens ``< t`` (column 0, which nothing
predicts, is 0). Rows may be padded sequences (one per row) or packed rows holding several
sequences; ``seq_index`` says which sequence a token belongs to. Masking out the first token of
each packed sequence (predicted from the previous sequence) is the batch builder's job.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(x_t | x_<t) = z_{t-1}[x_t] / tau - logsumexp(z_{t-1} / tau), aligned to x_t.

    logits ``[R, T, V]`` (any float dtype; computed in fp32), input_ids ``[R, T]`` -> ``[R, T]``
    fp32 with column 0 set to 0. ``temperature`` tau scales the logits as sampling did.
    """
    z = logits[:, :-1].float()
    if temperature != 1.0:
        z = z / temperature
    picked = z.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    out = picked - torch.logsumexp(z, dim=-1)
    return torch.nn.functional.pad(out, (1, 0))


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """H_t = -sum_v p_v log p_v of the distribution that predicted token t (p = softmax(z_{t-1} / tau)).

    logits ``[R, T, V]`` -> ``[R, T]`` fp32, column 0 set to 0.
    """
    z = logits[:, :-1].float()
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0))


def sequence_sums(values: Tensor, mask: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """s_k = sum over tokens t of sequence k with mask_t of values_t.

    values ``[R, T]`` float, mask ``[R, T]`` bool, seq_index ``[R, T]`` long (sequence number of
    each token, -1 on padding) -> ``[num_seqs]``. Differentiable in ``values``.
    """
    keep = mask & (seq_index >= 0)
    out = values.new_zeros(num_seqs)
    return out.index_add(0, seq_index[keep], values[keep])
