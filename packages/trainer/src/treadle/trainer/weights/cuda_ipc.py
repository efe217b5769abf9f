"""The cuda_ipc transport: engines on rank 0's GPU copy the weights out of its memory.

Every rank walks the buckets (ZeRO-3 gathers them); rank 0 packs each into its place in one GPU
buffer holding every bucket back to back (kept for the next sync: ``release`` frees it, as a
trainer about to offload its states while colocated engines generate must), waits for its
copies, and sends an ``IpcWeights`` with one CUDA IPC handle per bucket
(``treadle.common.ipc.encode_buckets``). The engines map the buffer, copy their tensors out and
unmap it before they answer; rank 0 does not touch the buffer until then.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from treadle.common.config import ConfigError
from treadle.common.ipc import encode_buckets
from treadle.common.records import IpcWeights
from treadle.common.weights import bucket_ranges
from treadle.trainer.weights.gather import bucket_bytes, pack, walk
from treadle.trainer.weights.outcome import Rank, Sent
from treadle.trainer.weights.plan import Item


class CudaIpc:
    """Sends ``IpcWeights`` from one kept GPU buffer."""

    def __init__(self, rank: Rank) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("--transport cuda_ipc needs CUDA: the trainer's rank 0 shares GPU memory with "
                              "engines on its GPU (use collective or inline without a GPU)")
        self.rank = rank
        self.buffer: torch.Tensor | None = None

    def send(self, header: dict[str, Any], items: Sequence[Item], sizes: list[int]) -> Sent:
        r = self.rank
        spans, offset = [], 0  # (offset, bytes) of each bucket in the buffer
        for lo, hi in bucket_ranges(sizes, len(items)):
            spans.append((offset, bucket_bytes(items[lo:hi])))
            offset += spans[-1][1]
        start, err = time.perf_counter(), None
        if r.walks:
            buffer = self._buffer(offset) if r.main else None
            for (lo, hi), (at, _) in zip(walk(items, sizes, zero3=r.zero3), spans, strict=True):
                if buffer is not None and err is None:
                    try:
                        pack(items[lo:hi], buffer[at:])
                    except Exception as e:  # finish the walk: the other ranks' gathers need this rank
                        err = e
            if r.main:
                torch.cuda.current_stream().synchronize()  # the engines read it from other processes
        sent = Sent(buckets=len(sizes), gather_seconds=time.perf_counter() - start)
        if r.main and err is None:
            start = time.perf_counter()
            try:
                update = IpcWeights(**header, bucket_sizes=sizes, handles=encode_buckets(self.buffer, spans))
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
