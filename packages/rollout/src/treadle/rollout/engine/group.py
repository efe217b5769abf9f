"""A stateless torch.distributed group for weight broadcast, and its bucketed send/receive.

The trainer (rank 0, the sender) and each engine worker (ranks 1..N-1) meet through a
``TCPStore`` hosted by the sender and build a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL``
(GPU) on it directly: no default process group, so neither side's own ``torch.distributed``
state (vLLM initialises one in its workers) is touched. Weights travel as buckets: consecutive
tensors packed into one flat byte buffer (``weights.bucket_layout``), one broadcast per bucket,
in the order of ``WeightUpdate.names``.

What this module does not do: decide what to send (the trainer's weight sender), check names,
shapes or dtypes (``weights.WeightSpec``), or load anything into a model (the engines).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from treadle.common.errors import BadRequest
from treadle.rollout.engine.weights import bucket_ranges, pack_bucket, unpack_bucket

if TYPE_CHECKING:
    import torch

Backend = Literal["gloo", "nccl"]
_PREFIX = "treadle-weights"


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSpec:
    """Where and how to join a weight-broadcast group (``WeightUpdate.group`` as a type)."""

    host: str  # the sender's TCPStore address
    port: int  # the sender's TCPStore port
    world_size: int  # sender + every receiving worker of every engine (1 + engines * TP * PP)
    rank: int  # this member's rank; an engine passes its first worker's, worker w takes rank + w
    backend: Backend = "gloo"  # "gloo" on CPU, "nccl" between GPUs
    timeout_s: float = 120.0  # how long joining and each broadcast may take

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise BadRequest(f"weight group world_size must be >= 2 (sender + engine), got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise BadRequest(f"weight group rank {self.rank} outside [0, {self.world_size})")
        if self.backend not in ("gloo", "nccl"):
            raise BadRequest(f"weight group backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if not 0 < self.port < 65536:
            raise BadRequest(f"weight group port {self.port} is not a TCP port")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupSpec:
        """Parse ``WeightUpdate.group``; unknown or missing keys raise ``BadRequest``."""
        known = {"host", "port", "world_size", "rank", "backend", "timeout_s"}
        if extra := set(d) - known:
            raise BadRequest(f"weight group: unknown keys {sorted(extra)} (known: {sorted(known)})")
        try:
            return cls(**d)
        except TypeError as e:
            raise BadRequest(f"weight group {d!r}: {e}") from None

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "world_size": self.world_size,
                "rank": self.rank, "backend": self.backend, "timeout_s": self.timeout_s}

    def with_rank(self, rank: int) -> GroupSpec:
        return GroupSpec(host=self.host, port=self.port, world_size=self.world_size, rank=rank,
                         backend=self.backend, timeout_s=self.timeout_s)


class WeightGroup:
    """One member's handle on a weight-broadcast group; blocking calls (run them off the loop)."""

    def __init__(self, spec: GroupSpec) -> None:
        """Join the group; blocks until every member has joined (gloo) or the timeout passes
        (nccl: until the first broadcast, which runs on the device of the tensor it is given)."""
        import torch.distributed as dist

        self.spec = spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        # The sender hosts the store; receivers connect to it. wait_for_workers=False: joining is
        # awaited by the process-group constructor below, whose timeout names the knob.
        self._store = dist.TCPStore(spec.host, spec.port, spec.world_size, spec.rank == 0,
                                    timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(_PREFIX, self._store)
        if spec.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, spec.rank, spec.world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In place: every member's ``tensor`` becomes the sender's (same shape and dtype)."""
        if self.spec.backend == "nccl":
            import torch

            with torch.cuda.device(tensor.device):  # NCCL streams are per device, and per thread
                self._pg.broadcast(tensor, src).wait()
            return
        self._pg.broadcast(tensor, src).wait()

    def close(self) -> None:
        """Drop the group; nothing is sent, and the other members need not close with it (a
        daemon leaves one sender's group to join another's while the first sender keeps its
        side): NCCL's communicator is aborted (a graceful NCCL shutdown may wait for members
        that never come), gloo's shut down."""
        pg, self._pg = self._pg, None
        if pg is not None:
            stop = getattr(pg, "abort", None) if self.spec.backend == "nccl" else None
            stop = stop or getattr(pg, "shutdown", None)
            if stop is not None:
                stop()
        self._store = None


def send_buckets(group: WeightGroup, tensors: Sequence[torch.Tensor],
                 bucket_sizes: Sequence[int]) -> None:
    """Sender side: broadcast ``tensors`` in buckets of ``bucket_sizes`` consecutive tensors.

    Tensors should already sit on the group's device (CPU for gloo, the rank's GPU for nccl).
    """
    for lo, hi in bucket_ranges(bucket_sizes, len(tensors)):
        flat = pack_bucket(tensors[lo:hi])
        group.broadcast(flat, src=0)


def receive_buckets(group: WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                    shapes: Sequence[Sequence[int]], bucket_sizes: Sequence[int],
                    device: str = "cpu", skip: frozenset[str] = frozenset(),
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: yield ``(name, tensor)`` for every tensor as its bucket arrives.

    Lazy on purpose: a loader that consumes it (vLLM's ``reload_weights``) processes layers while
    later buckets are still on the wire. Each bucket gets a fresh buffer, so yielded tensors stay
    valid after the next bucket arrives. Names in ``skip`` are received (the sender sends them)
    but not yielded.
    """
    for bucket in receive_bucket_lists(group, names, dtypes, shapes, bucket_sizes, device, skip):
        yield from bucket


def receive_bucket_lists(group: WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                         shapes: Sequence[Sequence[int]], bucket_sizes: Sequence[int],
                         device: str = "cpu", skip: frozenset[str] = frozenset(),
                         ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``receive_buckets`` a bucket at a time: one list of ``(name, tensor)`` per broadcast (for
    loaders that copy a bucket's tensors together), the next one received when asked for."""
    for lo, hi in bucket_ranges(bucket_sizes, len(names)):
        flat, parts = unpack_bucket(dtypes[lo:hi], shapes[lo:hi], device=device)
        group.broadcast(flat, src=0)
        yield [(name, t) for name, t in zip(names[lo:hi], parts, strict=True) if name not in skip]
        del flat  # the parts keep the storage alive as long as the consumer holds them
