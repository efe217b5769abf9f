"""Which samples each rank trains on at each optimizer step, reproducibly and resumably.

Epoch ``e`` visits the samples in the order of a permutation seeded with ``seed + e``
(numpy's PCG64, the same on every platform), cut into global batches of ``batch_size``
samples; a last incomplete batch is dropped so every step has the same size. Rank ``r`` of
``W`` takes the ``r``-th contiguous ``batch_size / W`` share of each batch. A run resumed at
(epoch, step) therefore sees exactly the samples the uninterrupted run would have.

Evaluation order is fixed: rank ``r`` takes samples r, r + W, ...; ranks with one sample fewer
repeat their first one as a weight-0 filler, so every rank runs the same number of forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treadle.common.config import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOrder:
    """The sample order of training: steps per epoch and each rank's share of a step."""

    num_samples: int
    """Samples in the training set."""
    batch_size: int
    """Global batch (samples per optimizer step over all ranks)."""
    world: int
    """Data-parallel ranks."""
    seed: int
    """Base seed of the per-epoch permutations."""

    def __post_init__(self) -> None:
        if self.batch_size % self.world:
            raise ConfigError(f"--train.batch_size {self.batch_size} must be a multiple of the {self.world} ranks")
        if self.num_samples < self.batch_size:
            raise ConfigError(f"the training set has {self.num_samples} samples, fewer than --train.batch_size {self.batch_size}")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def permutation(self, epoch: int) -> np.ndarray:
        """[num_samples] the visiting order of ``epoch``."""
        return np.random.default_rng(self.seed + epoch).permutation(self.num_samples)

    def rank_share(self, epoch: int, step: int, rank: int) -> list[int]:
        """Sample indices rank ``rank`` trains on at ``step`` (0-based) of ``epoch``."""
        per_rank = self.batch_size // self.world
        start = step * self.batch_size + rank * per_rank
        return self.permutation(epoch)[start:start + per_rank].tolist()


def eval_share(num_samples: int, world: int, rank: int) -> tuple[list[int], int]:
    """(indices, fillers): rank ``rank``'s evaluation samples, padded to the same count on all ranks."""
    mine = list(range(rank, num_samples, world))
    per_rank = -(-num_samples // world)
    fillers = per_rank - len(mine)
    return mine + [mine[0] if mine else 0] * fillers, fillers
