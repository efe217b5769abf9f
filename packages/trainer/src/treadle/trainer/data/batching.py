"""Micro-batches: padded or packed tensors from samples, and micro-batches by count or token budget.

Padded: one sequence per row, right-padded to the longest in the micro-batch, with an
attention mask. Packed: every sequence of the micro-batch concatenated into a single row
without padding, position ids restarting at 0 for each sequence and no attention mask, which
tells transformers the row is packed: it then confines attention to each sequence (a
block-diagonal causal mask with SDPA / eager on CPU, varlen kernels with flash-attention on
GPU), so a packed row computes exactly what the padded rows do. In both layouts ``seq_index``
maps each token to its sequence and ``last_index`` points at each sequence's last token.

Sequence ``k`` of a micro-batch is sequence ``k % s`` of sample ``k // s`` (s sequences per
sample): for pairs, even = chosen, odd = rejected.

Not here: which samples go to which step and rank (``order``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from treadle.trainer.data.samples import Sample, TokenSeq


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqBatch:
    """The tensors of one micro-batch (CPU until ``to(device)``)."""

    input_ids: Tensor
    """[R, T] long; R sequences padded (padded), or R = 1 (packed)."""
    position_ids: Tensor
    """[R, T] long; restarts at 0 for every sequence."""
    attention_mask: Tensor | None
    """[R, T] long, 1 on real tokens (padded); None (packed: attention follows position_ids)."""
    target_mask: Tensor
    """[R, T] bool: tokens learned by next-token losses."""
    seq_index: Tensor
    """[R, T] long: sequence number of each token, -1 on padding."""
    last_index: Tensor
    """[S] long: flat index (row * T + column) of the last token of each sequence."""
    sample_weight: Tensor
    """[N] float: 1 per sample, 0 for a filler sample that only keeps ranks in step (evaluation)."""
    num_seqs: int
    """S = N x sequences per sample."""
    sample_index: tuple[int, ...]
    """Dataset index of each of the N samples."""
    cu_seqlens: Tensor | None = None
    """[S + 1] int32 flat offsets of the sequences (packed); None (padded)."""
    max_seqlen: int = 0
    """Longest sequence (packed); 0 (padded)."""

    @property
    def packed(self) -> bool:
        return self.attention_mask is None

    def to(self, device: torch.device | str) -> SeqBatch:
        """The same batch with its tensors on ``device``."""
        def mv(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return SeqBatch(input_ids=mv(self.input_ids), position_ids=mv(self.position_ids),
                        attention_mask=mv(self.attention_mask), target_mask=mv(self.target_mask),
                        seq_index=mv(self.seq_index), last_index=mv(self.last_index),
                        sample_weight=mv(self.sample_weight), num_seqs=self.num_seqs, sample_index=self.sample_index,
                        cu_seqlens=mv(self.cu_seqlens), max_seqlen=self.max_seqlen)

    def model_inputs(self) -> dict[str, Tensor | int | None]:
        """Keyword arguments of a transformers model's forward; a packed row also names its
        sequences the way transformers' flash-attention kwargs do (``cu_seq_lens_q`` ...), which
        the varlen kernels take as they are instead of finding them from the positions (on the
        host, once per forward: a graph break inside compiled layers)."""
        inputs: dict[str, Tensor | int | None] = {"input_ids": self.input_ids, "position_ids": self.position_ids,
                                                  "attention_mask": self.attention_mask}
        if self.cu_seqlens is not None:
            inputs.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                          max_length_q=self.max_seqlen, max_length_k=self.max_seqlen)
        return inputs


def _flatten(samples: Sequence[Sample]) -> list[TokenSeq]:
    return [seq for s in samples for seq in s.seqs]


def _weights(samples: Sequence[Sample], fillers: int) -> Tensor:
    w = torch.ones(len(samples))
    if fillers:
        w[len(samples) - fillers:] = 0.0
    return w


def pad_batch(samples: Sequence[Sample], pad_id: int, *, fillers: int = 0) -> SeqBatch:
    """Right-padded rows, one per sequence; the last ``fillers`` samples get weight 0."""
    seqs = _flatten(samples)
    width = max(len(s.ids) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    target = np.zeros((len(seqs), width), dtype=bool)
    index = np.full((len(seqs), width), -1, dtype=np.int64)
    for k, s in enumerate(seqs):
        ids[k, : len(s.ids)] = s.ids
        target[k, : len(s.ids)] = s.target
        index[k, : len(s.ids)] = k
    lengths = np.array([len(s.ids) for s in seqs])
    return SeqBatch(
        input_ids=torch.from_numpy(ids), position_ids=torch.arange(width).expand(len(seqs), width).clone(),
        attention_mask=torch.from_numpy(index >= 0).long(), target_mask=torch.from_numpy(target),
        seq_index=torch.from_numpy(index), last_index=torch.from_numpy(np.arange(len(seqs)) * width + lengths - 1),
        sample_weight=_weights(samples, fillers), num_seqs=len(seqs), sample_index=tuple(s.index for s in samples))


def pack_batch(samples: Sequence[Sample], *, fillers: int = 0) -> SeqBatch:
    """One row holding every sequence back to back; positions restart per sequence."""
    seqs = _flatten(samples)
    lengths = np.array([len(s.ids) for s in seqs])
    ids = np.concatenate([s.ids for s in seqs])[None]
    target = np.concatenate([s.target for s in seqs])[None]
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    index = np.repeat(np.arange(len(seqs)), lengths)[None]
    return SeqBatch(
        input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(positions), attention_mask=None,
        target_mask=torch.from_numpy(target), seq_index=torch.from_numpy(index),
        last_index=torch.from_numpy(np.cumsum(lengths) - 1), sample_weight=_weights(samples, fillers),
        num_seqs=len(seqs), sample_index=tuple(s.index for s in samples),
        cu_seqlens=torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
        max_seqlen=int(lengths.max()))


def by_count(samples: Sequence[Sample], size: int) -> list[list[Sample]]:
    """Consecutive groups of ``size`` samples (the last may be shorter)."""
    return [list(samples[i:i + size]) for i in range(0, len(samples), size)]


def by_tokens(samples: Sequence[Sample], budget: int) -> list[list[Sample]]:
    """Consecutive groups of at most ``budget`` tokens (a longer sample gets a group of its own)."""
    groups: list[list[Sample]] = []
    used = budget + 1
    for s in samples:
        if used + s.num_tokens > budget:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += s.num_tokens
    return groups


def split_to(groups: list[list[Sample]], count: int) -> list[list[Sample]]:
    """``count`` groups from ``groups`` (fewer), by halving the group with the most tokens.

    Every rank must run the same number of micro-batches (ZeRO-3 gathers parameters
    collectively in each forward): ranks with fewer groups split theirs. Splitting never
    exceeds a token budget; order within and across groups is kept. Needs ``count`` <= samples.
    """
    groups = [g for g in groups if g]
    if count > sum(len(g) for g in groups):
        raise ValueError(f"cannot split {sum(len(g) for g in groups)} samples into {count} micro-batches")
    while len(groups) < count:
        k = max((i for i, g in enumerate(groups) if len(g) > 1), key=lambda i: sum(s.num_tokens for s in groups[i]))
        g = groups[k]
        groups[k:k + 1] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def local_batches(samples: Sequence[Sample], *, micro_batch: int, token_budget: int | None, packing: bool,
                  pad_id: int) -> list[tuple[list[Sample], SeqBatch]]:
    """(group, CPU batch) pairs of ``samples`` for one rank alone (no cross-rank equalising)."""
    groups = by_tokens(samples, token_budget) if token_budget else by_count(samples, micro_batch)
    return [(g, pack_batch(g) if packing else pad_batch(g, pad_id)) for g in groups]
