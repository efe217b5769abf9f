"""The frozen reference policy of DPO / KTO (and PPO's KL term): log-probs without gradients.

With ``offload`` its weights live in CPU memory and visit the accelerator only while it
computes (on a CPU-only machine that is a no-op). It is never wrapped by DeepSpeed: a
reference that needs ZeRO-3 sharding is not supported yet. Under ring attention (``ring``)
it scores the rank's slots of each packed row and gathers the full row's log-probs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.models.actor import forward_logprobs
from treadle.trainer.ring.group import RingGroup


class Reference:
    """A frozen causal LM that scores batches."""

    def __init__(self, module: torch.nn.Module, device: torch.device, *, offload: bool = False,
                 ring: RingGroup | None = None) -> None:
        self.module = module.eval().requires_grad_(False)
        self.device = device
        self.offload = offload
        self.ring = ring
        self.module.to("cpu" if offload else device)

    @torch.no_grad()
    def logprobs(self, batch: SeqBatch, temperature: float = 1.0) -> Tensor:
        """[R, T] fp32 log-probs of ``batch``'s tokens at ``temperature`` (aligned, column 0 = 0)."""
        if self.offload:
            self.module.to(self.device)
        try:
            return forward_logprobs(self.module, batch, ring=self.ring, temperature=temperature).logprobs
        finally:
            if self.offload:
                self.module.to("cpu")
