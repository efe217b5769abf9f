"""The collective transport: buckets broadcast over a gloo / NCCL group to every engine worker.

Per sync, on rank 0: announce the update (``CollectiveWeights``, joining the daemon's weight
group first when there is none) and wait for the daemon to accept it; when it refuses because
its group is not ours any more (``WeightGroupStale``: its engines changed, or another sender
joined; ``NoWeightGroup``: it restarted), rejoin once and announce again. A refusal reaches every
rank before anything is gathered. Then every rank walks the buckets (ZeRO-3 gathers them) and
rank 0 packs each into one of two buffers while the daemon's client thread broadcasts the other
(``_Broadcast``), so that gathering bucket k+1 overlaps sending bucket k, with two buckets of
memory. On a GPU the broadcasts run on a stream of their own, handed each bucket with a CUDA
event and handing its buffer back with another, so the host never waits for a broadcast.
Finally rank 0 waits for the daemon's answer (the engines loaded, and checked the canary), and
every rank returns or raises alike.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from treadle.common.errors import NoWeightGroup, WeightGroupStale
from treadle.common.log import get_logger
from treadle.common.records import CollectiveWeights, WeightGroupSpec
from treadle.common.weights import WeightGroup, bucket_ranges
from treadle.trainer.weights.gather import bucket_bytes, pack, walk
from treadle.trainer.weights.outcome import Rank, Sent, WeightSyncFailed
from treadle.trainer.weights.plan import Item

log = get_logger(__name__)


class Collective:
    """Sends ``CollectiveWeights`` and broadcasts the buckets (rank 0 hosts the group)."""

    def __init__(self, rank: Rank, *, backend: str, host: str, port: int, timeout_s: float) -> None:
        self.rank, self.backend, self.host, self.port, self.timeout_s = rank, backend, host, port, timeout_s
        self.group: WeightGroup | None = None
        self.buffers: list[torch.Tensor] = []
        self.stream: Any = None  # rank 0, GPU: the broadcasts' CUDA stream (made once)

    def send(self, header: dict[str, Any], items: Sequence[Item], sizes: list[int]) -> Sent:
        r, version = self.rank, header["version"]
        broadcast, err = None, None
        if r.main:
            try:
                broadcast = self._accepted(header, items, sizes)
            except Exception as e:
                err = e
        r.settle(err, version)  # a refusal: nothing gathered anywhere
        start, waited = time.perf_counter(), 0.0
        if r.walks:
            for lo, hi in walk(items, sizes, zero3=r.zero3):
                if broadcast is None:
                    continue  # the other ranks take part in the gathers only
                t = time.perf_counter()
                buffer = broadcast.free()
                waited += time.perf_counter() - t
                if buffer is not None:
                    try:
                        broadcast.put(pack(items[lo:hi], buffer), buffer)
                    except Exception as e:  # finish the walk: the other ranks' gathers need this rank
                        log.error("packing a weight bucket failed", exc_info=e)
                        broadcast.fail(e)
        sent = Sent(buckets=len(sizes), gather_seconds=time.perf_counter() - start - waited)
        if broadcast is not None:
            sent.answer, err = broadcast.result()
            sent.send_seconds = broadcast.send_seconds
            if broadcast.sent < len(sizes):
                self._drop_group()  # the members are out of step: rebuild before the next sync
        r.settle(err, version)
        return sent

    def _accepted(self, header: dict[str, Any], items: Sequence[Item], sizes: list[int]) -> _Broadcast:
        """Rank 0: the update announced and accepted, after one rejoin if the daemon's group is
        not ours; any other refusal raised."""
        for attempt in (0, 1):
            if self.group is None:
                self._join()
            update = CollectiveWeights(**header, bucket_sizes=sizes, group=self.group.spec)
            broadcast = _Broadcast(self.rank, update, self.group, self._buffers(items, sizes), self._stream())
            if broadcast.wait_accepted():
                return broadcast
            _, err = broadcast.result()
            if attempt or not isinstance(err, (WeightGroupStale, NoWeightGroup)):
                raise err or WeightSyncFailed("the daemon answered the weight update without accepting it")
            log.warning("the daemon's weight group is not ours any more; rejoining", extra={"fields": {"reason": str(err)}})
            self._drop_group()
        raise AssertionError("unreachable")

    def _join(self) -> None:
        port = self.port or _free_port(self.host)
        joined, group = self.rank.client.join_weight_group(self.host, port, backend=self.backend,
                                                           timeout_s=self.timeout_s, sender=_sender_side)
        if group is None:
            raise WeightSyncFailed("the daemon joined the weight group, but the sender's side was not built")
        self.group = group
        log.info("joined the rollout weight group", extra={"fields": {
            "endpoint": f"{self.host}:{port}", "world_size": joined.get("world_size"), "members": joined.get("members")}})

    def _drop_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()

    def _buffers(self, items: Sequence[Item], sizes: list[int]) -> list[torch.Tensor]:
        """Two buffers, each large enough for the largest bucket (kept for the next sync)."""
        need = max((bucket_bytes(items[lo:hi]) for lo, hi in bucket_ranges(sizes, len(items))), default=0)
        if len(self.buffers) != 2 or self.buffers[0].numel() < need:
            device = self.rank.device
            pin = device.type == "cpu" and torch.cuda.is_available()  # faster copies from the GPU
            self.buffers = []
            self.buffers = [torch.empty(need, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(2)]
        return self.buffers

    def _stream(self) -> Any:
        if self.stream is None and self.rank.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.rank.device)
        return self.stream

    def release(self) -> None:
        self.buffers = []

    def close(self) -> None:
        """Leave the daemon's weight group (rank 0) and drop the buffers."""
        if self.group is not None and self.rank.main:
            with contextlib.suppress(Exception):
                self.rank.client.leave_weight_group()
        self._drop_group()
        self.buffers = []


class _Broadcast:
    """One collective update in flight on rank 0: the daemon's call, and the broadcast loop that
    the rollout client runs in a thread once the daemon accepted (``_send``). Two buffers
    circulate: ``free`` -> packed -> ``put`` -> broadcast -> free again."""

    def __init__(self, rank: Rank, update: CollectiveWeights, group: WeightGroup, buffers: list[torch.Tensor],
                 stream: Any) -> None:
        self._group, self._buckets, self._stream = group, len(update.bucket_sizes) or len(update.names), stream
        self._ready: queue.Queue[tuple[torch.Tensor, torch.Tensor, Any] | None] = queue.Queue()
        self._free: queue.Queue[tuple[torch.Tensor, Any]] = queue.Queue()  # (buffer, its broadcast's event)
        for b in buffers:
            self._free.put((b, None))
        self.accepted, self.answered, self.broken = threading.Event(), threading.Event(), threading.Event()
        self.sent, self.send_seconds = 0, 0.0
        self.answer: dict[str, Any] = {}
        self.error: BaseException | None = None
        try:
            call = rank.client.submit("update_weights", update, send=self._send, mode=rank.mode)
        except Exception as e:  # the client is closed: an answer that is an error
            call = concurrent.futures.Future()
            call.set_exception(e)
        call.add_done_callback(self._done)

    def _done(self, call: concurrent.futures.Future[Any]) -> None:
        try:
            self.answer = dict(call.result() or {})
        except concurrent.futures.CancelledError:  # the client's loop stopped under the call
            self.error = self.error or WeightSyncFailed("the rollout client's call was cancelled (client closed)")
        except Exception as e:
            self.error = self.error or e  # a local failure (``fail``) explains more than its echo
        finally:
            self.answered.set()

    def _send(self) -> None:
        """The broadcast loop (the client's thread, after the daemon accepted)."""
        self.accepted.set()
        first = None
        try:
            for _ in range(self._buckets):
                got = self._ready.get()
                if got is None:
                    raise WeightSyncFailed("gathering stopped before the last bucket")
                flat, buffer, packed = got
                first = first if first is not None else time.perf_counter()
                done = None
                if self._stream is None:
                    self._group.broadcast(flat)  # returns when sent (gloo)
                else:
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(packed)
                        self._group.broadcast(flat)  # the stream waits for it; the host does not
                        done = torch.cuda.Event()
                        done.record(self._stream)
                self.sent += 1
                self._free.put((buffer, done))
            if self._stream is not None:
                self._stream.synchronize()
            if first is not None:
                self.send_seconds = time.perf_counter() - first
        except BaseException:
            self.broken.set()
            raise

    def wait_accepted(self) -> bool:
        """True once the daemon accepted the update; False when it answered (refused) first."""
        while not self.accepted.wait(0.01):
            if self.answered.is_set():
                return self.accepted.is_set()
        return True

    def free(self) -> torch.Tensor | None:
        """A free buffer for the next bucket; None once the broadcast broke or the daemon answered
        with an error. A GPU buffer may still be in its broadcast: the caller's stream is made to
        wait for it (the host does not)."""
        while not self.broken.is_set() and not (self.answered.is_set() and self.error is not None):
            with contextlib.suppress(queue.Empty):
                buffer, done = self._free.get(timeout=0.05)
                if done is not None:
                    torch.cuda.current_stream(buffer.device).wait_event(done)
                return buffer
        return None

    def put(self, flat: torch.Tensor, buffer: torch.Tensor) -> None:
        """Hand a packed bucket (``flat``, a view of ``buffer``) to the broadcast; on a GPU its
        packing may still run on the caller's stream (the broadcast waits for it)."""
        packed = None
        if flat.is_cuda:
            packed = torch.cuda.Event()
            packed.record(torch.cuda.current_stream(flat.device))
        self._ready.put((flat, buffer, packed))

    def fail(self, error: BaseException) -> None:
        """Rank 0 could not pack a bucket: stop the broadcast (the engines time out on the rest)."""
        self.error = error
        self._ready.put(None)

    def result(self) -> tuple[dict[str, Any], BaseException | None]:
        """The daemon's answer or the error, once the call has ended."""
        self.answered.wait()
        return self.answer, self.error


def _sender_side(spec: WeightGroupSpec) -> WeightGroup:
    """The sender's side (rank 0) of the group the daemon accepted (runs in the client's thread)."""
    return WeightGroup(spec)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
