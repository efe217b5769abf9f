"""Rank 0 reads the other ranks' ZeRO-3 partitions itself, when their GPUs are on its host.

    peers = PeerReads(group)                  # every rank; group: a gloo group of all ranks
    if peers.prepare(params, main=is_main):   # collective; same answer on every rank
        where, rows = peers.rows(bucket_params)  # rank 0 only: rows[r][i] = rank r's partition of param i
    peers.close()

Why: the weight sender gathers each bucket to rank 0 before broadcasting it to the engines. An
NCCL gather runs a kernel on every rank's GPU; on a host where an engine receives on one of
those GPUs (2xH200: trainer rank 1 and the receiver share GPU 1), the two processes' kernels are
time-sliced, so gather and broadcast took turns: 15.2 ms for what takes 9.2 ms (broadcast)
and 5.2 ms (gather) apart. Here every rank shares its partition storage with rank 0 once over
CUDA IPC; rank 0 maps it into its own GPU's context and copies the partitions into a staging
buffer with a plain device copy, which its copy engine runs, then packs from there: nothing is
queued on the other GPUs, and the same pulls overlapped the broadcast (10.2 ms for both;
``docs/benchmarks.md``). With ``direct``, rank 0's packing kernel reads the other ranks'
partitions from their mapped memory straight into the packed bucket instead, one pass over the
bucket instead of two (off until measured on GPUs; the GPU bench compares the two).

``prepare`` (every rank, each sync): each rank waits for its GPU work (the partitions are final),
and the ranks tell each other (one all-reduce over ``group``) whether any partition moved since
the last prepare; when none did and that one answered True, so does this one (rank 0 would find
the same shares). Otherwise they exchange a small msgpack message each (made again only when a
partition moved): the GPU's UUID, one CUDA IPC handle per partition storage
(``treadle.rollout.engine.ipc``, made once per storage and kept, so the storage stays alive and
the handle the same) and each parameter's (storage, byte offset, bytes). Rank 0 maps storages it has not mapped yet (about 10 ms each, once) and checks
that every rank's partitions have its own sizes; any failure (a GPU rank 0 cannot reach, an
allocation that cannot be shared, partitions on the CPU) is logged and this and every later
sync gathers over the trainer's group instead. The outcome is broadcast, so every rank takes
the same path.

The caller keeps the other ranks' partitions unchanged until rank 0's copies are done (the
weight sender: those ranks wait for the outcome all-reduce, which rank 0 enters after it
waited for its GPU work).

Not here: which buckets take this path, scattering into the packed bucket (``gather``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from treadle.common.log import get_logger
from treadle.trainer.weights.gather import Kept

log = get_logger(__name__)


class _Share(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one rank tells rank 0 about its partitions."""

    uuid: str  # its GPU
    storages: list[bytes]  # one IPC handle (``ipc.dumps``) per distinct partition storage
    pieces: list[tuple[int, int, int]]  # per parameter: (storage index, byte offset, bytes)
    error: str = ""  # why this rank could not share its partitions ("": it could)


_ENCODE = msgspec.msgpack.Encoder()
_DECODE = msgspec.msgpack.Decoder(_Share)


class PeerReads:
    """Rank 0's reads of its peers' partitions (see the module docstring)."""

    def __init__(self, group: Any, direct: bool = False) -> None:
        self._group = group
        self.direct = direct  # pack from the mapped memory itself, not from a staging copy
        self._shared: dict[int, tuple[torch.UntypedStorage, bytes]] = {}  # data_ptr -> (storage, handle)
        self._mapped: dict[bytes, torch.Tensor] = {}  # rank 0: handle -> the storage mapped on its GPU
        self._where: dict[int, list[Piece]] = {}  # rank 0: id(param) -> its partition on each other rank
        self._seen: list[bytes] = []  # rank 0: the shares ``_where`` was made from
        self._kept = Kept()  # rank 0: two grids used in turn, the copies' views made once for these shares
        self._told: tuple[list, bytes] = ([], b"")  # (the partitions, this rank's message about them)
        self.active = False  # the last ``prepare``'s answer
        self.disabled = False  # rank 0 could not read them once: gathers from then on (every rank)
        self.generation = 0  # rank 0: changes whenever the rows' layout may have (views keyed by it go stale)

    def prepare(self, params: Sequence[torch.Tensor], *, main: bool) -> bool:
        """Whether rank 0 reads ``params``' partitions this sync (collective over the group,
        until rank 0 found once that it cannot: then False on every rank, without a collective)."""
        import torch.distributed as dist  # noqa: PLC0415

        if self.disabled:  # every rank learnt it from the same broadcast
            return False
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # this rank's partitions are final before anyone reads them
        key = [(id(p), p.ds_tensor.data_ptr(), p.ds_tensor.numel()) for p in params]
        moved = key != self._told[0]
        if moved:  # else the same partitions in the same memory: the same message
            try:
                share = self._share(params)
            except Exception as e:  # noqa: BLE001 - rank 0 decides, and says why
                self._shared, share = {}, _Share(uuid="", storages=[], pieces=[], error=repr(e))
            self._told = (key, _ENCODE.encode(share))
        # One small collective in the steady state: when no rank's partitions moved since a
        # prepare that answered True, rank 0 would find the same shares and answer True again.
        if not _any(moved, self._group) and self.active:
            if main:
                self._kept.start()
            return True
        shares = _all_gather_bytes(self._told[1], self._group)
        ok = torch.zeros(1, dtype=torch.int64)
        if main:
            try:
                if shares != self._seen or len(self._where) != len(params):  # else: the same partitions
                    self._where, self._seen, self.generation = {}, [], self.generation + 1
                    self._kept.clear()
                    self._where = self._locate(params, [_DECODE.decode(b) for b in shares])
                    self._seen = shares
                self._kept.start()
                ok[0] = 1
            except Exception as e:  # noqa: BLE001 - any reason: gather from now on, say why once
                self._where, self._seen, self.generation = {}, [], self.generation + 1
                self._kept.clear()
                ok[0] = -1
                on_gpu = params[0].ds_tensor.is_cuda  # on CPU this is expected: no need to warn
                (log.warning if on_gpu else log.info)(
                    "weight sync: rank 0 cannot read the other ranks' partitions over CUDA IPC; the weight "
                    "sender gathers them over the trainer's group instead", extra={"fields": {"reason": repr(e)}})
        dist.broadcast(ok, src=0, group=self._group)  # the group holds every rank
        self.active, self.disabled = ok[0] == 1, ok[0] == -1
        return self.active

    def rows(self, params: Sequence[torch.Tensor]) -> tuple[Any, list[list[torch.Tensor]]]:
        """Rank 0: ``(where, rows)``, ``rows[r][i]`` = rank r's partition of ``params[i]`` (1-d),
        and a key naming the memory the rows lie in (views of it may be kept under that key).
        Rank 0's own partitions are as they are. With ``direct``, the other ranks' are views of
        their memory as mapped here (made once per bucket), read by whatever packs the rows.
        Else they are copied on the current stream into ``staging``, one of two buffers kept
        for the next syncs (``gather.Kept``: a bucket's is written again two buckets later):
        one copy per stretch of a peer's memory that holds the bucket's partitions (DeepSpeed
        keeps them in a few flat buffers, ordered by parameter group: a bucket is one or two
        stretches, not a copy per parameter); the copies and views are made once per bucket
        and staging buffer."""
        ids = tuple(id(p) for p in params)  # parameters are kept objects
        if self.direct:
            rows = self._kept.memo(("direct", ids), lambda: _mapped_rows(params, self._where))
            return ("direct", self.generation), rows
        spans, width = self._kept.memo(("spans", ids), lambda: _spans(params, self._where))
        first = params[0].ds_tensor
        staging = self._kept.grid(len(spans), width, torch.uint8, first.device)
        copies, rows = self._kept.memo(("rows", staging.data_ptr(), ids),
                                       lambda: _rows(params, self._where, spans, staging))
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)  # same device (the peer's memory is mapped): a copy engine
        return ("staged", self.generation, staging.data_ptr()), rows

    def close(self) -> None:
        """Unmap the peers' storages and release this rank's shares."""
        self._mapped, self._where, self._shared, self._seen, self._kept = {}, {}, {}, [], Kept()
        self._told = ([], b"")

    # ------------------------------------------------------------------ internals

    def _share(self, params: Sequence[torch.Tensor]) -> _Share:
        from treadle.rollout.engine.ipc import device_uuid, share_storages  # noqa: PLC0415

        # storages no parameter uses any more are released
        self._shared, storages, pieces = share_storages([p.ds_tensor for p in params], self._shared)
        return _Share(uuid=device_uuid(params[0].ds_tensor.device), storages=storages, pieces=pieces)

    def _locate(self, params: Sequence[torch.Tensor], shares: list[_Share]) -> dict[int, list[Piece]]:
        """id(param) -> where each other rank's partition of it lies: (that rank's storage mapped
        on rank 0's GPU as uint8, byte offset, bytes)."""
        from treadle.rollout.engine.ipc import map_on  # noqa: PLC0415

        device = params[0].ds_tensor.device
        mine = shares[0]
        visible = _visible_gpus() if device.type == "cuda" else set()
        mapped: dict[bytes, torch.Tensor] = {}
        where: dict[int, list[Piece]] = {id(p): [] for p in params}
        for r, share in enumerate(shares[1:], start=1):
            if share.error:
                raise ValueError(f"rank {r} could not share its partitions: {share.error}")
            if share.uuid == mine.uuid:
                raise ValueError(f"rank {r} uses rank 0's GPU {share.uuid}")
            if device.type == "cuda" and share.uuid not in visible:
                raise ValueError(f"rank {r}'s GPU {share.uuid} is not one rank 0 sees (another host, or "
                                 "CUDA_VISIBLE_DEVICES hides it)")
            if len(share.pieces) != len(params):
                raise ValueError(f"rank {r} lists {len(share.pieces)} partitions, rank 0 {len(params)}")
            for h in share.storages:
                if h not in mapped:
                    mapped[h] = self._mapped.get(h)
                    if mapped[h] is None:
                        mapped[h] = map_on(h, device)
            for p, (i, off, nbytes), (_, _, want) in zip(params, share.pieces, mine.pieces, strict=True):
                storage = mapped[share.storages[i]]
                if nbytes != want or off + nbytes > storage.numel():
                    raise ValueError(f"rank {r}'s partition of a {tuple(p.ds_shape)} parameter is {nbytes} bytes "
                                     f"at {off} of {storage.numel()}, rank 0's {want}")
                where[id(p)].append((storage, off, nbytes))
        self._mapped = mapped  # storages no rank shares any more are unmapped
        return where


Piece = tuple[torch.Tensor, int, int]  # a peer's mapped storage (uint8), byte offset, bytes
_GAP = 1 << 20  # pieces of one storage at most this far apart are copied as one stretch
_ALIGN = 256  # stretches start at multiples of this in the staging buffer


def _spans(params: Sequence[torch.Tensor], where: dict[int, list[Piece]]) -> tuple[list[list[Piece]], int]:
    """Per other rank, the stretches of its mapped memory to copy for ``params`` (pieces of one
    storage sorted by offset, merged when at most ``_GAP`` bytes apart), and the staging row
    width those stretches need (each starting ``_ALIGN``-aligned)."""
    out, width = [], 0
    for r in range(len(where[id(params[0])])):
        stretches: list[Piece] = []
        for storage, off, nbytes in sorted((where[id(p)][r] for p in params), key=lambda x: (id(x[0]), x[1])):
            last = stretches[-1] if stretches else None
            if last is not None and last[0] is storage and off - (last[1] + last[2]) <= _GAP:
                stretches[-1] = (storage, last[1], max(last[2], off + nbytes - last[1]))
            else:
                stretches.append((storage, off, nbytes))
        out.append(stretches)
        width = max(width, sum(-(-n // _ALIGN) * _ALIGN for _, _, n in stretches))
    return out, width


def _rows(params: Sequence[torch.Tensor], where: dict[int, list[Piece]], spans: list[list[Piece]],
          staging: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[list[torch.Tensor]]]:
    """The (staging slice, mapped stretch) copies of ``spans`` and the rows they give: row 0 is
    rank 0's own partitions, row r views of ``staging[r - 1]``."""
    copies, rows = [], [[p.ds_tensor.reshape(-1) for p in params]]
    for r, stretches in enumerate(spans):
        at: dict[tuple[int, int], int] = {}  # (id(storage), stretch offset) -> its start in the staging row
        pos = 0
        for storage, off, nbytes in stretches:
            copies.append((staging[r, pos:pos + nbytes], storage[off:off + nbytes]))
            at[id(storage), off] = pos
            pos += -(-nbytes // _ALIGN) * _ALIGN
        row = []
        for p in params:
            storage, off, nbytes = where[id(p)][r]
            base = next(s for s in stretches if s[0] is storage and s[1] <= off < s[1] + s[2])
            start = at[id(storage), base[1]] + off - base[1]
            row.append(staging[r, start:start + nbytes].view(p.ds_tensor.dtype))
        rows.append(row)
    return copies, rows


def _mapped_rows(params: Sequence[torch.Tensor], where: dict[int, list[Piece]]) -> list[list[torch.Tensor]]:
    """Row 0: rank 0's own partitions; row r: views of rank r's partitions in its memory as
    mapped on rank 0's GPU."""
    rows = [[p.ds_tensor.reshape(-1) for p in params]]
    for r in range(len(where[id(params[0])])):
        row = []
        for p in params:
            storage, off, nbytes = where[id(p)][r]
            row.append(storage[off:off + nbytes].view(p.ds_tensor.dtype))
        rows.append(row)
    return rows


def _visible_gpus() -> set[str]:
    """UUIDs of the GPUs this process sees."""
    from treadle.rollout.engine.ipc import device_uuid  # noqa: PLC0415

    return {device_uuid(i) for i in range(torch.cuda.device_count())}


def _any(flag: bool, group: Any) -> bool:
    """Whether ``flag`` is set on any rank (a max all-reduce over a CPU group)."""
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t[0])


def _all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """Every rank's ``data``, in rank order (over a CPU group)."""
    import torch.distributed as dist  # noqa: PLC0415

    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t[:int(s.item())].numpy()) for t, s in zip(out, sizes, strict=True)]
