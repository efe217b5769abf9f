"""A packed micro-batch cut for one ring rank, and per-token results gathered back whole.

``shard_batch(batch, ring)`` gives this rank's zigzag slots of a packed row (``ring.layout``)
as a local ``SeqBatch`` plus what the attention kernel needs; the model runs on it with
``shard.model_inputs()``. ``gather_tokens(local, shard)`` turns a per-token result of the local
slots (``[1, T_local, ...]``) back into the full row (``[1, T, ...]``) on every ring rank, in the
row's order, padding dropped: losses are then computed on whole sequences exactly as without a
ring (sequence sums, last-token scores, masks all keep their meaning).

Gradient of the gather: every rank of a ring computes the *same* loss from the gathered row,
so d loss / d local slots is just this rank's slice of d loss / d row; no communication
(a reduce-scatter would count the loss R times). Each rank's parameter gradient then covers
its own tokens, and DeepSpeed's all-rank reduction sums the ring's parts (``ring.group``).

Next-token quantities (log-probs, entropies) are predicted at token t for token t + 1, which
may sit on another rank: ``next_ids`` gives each local slot the id of the row's next token, the
model's local logits score it, and ``shift_to_tokens`` aligns the gathered values with the
tokens they predict (column 0 = 0), as ``ops.logprobs.token_logprobs`` does.

Not here: the attention kernel (``ring.attention``); the model roles (``models``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.ops.logprobs import chunked_entropy, picked_logprobs
from treadle.trainer.ring.blocks import Plan
from treadle.trainer.ring.blocks import plan as make_plan
from treadle.trainer.ring.group import RingGroup
from treadle.trainer.ring.layout import RingLayout, lengths_from_positions, zigzag_layout

RING_KWARG = "ring_shard"
"""Keyword the model's forward passes down to the attention function (transformers forwards
extra keyword arguments to every attention call)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RingShard:
    """This ring rank's part of one packed micro-batch."""

    batch: SeqBatch
    """Local slots: input_ids, position_ids (positions inside each sequence), target_mask
    (False on padding) and seq_index (-1 on padding) are ``[1, T_local]``; attention_mask is
    None; last_index, sample_weight, num_seqs and sample_index are the full batch's."""
    next_ids: Tensor
    """[1, T_local] long: id of the row's token after each local slot's token (0 after the last and on padding)."""
    layout: RingLayout
    """The split (CPU index tensors)."""
    ring: RingGroup
    """The ring."""
    plan: Plan
    """The pure-PyTorch kernel's per-step work on the batch's device (``blocks.plan``)."""
    cu_seqlens: Tensor
    """[S + 1] int32 local cumulative lengths on the batch's device (ring-flash-attn)."""

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of a transformers model's forward on the local slots."""
        return {**self.batch.model_inputs(), RING_KWARG: self}


def _take(values: Tensor, index: Tensor, fill: int | bool) -> Tensor:
    """[1, T_local] values[0, index], ``fill`` where index is -1."""
    safe = index.clamp(min=0)
    picked = values[0, safe]
    return torch.where(index >= 0, picked, torch.full_like(picked, fill))[None]


def shard_batch(batch: SeqBatch, ring: RingGroup) -> RingShard:
    """This rank's zigzag slots of the packed ``batch`` (one row, positions restarting at 0 per sequence)."""
    if not batch.packed or batch.input_ids.shape[0] != 1:
        raise ValueError("ring attention needs a packed batch (one row, no attention mask): set --ds.packing_samples")
    device = batch.input_ids.device
    layout = zigzag_layout(lengths_from_positions(batch.position_ids), ring.size, ring.rank)
    index = layout.local_index.to(device)
    following = torch.nn.functional.pad(batch.input_ids[:, 1:], (0, 1))
    local = SeqBatch(
        input_ids=_take(batch.input_ids, index, 0), position_ids=layout.positions[ring.rank][None].to(device),
        attention_mask=None, target_mask=_take(batch.target_mask, index, False),
        seq_index=_take(batch.seq_index, index, -1), last_index=batch.last_index, sample_weight=batch.sample_weight,
        num_seqs=batch.num_seqs, sample_index=batch.sample_index)
    return RingShard(batch=local, next_ids=_take(following, index, 0), layout=layout, ring=ring,
                     plan=make_plan(layout, device), cu_seqlens=layout.cu_seqlens.to(device))


class _GatherTokens(torch.autograd.Function):
    """All-gather of the ring's local slots into the full row; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, local: Tensor, shard: RingShard) -> Tensor:  # noqa: ANN001
        import torch.distributed as dist  # noqa: PLC0415

        parts = [torch.empty_like(local) for _ in range(shard.ring.size)]
        dist.all_gather(parts, local.contiguous(), group=shard.ring.group)
        flat = torch.cat(parts, dim=1)  # [1, R * T_local, ...]
        index = shard.layout.unshard_index.to(local.device)
        ctx.shard, ctx.shape = shard, local.shape
        return flat[:, index]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        index = ctx.shard.layout.local_index.to(grad.device)
        safe = index.clamp(min=0)
        mine = grad[:, safe]
        keep = (index >= 0).reshape(1, -1, *([1] * (grad.dim() - 2)))
        return torch.where(keep, mine, torch.zeros_like(mine)).reshape(ctx.shape), None


def gather_tokens(local: Tensor, shard: RingShard) -> Tensor:
    """[1, T_local, ...] per-slot values -> [1, T, ...] per-token values of the full row (every ring rank).

    Differentiable; assumes the ring's ranks all compute the same function of the result (see
    the module docstring).
    """
    return _GatherTokens.apply(local, shard)


def next_token_logprobs(logits: Tensor, next_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(x_{t+1} | x_<=t) = z_t[x_{t+1}] / tau - logsumexp(z_t / tau) at every slot.

    logits ``[1, T_local, V]`` (computed in fp32), next_ids ``[1, T_local]`` -> ``[1, T_local]`` fp32.
    """
    return picked_logprobs(logits, next_ids, temperature)


def next_token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """H = -sum_v p_v log p_v of p = softmax(z_t / tau), the distribution of token t + 1: ``[1, T_local]`` fp32."""
    return chunked_entropy(logits, temperature)


def shift_to_tokens(next_values: Tensor) -> Tensor:
    """[R, T] values predicted at t for t + 1 -> aligned with the token they predict (column 0 = 0)."""
    return torch.nn.functional.pad(next_values[:, :-1], (1, 0))
