"""A stateless torch.distributed group for weight broadcast, and its bucketed send/receive.

The trainer (rank 0, the sender) and each engine worker (ranks 1..N-1) meet through a
``TCPStore`` hosted by the sender and build a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL``
(GPU) on it directly: no default process group, so neither side's own ``torch.distributed``
state (vLLM initialises one in its workers) is touched. Weights travel as buckets: consecutive
tensors packed into one flat byte buffer (``weights.bucket_layout``), one broadcast per bucket,
in the order of ``WeightUpdate.names``.

Armed receives (``Engine.arm_weights``): a member that knows the next update's header before the
sender starts it waits on the group's store for the sender's signal (``signal`` / ``wait_signal``):
one TCP message from the sender's process straight to the waiting thread, instead of the
update's two RPC hops (trainer -> daemon front end -> engine worker) before the first receive.
The store lives in the sender's process, so a sender that dies ends the wait at once.

What this module does not do: decide what to send (the trainer's weight sender), check names,
shapes or dtypes (``weights.WeightSpec``), or load anything into a model (the engines).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from treadle.common.errors import BadRequest
from treadle.rollout.engine.weights import bucket_layout, bucket_ranges, pack_bucket, unpack_bucket

if TYPE_CHECKING:
    import torch

Backend = Literal["gloo", "nccl"]
_PREFIX = "treadle-weights"
_SIGNALS = "treadle-arm"


class NoSignal(TimeoutError):
    """An armed member's wait ended without the sender's signal (timeout, group closed, or the
    sender's store gone); nothing was received."""


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
        # ``wait_signal`` and ``close`` decide under this lock whether a waiter needs waking: a
        # wait that starts after the close sees it; one that started before is woken.
        self._lock = threading.Lock()
        self._waiting = False  # a member's ``wait_signal`` is (about to be) blocked on the store
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

    def signal(self, version: int, go: bool) -> None:
        """Sender: tell the members armed for ``version`` to receive now with the header they
        armed with (``go``), or to stand down and wait for the update's header (``not go``).
        One store message for every member; a member that did not arm ignores it."""
        ranks = range(1, self.spec.world_size)
        value = f"{version} {int(go)}".encode()
        _prefixed(self._store, _SIGNALS).multi_set([f"go/{r}" for r in ranks], [value] * len(ranks))

    def wait_signal(self, version: int, timeout_s: float) -> bool:
        """Member: block until the sender signals ``version``; True to go. Raises ``NoSignal``
        after ``timeout_s``, when the group is closed meanwhile (``close`` wakes the wait), or
        when the sender's store is gone (the sender died)."""
        import torch.distributed as dist

        with self._lock:
            if self._pg is None:
                raise NoSignal(f"weight group closed before version {version} was signalled")
            store, self._waiting = self._store, True
        try:
            store, key = _prefixed(store, _SIGNALS), f"go/{self.spec.rank}"
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise dist.DistStoreError("timeout")
                    store.wait([key], datetime.timedelta(seconds=left))
                    value = store.get(key).decode()
                    store.delete_key(key)  # the next arm waits for the next signal
                except dist.DistStoreError:
                    raise NoSignal(f"no signal for weight version {version} from the sender within {timeout_s:g} s") from None
                except dist.DistError as e:
                    raise NoSignal(f"the sender's store is gone while waiting for version {version}: {e}") from None
                if self._pg is None:
                    raise NoSignal(f"weight group closed while waiting for version {version}")
                if value == "closed":
                    continue  # a wake-up meant for an earlier handle of this rank on the sender's store
                signalled, go = (int(x) for x in value.split())
                if signalled == version:
                    return bool(go)
                # an older version's signal, sent while this member was not armed: wait on
        finally:
            with self._lock:
                self._waiting = False

    def _wake_waiter(self) -> None:
        """Wake this member's ``wait_signal`` (its own store client is busy in the wait)."""
        import torch.distributed as dist

        try:
            other = dist.TCPStore(self.spec.host, self.spec.port, self.spec.world_size, False,
                                  timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
            _prefixed(other, _SIGNALS).set(f"go/{self.spec.rank}", b"closed")
        except Exception:  # noqa: BLE001 - the sender's store is gone: the wait has ended by itself
            pass

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
        side): the process group is aborted, not shut down (a graceful shutdown waits for the
        work in flight, which may wait for members that never come). A gloo broadcast blocked in
        another thread stays blocked until the group's timeout."""
        with self._lock:
            pg, self._pg = self._pg, None
            waiting = self._waiting
        if waiting:
            self._wake_waiter()
        if pg is not None:
            stop = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
            if stop is not None:
                stop()
        self._store = None


def _prefixed(store: Any, prefix: str) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore(prefix, store)


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
    flats = receive_flats(group, dtypes, shapes, bucket_sizes, device)
    for (lo, hi), flat in zip(bucket_ranges(bucket_sizes, len(names)), flats, strict=True):
        _, parts = unpack_bucket(dtypes[lo:hi], shapes[lo:hi], flat=flat)
        yield [(name, t) for name, t in zip(names[lo:hi], parts, strict=True) if name not in skip]
        del flat, parts  # the consumer's views keep the storage alive as long as it holds them


def receive_flats(group: WeightGroup, dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                  bucket_sizes: Sequence[int], device: str = "cpu") -> Iterator[torch.Tensor]:
    """Receiver side: each bucket as it arrives, a fresh flat uint8 buffer (``bucket_layout``)
    each; the next one is received when asked for."""
    import torch

    for lo, hi in bucket_ranges(bucket_sizes, len(dtypes)):
        flat = torch.empty(bucket_layout(dtypes[lo:hi], shapes[lo:hi])[1], dtype=torch.uint8, device=device)
        group.broadcast(flat, src=0)
        yield flat
