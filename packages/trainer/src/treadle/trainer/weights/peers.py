"""Rank 0 reads the other ranks' ZeRO-3 partitions itself, when their GPUs are on its host.

    peers = PeerReads(group)                  # every rank; group: a gloo group of all ranks
    if peers.prepare(params, main=is_main):   # collective; same answer on every rank
        grid = peers.grid(bucket_params)      # rank 0 only: [world, n], like gather.gather_grid
    peers.close()

Why: the weight sender gathers each bucket to rank 0 before broadcasting it to the engines. An
NCCL gather runs a kernel on every rank's GPU; on a host where an engine receives on one of
those GPUs (2xH200: trainer rank 1 and the receiver share GPU 1), the two processes' kernels are
time-sliced, so gather and broadcast took turns: 15.2 ms for what takes 9.2 ms (broadcast)
and 5.2 ms (gather) apart. Here every rank shares its partition storage with rank 0 once over
CUDA IPC; rank 0 maps it into its own GPU's context and copies the partitions with a plain
device copy, which its copy engine runs: nothing is queued on the other GPUs, and the same
pulls overlapped the broadcast (10.2 ms for both; ``docs/benchmarks.md``).

``prepare`` (every rank, each sync): each rank waits for its GPU work (the partitions are final),
then the ranks exchange, over ``group``, a small msgpack message each: the GPU's UUID, one CUDA
IPC handle per partition storage (``treadle.rollout.engine.ipc``, made once per storage and
kept, so the storage stays alive and the handle the same) and each parameter's (storage, byte
offset, bytes). Rank 0 maps storages it has not mapped yet (about 10 ms each, once) and checks
that every rank's partitions have its own sizes; any failure (a GPU rank 0 cannot reach, an
allocation that cannot be shared, ...) is logged once and the sync gathers over NCCL instead.
The outcome is broadcast, so every rank takes the same path.

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

    def __init__(self, group: Any) -> None:
        self._group = group
        self._shared: dict[int, tuple[torch.UntypedStorage, bytes]] = {}  # data_ptr -> (storage, handle)
        self._mapped: dict[bytes, torch.Tensor] = {}  # rank 0: handle -> the storage mapped on its GPU
        self._where: dict[int, list[torch.Tensor]] = {}  # rank 0: id(param) -> its partition on each rank
        self._seen: list[bytes] = []  # rank 0: the shares ``_where`` was made from
        self._grids: list[torch.Tensor] = []  # rank 0: two grids, used in turn (``grid``)
        self._turn = 0
        self._memo: dict[Any, Any] = {}  # rank 0: views made once for the current shares (``memo``)
        self._warned = False
        self.active = False  # the last ``prepare``'s answer

    def prepare(self, params: Sequence[torch.Tensor], *, main: bool) -> bool:
        """Whether rank 0 reads ``params``' partitions this sync (collective over the group)."""
        import torch.distributed as dist  # noqa: PLC0415

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # this rank's partitions are final before anyone reads them
        try:
            share = self._share(params)
        except Exception as e:  # noqa: BLE001 - rank 0 decides, and says why
            self._shared, share = {}, _Share(uuid="", storages=[], pieces=[], error=repr(e))
        shares = _all_gather_bytes(_ENCODE.encode(share), self._group)
        ok = torch.zeros(1, dtype=torch.int64)
        if main:
            try:
                if shares != self._seen or len(self._where) != len(params):  # else: the same partitions
                    self._where, self._seen, self._memo = {}, [], {}
                    self._where = self._locate(params, [_DECODE.decode(b) for b in shares])
                    self._seen = shares
                self._turn = 0
                ok[0] = 1
            except Exception as e:  # noqa: BLE001 - any reason: fall back to gathers, say why once
                self._where, self._seen, self._memo = {}, [], {}
                if not self._warned:
                    log.warning("weight sync: rank 0 cannot read the other ranks' partitions over CUDA IPC; "
                                "gathering them over NCCL", extra={"fields": {"reason": repr(e)}})
                    self._warned = True
        dist.broadcast(ok, src=0, group=self._group)  # the group holds every rank
        self.active = bool(ok[0])
        return self.active

    def grid(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Rank 0: ``[world, n]``, row r = rank r's partitions of ``params``, one after another
        (``gather.gather_grid``'s layout), copied on the current stream into one of two grids
        kept for the next syncs (used in turn: a bucket's grid is rewritten two buckets later,
        after the current stream has read it). The copies' views are made once."""
        turn, self._turn = self._turn % 2, self._turn + 1
        key = ("grid", turn, tuple(id(p) for p in params))  # parameters are kept objects: their ids stay theirs
        local, copies, grid = self.memo(key, lambda: self._plan(params, turn))
        torch.cat(local, out=grid[0])
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)  # same device (the peer's memory is mapped): a copy engine
        return grid

    def memo(self, key: Any, make: Any) -> Any:
        """``make()``, once per ``key`` while the shares stay the same (views of kept buffers)."""
        if key not in self._memo:
            if len(self._memo) >= 1024:  # buffers that changed leave stale keys behind: start over
                self._memo = {}
            self._memo[key] = make()
        return self._memo[key]

    def close(self) -> None:
        """Unmap the peers' storages and release this rank's shares."""
        self._mapped, self._where, self._shared, self._seen, self._memo, self._grids = {}, {}, {}, [], {}, []

    def _plan(self, params: Sequence[torch.Tensor], turn: int) -> tuple[list, list, torch.Tensor]:
        """(rank 0's partitions, (grid slice, peer partition) copies, the grid) of one bucket."""
        first = params[0].ds_tensor
        n = sum(p.ds_tensor.numel() for p in params)
        world = len(self._where[id(params[0])])
        if len(self._grids) < 2 or self._grids[0].shape[1] < n or self._grids[0].dtype != first.dtype:
            width = max(n, self._grids[0].shape[1] if self._grids else 0)
            self._grids = [torch.empty(world, width, dtype=first.dtype, device=first.device) for _ in range(2)]
            self._memo = {}
        grid = self._grids[turn][:, :n]
        copies = []
        for r in range(1, world):
            col = 0
            for src in _runs([self._where[id(p)][r] for p in params]):
                copies.append((grid[r, col:col + src.numel()], src))
                col += src.numel()
        return [p.ds_tensor.reshape(-1) for p in params], copies, grid

    # ------------------------------------------------------------------ internals

    def _share(self, params: Sequence[torch.Tensor]) -> _Share:
        from treadle.rollout.engine.ipc import device_uuid, encode_buckets  # noqa: PLC0415

        shared, index, pieces = {}, {}, []
        for p in params:
            t = p.ds_tensor
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in shared:
                old = self._shared.get(ptr)
                if old is None or old[0].nbytes() != storage.nbytes():
                    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                    old = (storage, encode_buckets(flat, [(0, storage.nbytes())])[0])
                shared[ptr] = old
                index[ptr] = len(index)
            pieces.append((index[ptr], t.storage_offset() * t.element_size(), t.numel() * t.element_size()))
        self._shared = shared  # storages no parameter uses any more are released
        return _Share(uuid=device_uuid(params[0].ds_tensor.device), storages=[h for _, h in shared.values()],
                      pieces=pieces)

    def _locate(self, params: Sequence[torch.Tensor], shares: list[_Share]) -> dict[int, list[torch.Tensor]]:
        from treadle.rollout.engine.ipc import map_on  # noqa: PLC0415

        device = params[0].ds_tensor.device
        mine = shares[0]
        visible = _visible_gpus() if device.type == "cuda" else set()
        mapped: dict[bytes, torch.Tensor] = {}
        where: dict[int, list[torch.Tensor]] = {id(p): [p.ds_tensor.reshape(-1)] for p in params}
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
                where[id(p)].append(storage[off:off + nbytes].view(p.ds_tensor.dtype))
        self._mapped = mapped  # storages no rank shares any more are unmapped
        return where


def _visible_gpus() -> set[str]:
    """UUIDs of the GPUs this process sees."""
    from treadle.rollout.engine.ipc import device_uuid  # noqa: PLC0415

    return {device_uuid(i) for i in range(torch.cuda.device_count())}


def _runs(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` (1-d, one dtype) with neighbours that lie back to back in memory merged into one view."""
    out: list[torch.Tensor] = []
    for t in parts:
        last = out[-1] if out else None
        if (last is not None and last.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                and last.data_ptr() + last.numel() * last.element_size() == t.data_ptr()):
            out[-1] = last.as_strided((last.numel() + t.numel(),), (1,), last.storage_offset())
        else:
            out.append(t)
    return out


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
