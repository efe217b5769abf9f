"""The weight-update protocol both sides share: bucket layout and the broadcast group.

A weight update moves a model's tensors from the trainer (the sender) to the rollout engines by
one of three transports, each with its own record (``records.InlineWeights``,
``CollectiveWeights``, ``IpcWeights``). The collective and CUDA IPC transports move *buckets*:
consecutive tensors packed into one flat ``uint8`` buffer, tensor ``i`` at byte
``offset_i = round_up(offset_{i-1} + nbytes_{i-1}, ALIGN)``, so that every tensor's view is
aligned for its dtype and both sides derive the same layout from the header alone
(``bucket_layout``). The sender chooses the buckets (``plan_buckets``); the header carries
their sizes (``bucket_sizes``).

``WeightGroup`` is the collective transport's group: a stateless torch.distributed group that the
sender (rank 0, hosting the ``TCPStore``) and each engine worker build directly on a store,
without a default process group, so neither side's own ``torch.distributed`` state (vLLM
initialises one in its workers) is touched; gloo on CPU, NCCL between GPUs. A per-node relay
(``WeightGroupSpec.relay_prefix``) is a member of the sender's group that also roots a group of
its node's other members, named in the same store, and passes each broadcast on to it: the
network carries one copy per node, the node's own links the rest.

Importing this module imports no torch; the functions that need it import it when called.

What this module does not do: decide what to send (the trainer's sender), check an update against
a model (the engines' ``WeightSpec``), or load anything.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from treadle.common.errors import BadRequest
from treadle.common.records import WeightGroupSpec

if TYPE_CHECKING:
    import torch

ALIGN = 64  # bytes; >= every dtype's size, and a cache line
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
_PREFIX = "treadle-weights"


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a dense tensor: prod(shape) * itemsize(dtype)."""
    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= int(d)
    return n


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


def bucket_layout(dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a bucket, and the bucket's size.

    offset_0 = 0; offset_i = round_up(offset_{i-1} + nbytes_{i-1}, ALIGN);
    total = round_up(offset_last + nbytes_last, ALIGN).
    """
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        start = _round_up(end, ALIGN)
        offsets.append(start)
        end = start + tensor_nbytes(dtype, shape)
    return offsets, _round_up(end, ALIGN)


def plan_buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[int]:
    """``bucket_sizes`` for tensors of ``nbytes``: greedy runs of consecutive tensors.

    A bucket takes tensors while its (aligned) size stays <= ``bucket_bytes``; a tensor larger
    than that gets a bucket of its own. ``bucket_bytes <= 0``: one tensor per bucket.
    """
    if bucket_bytes <= 0:
        return [1] * len(nbytes)
    sizes: list[int] = []
    count = used = 0
    for nb in nbytes:
        grown = _round_up(used, ALIGN) + nb
        if count and grown > bucket_bytes:
            sizes.append(count)
            count, grown = 0, nb
        count, used = count + 1, grown
    if count:
        sizes.append(count)
    return sizes


def bucket_ranges(bucket_sizes: Sequence[int], n: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the tensor index range of each bucket; empty sizes: one tensor each."""
    sizes = list(bucket_sizes) or [1] * n
    if sum(sizes) != n or any(s < 1 for s in sizes):
        raise BadRequest(f"bucket_sizes {sizes[:8]}... must be >= 1 each and sum to {n}")
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


def bucket_views(flat: torch.Tensor, dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Each tensor's typed, shaped view into ``flat``, a bucket (1-d uint8, ``bucket_layout``)."""
    import torch

    offsets, total = bucket_layout(dtypes, shapes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != total:
        raise BadRequest(f"bucket buffer is {flat.dtype}{list(flat.shape)}, its layout needs uint8[{total}]")
    return [flat[o:o + tensor_nbytes(d, s)].view(getattr(torch, d)).view(tuple(s))
            for d, s, o in zip(dtypes, shapes, offsets, strict=True)]


def new_bucket(dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: str = "cpu"
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(flat, views)``: an empty bucket buffer for these tensors and each one's view into it."""
    import torch

    flat = torch.empty(bucket_layout(dtypes, shapes)[1], dtype=torch.uint8, device=device)
    return flat, bucket_views(flat, dtypes, shapes)


def pack_buckets(tensors: Sequence[torch.Tensor], bucket_sizes: Sequence[int]) -> Iterator[torch.Tensor]:
    """Each bucket of ``tensors`` (in their own dtypes, on their device) packed into a new flat
    buffer, one multi-tensor copy each; the simplest sender (tests, benches, tools). The trainer's
    sender packs into kept buffers, converting dtypes on the way (``treadle.trainer.weights``)."""
    import torch

    for lo, hi in bucket_ranges(bucket_sizes, len(tensors)):
        part = list(tensors[lo:hi])
        flat, views = new_bucket([str(t.dtype).removeprefix("torch.") for t in part], [list(t.shape) for t in part],
                                 device=str(part[0].device))
        torch._foreach_copy_(views, part)
        yield flat


class WeightGroup:
    """One member's handle on a weight-broadcast group; its calls block (run them off the loop)."""

    def __init__(self, spec: WeightGroupSpec) -> None:
        """Join; blocks until every member joined (gloo) or, with NCCL, until the first broadcast."""
        import torch.distributed as dist

        self.spec = spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        # The sender hosts the store; the others connect to it. wait_for_workers=False: joining is
        # awaited by the process group's constructor, whose timeout names the knob.
        store = dist.TCPStore(spec.host, spec.port, spec.world_size, spec.rank == 0, timeout=timeout,
                              wait_for_workers=False)
        self._pg = _process_group(store, spec.prefix, spec.rank, spec.world_size, spec.backend, timeout)
        # A relay joins its node's group once the sender's group stands (that group's members wait
        # for it there): a broadcast it receives then costs the network one copy for the whole node.
        self._relay = None if not spec.relay_prefix else _process_group(
            store, spec.relay_prefix, 0, spec.relay_size, spec.backend, timeout)
        self._store = store

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place: every member's ``tensor`` becomes rank ``src``'s (same shape and dtype)."""
        if self._pg is None:
            raise BadRequest(f"weight group {self.spec.host}:{self.spec.port} is closed")
        groups = [(self._pg, src)] + ([(self._relay, 0)] if self._relay is not None else [])
        for pg, root in groups:  # a relay passes what it received on to its node's group
            if self.spec.backend == "nccl":
                import torch

                with torch.cuda.device(tensor.device):  # NCCL streams are per device and thread
                    pg.broadcast(tensor, root).wait()
            else:
                pg.broadcast(tensor, root).wait()

    def close(self) -> None:
        """Drop the group; the other members need not close with it (a daemon leaves one sender's
        group to join another's): the process group is aborted, not shut down, since a graceful
        shutdown waits for work that may wait for members that never come."""
        pgs, self._pg, self._relay, self._store = (self._pg, self._relay), None, None, None
        for pg in pgs:
            stop = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
            if pg is not None and stop is not None:
                stop()


def _process_group(store: object, prefix: str, rank: int, size: int, backend: str,
                   timeout: datetime.timedelta) -> object:
    """A gloo / NCCL process group named ``prefix`` on the sender's ``store``."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{_PREFIX}/{prefix}" if prefix else _PREFIX, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, size, opts)


def worker_spec(spec: WeightGroupSpec, worker: int) -> WeightGroupSpec:
    """The spec worker ``worker`` (its tensor / pipeline parallel rank) of an engine joins with,
    given the spec of the engine's first worker: a member's workers take consecutive ranks of its
    group; a relay's worker 0 is the relay, its others the relay group's ranks 1, 2, ..."""
    import msgspec

    if worker == 0:
        return spec
    if spec.relay_prefix:
        return msgspec.structs.replace(spec, prefix=spec.relay_prefix, rank=worker, world_size=spec.relay_size,
                                       relay_prefix="", relay_size=0)
    return spec.with_rank(spec.rank + worker)


def send_buckets(group: WeightGroup, tensors: Sequence[torch.Tensor], bucket_sizes: Sequence[int]) -> None:
    """Sender side, the simplest: broadcast each bucket of ``tensors`` (``pack_buckets``) in order."""
    for flat in pack_buckets(tensors, bucket_sizes):
        group.broadcast(flat)


def receive_buckets(group: WeightGroup, dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                    bucket_sizes: Sequence[int], device: str = "cpu") -> Iterator[tuple[int, int, list[torch.Tensor]]]:
    """Receiver side: ``(lo, hi, views)`` for each bucket as it arrives, a fresh buffer each (the
    views stay valid after the next one arrives); lazy, so a loader that consumes it loads one
    bucket while the next is on the wire."""
    for lo, hi in bucket_ranges(bucket_sizes, len(dtypes)):
        flat, views = new_bucket(dtypes[lo:hi], shapes[lo:hi], device)
        group.broadcast(flat)
        yield lo, hi, views
