"""The inline transport: rank 0 puts host copies of the tensors inside the update message.

For tests and tiny models: the message must fit the daemon's frame limit. Every rank walks the
buckets (ZeRO-3 gathers them); rank 0 copies each tensor to host memory and sends one
``InlineWeights``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from treadle.common.records import InlineWeights
from treadle.trainer.weights.gather import host_copy, walk
from treadle.trainer.weights.outcome import Rank, Sent
from treadle.trainer.weights.plan import Item


class Inline:
    """Sends ``InlineWeights``."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank

    def send(self, header: dict[str, Any], items: Sequence[Item], sizes: list[int]) -> Sent:
        r = self.rank
        start, tensors = time.perf_counter(), []
        if r.walks:
            for lo, hi in walk(items, sizes, zero3=r.zero3):
                if r.main:
                    tensors.extend(host_copy(it) for it in items[lo:hi])
        sent, err = Sent(buckets=len(sizes), gather_seconds=time.perf_counter() - start), None
        if r.main:
            start = time.perf_counter()
            try:
                sent.answer = r.client.update_weights(InlineWeights(**header, tensors=tensors), mode=r.mode)
            except Exception as e:
                err = e
            sent.send_seconds = time.perf_counter() - start
        r.settle(err, header["version"])
        return sent

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass
