"""The cuda_ipc transport: engines on the trainer's GPUs copy the weights out of its memory.

Every rank walks the buckets (ZeRO-3 gathers them); rank 0 packs each into its place in one GPU
buffer holding every bucket back to back (kept for the next sync: ``release`` frees it, as a
trainer about to offload its states while colocated engines generate must), waits for its
copies, and sends an ``IpcWeights`` with one CUDA IPC handle per bucket
(``treadle.common.ipc.encode_buckets``). The engines map the buffer, copy their tensors out and
unmap it before they answer; rank 0 does not touch the buffer until then.

``every_rank`` (engines on every trainer GPU: ``--train.colocate_all`` over several GPUs or
nodes): each rank packs a copy on its own GPU, the ranks' handles are gathered to rank 0
(``Rank.all_gather_bytes``, msgpack) and sent in one update, and each engine worker maps the
copy on its GPU (``ipc.handles_on``), as OpenRLHF's per-GPU IPC handles. No weight bytes cross
between GPUs or hosts; each rank keeps its buffer until rank 0's daemon answered (``settle``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from treadle.common.config import ConfigError
from treadle.common.ipc import encode_buckets, loads
from treadle.common.records import IpcWeights
from treadle.common.weights import bucket_ranges
from treadle.trainer.weights.gather import bucket_bytes, pack, walk
from treadle.trainer.weights.outcome import Rank, Sent, WeightSyncFailed
from treadle.trainer.weights.plan import Item


def merge_copies(per_rank: Sequence[Sequence[bytes]]) -> list[bytes]:
    """One handle set per GPU from every rank's set (rank order; a GPU shared by two ranks keeps
    the first rank's); ``WeightSyncFailed`` naming the ranks that shared none (their packing
    failed: their logs say why). Pure."""
    missing = [i for i, handles in enumerate(per_rank) if not handles]
    if missing:
        raise WeightSyncFailed(f"cuda_ipc: rank(s) {missing} shared no copy of the weights (see their logs)")
    merged, seen = [], set()
    for handles in per_rank:
        gpu = loads(handles[0]).device_uuid
        if gpu not in seen:
            seen.add(gpu)
            merged.extend(handles)
    return merged


class CudaIpc:
    """Sends ``IpcWeights`` from kept GPU buffers: rank 0's, or every rank's (``every_rank``)."""

    def __init__(self, rank: Rank, *, every_rank: bool = False) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("--transport cuda_ipc needs CUDA: the trainer's rank 0 shares GPU memory with "
                              "engines on its GPU (use collective or inline without a GPU)")
        self.rank = rank
        self.every_rank = every_rank
        self.buffer: torch.Tensor | None = None

    def send(self, header: dict[str, Any], items: Sequence[Item], sizes: list[int]) -> Sent:
        r = self.rank
        packs = r.main or self.every_rank
        spans, offset = [], 0  # (offset, bytes) of each bucket in the buffer
        for lo, hi in bucket_ranges(sizes, len(items)):
            spans.append((offset, bucket_bytes(items[lo:hi])))
            offset += spans[-1][1]
        start, err = time.perf_counter(), None
        if r.walks or packs:
            buffer = self._buffer(offset) if packs else None
            for (lo, hi), (at, _) in zip(walk(items, sizes, zero3=r.zero3), spans, strict=True):
                if buffer is not None and err is None:
                    try:
                        pack(items[lo:hi], buffer[at:])
                    except Exception as e:  # finish the walk: the other ranks' gathers need this rank
                        err = e
            if packs:
                torch.cuda.current_stream().synchronize()  # the engines read it from other processes
        handles: list[bytes] = []
        if packs and err is None:
            try:
                handles = encode_buckets(self.buffer, spans)
            except Exception as e:
                err = e
        if self.every_rank:  # every rank, even one whose packing failed (it shares none)
            shared = [msgspec.msgpack.decode(b, type=list[bytes])
                      for b in r.all_gather_bytes(msgspec.msgpack.encode(handles))]
            if r.main and err is None:
                try:
                    handles = merge_copies(shared)
                except WeightSyncFailed as e:
                    err = e
        sent = Sent(buckets=len(sizes), gather_seconds=time.perf_counter() - start)
        if r.main and err is None:
            start = time.perf_counter()
            try:
                update = IpcWeights(**header, bucket_sizes=sizes, handles=handles)
                sent.answer = r.client.update_weights(update, mode=r.mode)
            except Exception as e:
                err = e
            sent.send_seconds = time.perf_counter() - start
        r.settle(err, header["version"])
        return sent

    def _buffer(self, need: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < need:
            self.buffer = None  # free the old one (a model's worth) before making the new one
            self.buffer = torch.empty(need, dtype=torch.uint8, device=self.rank.device)
        return self.buffer

    def release(self) -> None:
        self.buffer = None

    def close(self) -> None:
        self.buffer = None
