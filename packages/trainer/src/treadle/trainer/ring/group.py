"""Process groups of sequence parallelism: rings of ``--ds.ring_attn_size`` consecutive ranks.

``W`` ranks form ``D = W / R`` data-parallel slots x rings of ``R``: ring ``g`` is ranks
``g R .. g R + R - 1`` (consecutive, so a ring stays inside a host when ``R`` divides the GPUs
per host), and the data-parallel group of ring position ``p`` is ranks ``p, p + R, p + 2R, ...``.
The ranks of one ring train on the same samples, each on its slice of every packed row.

What DeepSpeed sees: nothing changes. Its gradient reduction and ZeRO partitioning keep spanning
all ``W`` ranks, which is what sequence parallelism needs: ring peers hold *partial* gradients
of the same parameters (each from its own tokens), and their sum is the gradient of the shared
loss. Averaging over all ``W`` ranks and scaling the loss by ``W`` (``trainers.base``) gives
exactly the gradient of the non-ring run. (OpenRLHF does the same: no ``mpu``; only its data
sampler uses the data-parallel group.) What changes: which samples a rank gets
(``DataParallel.rank`` / ``.world``), and sums of per-sample metrics, which are all-reduced over
the data-parallel group so that a ring's samples count once.

AutoTP (``--ds.tensor_parallel_size``) uses the same layout for its data-parallel slots
(``tensor_parallel_slots``); the two are not combined.

Not here: the split of a row (``ring.layout``), the attention kernel (``ring.attention``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

import torch

from treadle.common.config import ConfigError
from treadle.trainer.strategy.deepspeed import DistInfo

Backend = Literal["torch", "flash"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RingGroup:
    """This rank's ring."""

    size: int
    """R, ranks per ring."""
    rank: int
    """Place in the ring, 0..R-1."""
    ranks: tuple[int, ...]
    """Global ranks of the ring, in ring order."""
    group: Any
    """The ring's ``torch.distributed`` process group."""
    backend: Backend
    """Attention kernel: "flash" (ring-flash-attn on CUDA, for bf16 / fp16 tensors; fp32 still goes
    to the PyTorch ring) or "torch" (pure PyTorch, any device and dtype)."""
    head_stride: int
    """Key/value heads per ring pass (``--ds.ring_attn_head_stride``)."""
    dp_group: Any
    """Process group of the ranks at this ring position, one per ring (the data-parallel group)."""

    @property
    def next_rank(self) -> int:
        """Global rank K/V blocks are sent to."""
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        """Global rank K/V blocks come from."""
        return self.ranks[(self.rank - 1) % self.size]


@dataclass(frozen=True, slots=True, kw_only=True)
class DataParallel:
    """This rank's data-parallel slot: which share of each batch it trains on."""

    rank: int
    """Slot number, 0..world-1 (global rank // R)."""
    world: int
    """Slots, W / R."""
    group: Any
    """Process group of the ranks at this ring position (None: the whole world, no ring)."""


def pick_backend(device: torch.device) -> Backend:
    """The kernel family: "flash" on CUDA where ring-flash-attn (and so flash-attn) imports, else "torch"."""
    if device.type == "cuda" and importlib.util.find_spec("ring_flash_attn") is not None:
        return "flash"
    return "torch"


def setup_ring(size: int, head_stride: int, dist: DistInfo) -> RingGroup | None:
    """Create every ring and data-parallel group (collective: all ranks call it, in the same
    order) and return this rank's ring; None when ``size`` is 1."""
    if size == 1:
        return None
    if dist.world % size:
        raise ConfigError(f"--ds.ring_attn_size {size} must divide the {dist.world} ranks")
    import torch.distributed as tdist  # noqa: PLC0415

    rings = [tuple(range(first, first + size)) for first in range(0, dist.world, size)]
    slots = [tuple(range(position, dist.world, size)) for position in range(size)]
    made = {ranks: tdist.new_group(list(ranks)) for ranks in rings + slots}
    mine = next(r for r in rings if dist.rank in r)
    position = mine.index(dist.rank)
    return RingGroup(size=size, rank=position, ranks=mine, group=made[mine], backend=pick_backend(dist.device),
                     head_stride=head_stride, dp_group=made[slots[position]])


def data_parallel(dist: DistInfo, ring: RingGroup | None) -> DataParallel:
    """This rank's data-parallel slot (the whole world when there is no ring)."""
    if ring is None:
        return DataParallel(rank=dist.rank, world=dist.world, group=None)
    return DataParallel(rank=dist.rank // ring.size, world=dist.world // ring.size, group=ring.dp_group)


def tensor_parallel_slots(size: int, dist: DistInfo) -> DataParallel:
    """This rank's data-parallel slot under DeepSpeed's AutoTP of ``size`` (collective).

    AutoTP lays ranks out as DeepSpeed's (data, tensor) mesh: tensor-parallel groups of ``size``
    consecutive ranks, the same layout as rings. The ranks of a group must see the same batches
    (DeepSpeed checks the first one); unlike a ring's, their gradients are averaged by DeepSpeed
    over the data-parallel group only. ``size`` 1: the whole world.
    """
    if size == 1:
        return DataParallel(rank=dist.rank, world=dist.world, group=None)
    if dist.world % size:
        raise ConfigError(f"--ds.tensor_parallel_size {size} must divide the {dist.world} ranks")
    import torch.distributed as tdist  # noqa: PLC0415

    slots = [tuple(range(position, dist.world, size)) for position in range(size)]
    made = {ranks: tdist.new_group(list(ranks)) for ranks in slots}
    return DataParallel(rank=dist.rank // size, world=dist.world // size, group=made[slots[dist.rank % size]])
