"""The reward-model role: one scalar score per sequence, read at the sequence's last token.

Scores are the value head's output at each sequence's last real token (``SeqBatch.last_index``),
so padded and packed batches give the same scores. The saved model loads with
``AutoModelForSequenceClassification`` (``checkpoint.export``).
"""

from __future__ import annotations

from torch import Tensor

from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.models.value_model import ValueModel


class RewardModel(ValueModel):
    """backbone + score head; ``scores(values, batch)`` picks one value per sequence."""

    @staticmethod
    def scores(values: Tensor, batch: SeqBatch) -> Tensor:
        """values ``[R, T]`` (the forward's output) -> ``[S]`` the value at each sequence's last token."""
        return values.reshape(-1)[batch.last_index]
