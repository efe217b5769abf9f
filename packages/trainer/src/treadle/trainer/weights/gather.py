"""Walking a plan's buckets: gathering ZeRO-3 partitions one bucket at a time, and packing.

``walk(items, sizes, zero3=...)`` yields each bucket's item range. Under ZeRO-3 the bucket's
parameters are gathered with DeepSpeed's ``GatheredParameters`` for that step of the loop and
released before the next, so the full model is never materialised; this is a collective: every
rank walks the same buckets in the same order. ``pack`` copies a bucket's tensors, converted
to their sent dtypes, into a flat buffer in the layout of ``treadle.common.weights.bucket_layout``
(one multi-tensor copy); ``host_copy`` makes one CPU tensor (the inline transport).

Not here: what is sent (``plan``), moving the bytes (the transports).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch

from treadle.common.weights import bucket_layout, bucket_ranges, bucket_views
from treadle.trainer.weights.plan import Item


def _partitioned(items: Sequence[Item]) -> list[torch.Tensor]:
    """The ZeRO-3 parameters among ``items``' sources, each once, in order."""
    seen: dict[int, torch.Tensor] = {}
    for it in items:
        for t in it.sources:
            if hasattr(t, "ds_id"):
                seen.setdefault(id(t), t)
    return list(seen.values())


def whole(p: torch.Tensor) -> bool:
    """Whether a ZeRO-3 parameter's partition group is this rank alone: its partition is the
    whole tensor, which ``plan.dense`` reads in place (a 1-rank gather is a copy of its own)."""
    import torch.distributed as dist  # noqa: PLC0415

    return not dist.is_initialized() or dist.get_world_size(p.ds_process_group) == 1


def walk(items: Sequence[Item], sizes: Sequence[int], *, zero3: bool) -> Iterator[tuple[int, int]]:
    """Yield each bucket's ``(lo, hi)`` item range; under ZeRO-3 its parameters stay gathered
    until the loop asks for the next bucket (a collective: every rank loops alike)."""
    for lo, hi in bucket_ranges(sizes, len(items)):
        params = _partitioned(items[lo:hi]) if zero3 else []
        if not params or all(map(whole, params)):
            yield lo, hi
            continue
        import deepspeed  # noqa: PLC0415

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield lo, hi


def bucket_bytes(items: Sequence[Item]) -> int:
    """Size of the flat buffer holding ``items`` (``bucket_layout``'s total)."""
    return _layout_total(tuple(it.dtype_name for it in items), tuple(it.shape for it in items))


@functools.lru_cache(maxsize=4096)  # the same buckets at every sync
def _layout_total(dtypes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> int:
    return bucket_layout(dtypes, shapes)[1]


def pack(items: Sequence[Item], buffer: torch.Tensor) -> torch.Tensor:
    """Copy gathered ``items`` into the front of ``buffer`` (uint8) at their ``bucket_layout``
    offsets, converted to their sent dtypes; returns the bucket (a view of ``buffer``)."""
    flat = buffer[:bucket_bytes(items)]
    views = bucket_views(flat, [it.dtype_name for it in items], [it.shape for it in items])
    with torch.no_grad():
        torch._foreach_copy_(views, [it.value() for it in items])
    return flat


def host_copy(item: Item) -> torch.Tensor:
    """A gathered item as a new CPU tensor in its sent dtype (the inline transport)."""
    out = torch.empty(item.shape, dtype=item.dtype)
    with torch.no_grad():
        out.copy_(item.value())
    return out

