"""The reward-model roles: one scalar score per sequence (``RewardModel``), or one per reasoning
step (``ProcessRewardModel``).

A reward model's scores are the value head's output at each sequence's last real token
(``SeqBatch.last_index``), so padded and packed batches give the same scores. The saved model
loads with ``AutoModelForSequenceClassification`` (``checkpoint.export``). A process reward model
is the same network read at each step's last token (the batch's target tokens): one logit per
step, sigmoid = P(step correct) (``losses.prm``); its export records the step marker it was
trained with in the config (``step_separator``), where PPO's ``--reward.prm_model_name_or_path``
reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.models.value_model import ValueModel


class RewardModel(ValueModel):
    """backbone + score head; ``scores(values, batch)`` picks one value per sequence."""

    @staticmethod
    def scores(values: Tensor, batch: SeqBatch) -> Tensor:
        """values ``[R, T]`` (the forward's output) -> ``[S]`` the value at each sequence's last token."""
        return values.reshape(-1)[batch.last_index]


class ProcessRewardModel(ValueModel):
    """backbone + score head; ``step_logits(values, batch)`` picks the value at each step's last token."""

    @staticmethod
    def step_logits(values: Tensor, batch: SeqBatch) -> Tensor:
        """values ``[R, T]`` -> ``[K]`` the values at the batch's target tokens (``target_mask``), row-major:
        sequence by sequence, steps in order, in the padded and the packed layout alike."""
        return values[batch.target_mask]


@contextlib.contextmanager
def on_device(module: torch.nn.Module, device: torch.device, *, offload: bool) -> Iterator[torch.nn.Module]:
    """``module`` for use on ``device`` inside the block. ``offload`` (``--reward.offload``): it lives
    in CPU memory outside the block and visits ``device`` only inside it (moving is a no-op on a
    CPU-only machine); otherwise it is left where it is (already on ``device``)."""
    if offload:
        module.to(device)
    try:
        yield module
    finally:
        if offload:
            module.to("cpu")
