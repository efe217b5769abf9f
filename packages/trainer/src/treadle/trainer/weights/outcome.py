"""How one sync's outcome reaches every trainer rank, and what the transports share.

``share_outcome`` / ``raise_outcome``: rank 0's result as one integer, all-reduced (max) over the
trainer's ranks, so that every rank returns or raises alike and none is left waiting in a
collective that rank 0 will not enter. Over a CPU (gloo) group when the default one is NCCL: the
other ranks then wait for rank 0 on the CPU, not in a GPU kernel that spins on a GPU an engine
may be receiving on (``outcome_group``).

``Rank`` is what every transport knows of the rank it runs on; ``Sent`` is what it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from treadle.common.errors import (
    BadRequest,
    CanaryMismatch,
    EngineDead,
    EnginesQuarantined,
    InternalError,
    NoEngine,
    NoWeightGroup,
    RequestTimeout,
    TreadleError,
    WeightGroupStale,
    WeightMismatch,
)
from treadle.common.log import get_logger

log = get_logger(__name__)


class WeightSyncFailed(InternalError):
    """The sync failed on rank 0 for a reason that is not a treadle error (see rank 0's log)."""


# What a failed sync raises on the ranks that did not see the error: the first class matching
# rank 0's error, shared as its index + 1 (0: success). Most specific first.
OUTCOMES: tuple[type[TreadleError], ...] = (
    WeightGroupStale, NoWeightGroup, EnginesQuarantined, CanaryMismatch, NoEngine, WeightMismatch, BadRequest,
    EngineDead, RequestTimeout, TreadleError, WeightSyncFailed)


def outcome_code(err: BaseException | None) -> int:
    """0 for success, else 1 + the index of the first ``OUTCOMES`` class ``err`` is an instance of
    (anything else: ``WeightSyncFailed``)."""
    if err is None:
        return 0
    return 1 + next((i for i, cls in enumerate(OUTCOMES) if isinstance(err, cls)), len(OUTCOMES) - 1)


def outcome_group() -> Any:
    """A gloo group of every rank when the default group is NCCL (a collective: every rank calls
    it, in the same order); None when the default group already runs on the CPU, or one rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.new_group(backend="gloo") if "nccl" in str(dist.get_backend()) else None


def share_outcome(err: BaseException | None, group: Any = None) -> int:
    """Rank 0's outcome code on every rank: a max all-reduce of one integer over ``group`` (the
    default group if None; nothing on one rank)."""
    code = outcome_code(err)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on_gpu = "nccl" in str(dist.get_backend(group))  # NCCL reduces device tensors only
        t = torch.tensor([code], dtype=torch.int64,
                         device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        code = int(t.item())
    return code


def raise_outcome(code: int, err: BaseException | None, version: int) -> None:
    """Return on success; raise ``err`` where it happened, an error of its class elsewhere."""
    if code == 0:
        return
    if err is not None:
        log.error("weight sync of version %d failed: %s", version, err)
        raise err
    cls = OUTCOMES[code - 1]
    raise cls(f"weight sync of version {version} failed on rank 0 ({cls.__name__}); rank 0's log says why")


@dataclass(slots=True, kw_only=True)
class Rank:
    """What a transport knows of the trainer rank it runs on."""

    zero3: bool  # the parameters are ZeRO-3 partitions: every rank walks the buckets
    main: bool  # rank 0: it talks to the daemon
    client: Any  # rank 0's SyncRolloutClient (None elsewhere)
    device: torch.device  # where rank 0's send buffers live
    mode: str  # in-flight samples: "wait" (finish on the old weights) or "abort"
    group: Any = False  # the group outcomes are shared over (``outcome_group``); False: not made yet

    @property
    def walks(self) -> bool:
        """Whether this rank takes part in walking the buckets."""
        return self.main or self.zero3

    def cpu_group(self) -> Any:
        """The group outcomes are shared over (made at the first sync, where every rank is)."""
        if self.group is False:
            self.group = outcome_group()
        return self.group

    def settle(self, err: BaseException | None, version: int) -> None:
        """Every rank: return when rank 0 had no error, else raise (``raise_outcome``)."""
        raise_outcome(share_outcome(err, self.cpu_group()), err, version)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank (a collective over ``cpu_group``;
        ``[data]`` on one rank): lengths first, then the padded bytes."""
        dist = torch.distributed
        group = self.cpu_group()
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return [data]
        world = dist.get_world_size(group)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
        longest = max(1, *(int(n) for n in lengths))
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(out, mine, group=group)
        return [t[:int(n)].numpy().tobytes() for t, n in zip(out, lengths, strict=True)]


@dataclass(slots=True, kw_only=True)
class Sent:
    """What a transport did for one sync (timings are this rank's)."""

    answer: dict[str, Any] = field(default_factory=dict)  # the daemon's report (rank 0)
    buckets: int = 1
    gather_seconds: float = 0.0  # gathering and packing, waits for a free buffer excluded
    send_seconds: float = 0.0  # broadcasting (collective) or the daemon's call
