"""The frozen reference policy of DPO / KTO (and PPO's KL term): log-probs without gradients.

Two placements, chosen by the caller (``trainers.build.reference``) from ``--ds.zero_stage``:

- a replica (stages 0-2): every rank holds the whole model; with ``offload`` its weights live in
  CPU memory and visit the accelerator only while it computes (a no-op on a CPU-only machine);
- sharded (stage 3, ``sharded=True``): ``module`` is a ZeRO-3 DeepSpeed engine without optimizer
  (``strategy.deepspeed.build_frozen_engine``); each rank holds 1/W of the parameters (in CPU
  memory with ``--ref.offload``) and every forward gathers them collectively, so **every rank
  must call** ``logprobs`` **the same number of times** (the trainers keep their micro-batch
  counts equal across ranks for the same reason).

Under ring attention (``ring``) it scores the rank's slots of each packed row and gathers the
full row's log-probs.

A third placement is outside the ranks: ``RemoteReference`` asks a rollout daemon that serves the
reference (``--ref.remote_url``, on devices of its own) for the same log-probs, sequence by
sequence. Not here: building the DeepSpeed engine (``strategy``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.models.actor import forward_logprobs, target_logits
from treadle.trainer.ring.group import RingGroup


class Reference:
    """A frozen causal LM that scores batches."""

    def __init__(self, module: Any, device: torch.device, *, offload: bool = False,
                 ring: RingGroup | None = None, sharded: bool = False) -> None:
        self.module = module
        self.device = device
        self.sharded = sharded
        self.offload = offload and not sharded  # ZeRO offloads a sharded model itself
        self.ring = ring
        if not sharded:
            self.module.eval().requires_grad_(False)
            self.module.to("cpu" if self.offload else device)

    @torch.no_grad()
    def logprobs(self, batch: SeqBatch, temperature: float = 1.0, targets_only: bool = False) -> Tensor:
        """[R, T] fp32 log-probs of ``batch``'s tokens at ``temperature`` (aligned, column 0 = 0);
        ``targets_only``: at ``batch.target_mask`` tokens only, 0 elsewhere (``forward_logprobs``)."""
        if self.offload:
            self.module.to(self.device)
        try:
            return forward_logprobs(self.module, batch, ring=self.ring, temperature=temperature,
                                    targets_only=targets_only).logprobs
        finally:
            if self.offload:
                self.module.to("cpu")

    @torch.no_grad()
    def target_logits(self, batch: SeqBatch) -> Tensor:
        """``[K, V]`` logits predicting each of ``batch``'s K target tokens, in row-major order of
        ``batch.target_mask`` (knowledge distillation's teacher; no ring attention)."""
        if self.offload:
            self.module.to(self.device)
        try:
            return target_logits(self.module, batch)
        finally:
            if self.offload:
                self.module.to("cpu")

    def close(self) -> None:
        """Release a sharded reference's DeepSpeed state (its hooks and partitions)."""
        if self.sharded:
            self.module.destroy()


def sequence_positions(seq_index: Tensor) -> list[tuple[int, Tensor]]:
    """(row, its columns in order) of each sequence of a batch, by sequence number, from
    ``SeqBatch.seq_index`` (each token's sequence, -1 on padding): sequence s's token ids are
    ``input_ids[row, columns]``, padded (one sequence a row, padding on either side) or packed."""
    idx = seq_index.cpu()
    out = []
    for s in range(int(idx.max()) + 1 if idx.numel() else 0):
        rows, cols = (idx == s).nonzero(as_tuple=True)
        if len(rows):
            out.append((int(rows[0]), cols))
    return out


class RemoteReference:
    """The reference scored by a rollout daemon serving it (``--ref.remote_url``): ``logprobs``
    gives ``Reference.logprobs``'s [R, T] layout (column of a sequence's first token 0), from the
    daemon's ``prompt_logprobs`` of every sequence at the temperature, all in flight at once over
    its engines (a hf engine pads what is queued into one forward), in their own dtype: the values
    match the ranks' own reference to the float tolerance of another batching (~1e-6 in fp32), not
    bit for bit."""

    def __init__(self, client: Any) -> None:
        self.client = client  # a SyncRolloutClient (one per rank)

    def logprobs(self, batch: SeqBatch, temperature: float = 1.0, targets_only: bool = False) -> Tensor:
        ids = batch.input_ids.cpu()
        places = [(r, c) for r, c in sequence_positions(batch.seq_index) if len(c) >= 2]
        scores = self.client.prompt_logprobs_many([ids[r, c].numpy() for r, c in places], temperature)
        out = torch.zeros(ids.shape, dtype=torch.float32)
        for (r, c), lp in zip(places, scores, strict=True):
            out[r, c[1:]] = torch.as_tensor(np.array(lp, dtype=np.float32))  # a copy: the wire's array is read-only
        if targets_only:
            out = out * batch.target_mask.cpu()
        return out.to(batch.input_ids.device)

    def close(self) -> None:
        self.client.close()
