"""Tokenised training samples: what the batch builders and trainers consume.

A ``Sample`` holds one or more token sequences (SFT: one; preference pairs: chosen then
rejected; KTO: the answer then a mismatched answer for the KL baseline) and the row-level
values a recipe reads (pair margin, KTO label, PRM step labels). Token ids are numpy arrays: they are built once
on every rank and never travel between processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenSeq:
    """One token sequence and which of its tokens are training targets."""

    ids: np.ndarray
    """[L] int64 token ids."""
    target: np.ndarray
    """[L] bool: True where the token is learned (predicted from the tokens before it); [0] is always False."""

    def __post_init__(self) -> None:
        if self.ids.shape != self.target.shape or self.ids.ndim != 1 or len(self.ids) == 0:
            raise ValueError(f"ids {self.ids.shape} and target {self.target.shape} must be equal, 1-D, non-empty")

    @staticmethod
    def of(ids: list[int], target: list[bool]) -> TokenSeq:
        """From lists; the first token is never a target (nothing predicts it)."""
        t = np.asarray(target, dtype=bool)
        t[:1] = False
        return TokenSeq(ids=np.asarray(ids, dtype=np.int64), target=t)

    def truncated(self, max_len: int) -> TokenSeq:
        """The first ``max_len`` tokens."""
        return self if len(self.ids) <= max_len else TokenSeq(ids=self.ids[:max_len], target=self.target[:max_len])

    @property
    def num_targets(self) -> int:
        """Target tokens in this sequence."""
        return int(self.target.sum())


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One training example of any recipe."""

    seqs: tuple[TokenSeq, ...]
    """SFT: (text,); RM / DPO: (chosen, rejected); KTO: (answer, mismatched answer)."""
    index: int
    """Position in the recipe's (mixed) dataset; keys precomputed reference log-probs."""
    margin: float = 0.0
    """RM: the row's margin (0 when the data has none)."""
    desirable: bool = True
    """KTO: whether the answer is desirable."""
    step_labels: tuple[float, ...] = ()
    """PRM: the label in [0, 1] of each target token of the sequence (each step's last token), in order."""

    @property
    def num_tokens(self) -> int:
        """Tokens over all sequences (what a token budget counts)."""
        return sum(len(s.ids) for s in self.seqs)

    @property
    def num_targets(self) -> int:
        """Target tokens of the first sequence (what SFT's token mean counts)."""
        return self.seqs[0].num_targets
