"""Where each token of a packed row lives under ring attention: the zigzag split (pure index math).

A packed row holds sequences of lengths ``L_k``. With a ring of ``R`` ranks, sequence ``k`` is
padded at its end to ``Lp_k = ceil(L_k / 2R) * 2R`` tokens and cut into ``2R`` chunks of
``c_k = Lp_k / 2R``; ring rank ``r`` keeps chunks ``r`` and ``2R - 1 - r`` of every sequence
(zigzag: under a causal mask an early chunk is cheap and a late one dear, so every rank gets
one of each and the work is balanced). A rank's local row is, sequence after sequence, its
early chunk then its late chunk: ``T_local = sum_k 2 c_k`` slots, the same on every rank. This
is the layout ring-flash-attn's zigzag varlen kernels expect (local ``cu_seqlens`` = padded
``cu_seqlens / R``).

Padding slots sit after the real tokens of their own sequence, so causality keeps real tokens
from ever seeing them; their outputs are dropped when tokens are gathered back.

Not here: communication (``ring.group``, ``ring.torch_ring``), model inputs (``ring.shard``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class RingLayout:
    """The zigzag split of one packed row over a ring, seen from ring rank ``rank``."""

    size: int
    """R, ranks in the ring."""
    rank: int
    """r, this rank's place in the ring (0..R-1)."""
    length: int
    """T, tokens of the full (unpadded) row."""
    local_index: Tensor
    """[T_local] long: index in the full row of each local slot, -1 on padding."""
    unshard_index: Tensor
    """[T] long: for each token of the full row, its flat index in the all-gathered [R * T_local] slots."""
    seq: Tensor
    """[T_local] long: sequence number of each local slot (non-decreasing; the same on every rank)."""
    positions: Tensor
    """[R, T_local] long: position inside its padded sequence of each local slot of ring rank j (row j)."""
    front: Tensor
    """[T_local / 2] long: local slots of the early chunks (chunk r of every sequence)."""
    back: Tensor
    """[T_local / 2] long: local slots of the late chunks (chunk 2R-1-r of every sequence)."""
    cu_seqlens: Tensor
    """[S + 1] int32: cumulative local lengths 2 c_k (ring-flash-attn's varlen argument)."""
    max_seqlen: int
    """max_k 2 c_k, the longest local sequence."""

    @property
    def local_length(self) -> int:
        return int(self.seq.shape[0])


def lengths_from_positions(position_ids: Tensor) -> Tensor:
    """[S] lengths of the sequences of a packed row whose positions restart at 0 for each.

    position_ids ``[1, T]`` (or ``[T]``) long, starting with 0 -> ``[S]`` long, summing to T.
    """
    pos = position_ids.reshape(-1)
    if pos.numel() == 0 or int(pos[0]) != 0:
        raise ValueError("a packed row must start a sequence at position 0")
    starts = torch.nonzero(pos == 0).reshape(-1)
    ends = torch.cat([starts[1:], torch.tensor([pos.numel()], device=pos.device)])
    return (ends - starts).cpu()


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


def zigzag_layout(lengths: Tensor, size: int, rank: int) -> RingLayout:
    """The ``RingLayout`` of sequences of ``lengths`` ([S] long, CPU) for ring rank ``rank`` of ``size``.

    Slot i of the local row belongs to sequence k = seq[i] at offset u = i - lo_k inside its
    local block of 2 c_k slots; its position in the padded sequence is ``j c_k + u`` for the
    early chunk (u < c_k) and ``(2R-1-j) c_k + u - c_k`` for the late one, for ring rank j.
    """
    if not 0 <= rank < size:
        raise ValueError(f"ring rank {rank} outside a ring of {size}")
    lengths = lengths.to(torch.long).cpu()
    two_r = 2 * size
    chunk = (lengths + two_r - 1) // two_r  # c_k
    local_len = 2 * chunk
    lo = _exclusive_cumsum(local_len)
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), local_len)
    u = torch.arange(int(local_len.sum())) - lo[seq]
    c = chunk[seq]
    early = u < c
    ranks = torch.arange(size)[:, None]
    positions = torch.where(early, ranks * c + u, (two_r - 1 - ranks) * c + u - c)
    start = _exclusive_cumsum(lengths)
    mine = positions[rank]
    local_index = torch.where(mine < lengths[seq], start[seq] + mine, torch.full_like(mine, -1))
    return RingLayout(
        size=size, rank=rank, length=int(lengths.sum()), local_index=local_index,
        unshard_index=_unshard_index(lengths, chunk, lo, size, int(local_len.sum())), seq=seq, positions=positions,
        front=torch.nonzero(early).reshape(-1), back=torch.nonzero(~early).reshape(-1),
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(local_len, 0).to(torch.int32)]),
        max_seqlen=int(local_len.max()) if lengths.numel() else 0)


def _unshard_index(lengths: Tensor, chunk: Tensor, lo: Tensor, size: int, local_total: int) -> Tensor:
    """[T] flat slot (owner * T_local + local slot) of every real token of the row."""
    k = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    p = torch.arange(int(lengths.sum())) - _exclusive_cumsum(lengths)[k]
    c = chunk[k]
    which = p // c  # chunk number 0..2R-1
    late = which >= size
    owner = torch.where(late, 2 * size - 1 - which, which)
    u = p % c + torch.where(late, c, torch.zeros_like(c))
    return owner * local_total + lo[k] + u
