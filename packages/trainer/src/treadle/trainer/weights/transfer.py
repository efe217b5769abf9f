"""Rank 0's side of one collective weight update, and how a sync's outcome reaches every rank.

``Transfer`` starts the daemon call (``update_weights``) on the rollout client's event loop
(no thread of its own: a thread started per sync cost its start and one more hop before the
request left); once the daemon has accepted, the rollout client runs ``Transfer``'s broadcast
loop in a thread, which sends the buckets that rank 0's gather hands over with ``put``. Two
buffers circulate between them (``buffer`` -> ``put`` -> broadcast -> free again): packing
bucket k+1 overlaps broadcasting bucket k, and memory stays at two buckets. GPU buffers are
handed over with CUDA events, never a host wait: the broadcasts run on a stream of their own
(kept by the sender from one sync to the next) that waits for the packing's event,
and a freed buffer carries the event of its broadcast, which the packing stream waits for
before writing into it again; so gathering and packing the next bucket are never queued behind
a broadcast, and the host keeps enqueueing. For engines that were armed and signalled
(``early``) the broadcast loop starts at once in a thread of its own, not at the acceptance.

``share_outcome`` / ``raise_outcome``: rank 0's result as one integer, all-reduced (max) over
the trainer's ranks, so that every rank returns or raises alike and none is left waiting in a
collective that rank 0 will not enter. Over a CPU (gloo) group when the sender has one: the
other ranks then wait for rank 0 on the CPU, not in a GPU kernel that spins on a GPU an
engine may be receiving on (``outcome_group``).

Not here: gathering and packing (``gather``), the daemon's protocol choices (``sender``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
from typing import Any

import torch

from treadle.common.errors import (
    BadRequest,
    EngineDead,
    InternalError,
    RequestTimeout,
    TreadleError,
)
from treadle.common.log import get_logger
from treadle.common.records import WeightUpdate
from treadle.rollout.client import EnginesQuarantined, NoEngine, WeightGroupStale
from treadle.rollout.engine.group import WeightGroup

log = get_logger(__name__)


class WeightSyncFailed(InternalError):
    """The sync failed on rank 0 for a reason that is not a treadle error (see rank 0's log)."""


class ResendUnarmed(TreadleError):
    """The daemon refused an armed update after the engines went (its pool changed since they
    armed): every rank does the sync again, unarmed (the sender catches it)."""

    code = "resend_unarmed"


# What a failed sync raises on the ranks that did not see the error: the first class matching
# rank 0's error, shared as its index + 1 (0: success). Most specific first.
OUTCOMES: tuple[type[TreadleError], ...] = (ResendUnarmed, WeightGroupStale, EnginesQuarantined, NoEngine, BadRequest,
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
    default group if None; no-op on one rank)."""
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
        if not isinstance(err, ResendUnarmed):
            log.error("weight sync of version %d failed: %s", version, err)
        raise err
    cls = OUTCOMES[code - 1]
    raise cls(f"weight sync of version {version} failed on rank 0 ({cls.__name__}); rank 0's log says why")


class Transfer:
    """One collective update in flight on rank 0 (see the module docstring)."""

    def __init__(self, client: Any, update: WeightUpdate, group: WeightGroup, buckets: int,
                 buffers: list[torch.Tensor], mode: str = "wait", stream: Any = None, early: bool = False) -> None:
        """``stream``: the CUDA stream the broadcasts run on (GPU buffers; the sender's, kept);
        ``early``: broadcast at once, in a thread of its own, not once the daemon accepted (the
        engines were armed and signalled)."""
        self._group, self._buckets = group, buckets
        self._ready: queue.Queue[tuple[torch.Tensor, torch.Tensor, Any] | None] = queue.Queue()
        self._free: queue.Queue[tuple[torch.Tensor, Any]] = queue.Queue()  # (buffer, its broadcast's event)
        for b in buffers:
            self._free.put((b, None))
        on_gpu = bool(buffers) and buffers[0].is_cuda
        if on_gpu and stream is None:
            raise ValueError("a Transfer of GPU buffers needs the CUDA stream its broadcasts run on")
        self._stream = stream if on_gpu else None
        # Armed engines receive whatever the daemon answers: over gloo the broadcast is finished
        # even after a refusal (a gloo receive cannot be interrupted: aborting its group does not
        # unblock it, so a half-sent update would hold them until the timeout); over NCCL it
        # stops (their communicators are aborted when they leave the group).
        self._early, self._finish_all = early, early and group.spec.backend == "gloo"
        self.accepted, self.finished, self.broken = threading.Event(), threading.Event(), threading.Event()
        self.ended = threading.Event()  # the broadcast loop has returned
        self.sent, self.send_seconds = 0, 0.0
        self.accepted_at = self.sent_at = self.answered_at = 0.0  # perf_counter() when the daemon accepted /
        # the last byte was sent / the daemon answered
        self.answer: dict[str, Any] | None = None
        self.error: BaseException | None = None
        try:
            call = client.submit("update_weights", update, send=_nothing if early else self._send, mode=mode)
        except Exception as e:  # the client is closed: an answer that is an error
            call = concurrent.futures.Future()
            call.set_exception(e)
        if early:
            threading.Thread(target=self._send_early, name="weight-broadcast", daemon=True).start()
        call.add_done_callback(self._answered)

    def _send_early(self) -> None:
        try:
            self._send()
        except BaseException as e:  # noqa: BLE001 - a broken group (dropped after a refusal): in the answer
            log.warning("the armed broadcast ended early: %s", e)

    def _answered(self, call: concurrent.futures.Future[Any]) -> None:
        """The daemon call ended (on the client's loop, or here if it never started)."""
        try:
            self.answer = call.result()
        except concurrent.futures.CancelledError:  # the client's loop stopped under the call
            self.error = self.error or WeightSyncFailed("the rollout client's call was cancelled (client closed)")
        except Exception as e:
            self.error = self.error or e  # a local failure (``fail``) explains more than its echo
        finally:
            self.answered_at = time.perf_counter()
            self.finished.set()
            if self._early and not self._finish_all and self.error is not None:
                self._ready.put(None)  # the broadcast thread may wait for buckets that will not come

    def _send(self) -> None:
        self.accepted_at = time.perf_counter()
        self.accepted.set()
        first = None
        try:
            for _ in range(self._buckets):
                got = self._ready.get()
                if got is None:
                    raise WeightSyncFailed("gathering stopped before the last bucket")
                flat, buffer, packed = got
                start = time.perf_counter()
                first = first if first is not None else start
                done = None
                if self._stream is None:
                    self._group.broadcast(flat, src=0)  # returns when sent (gloo)
                    self.send_seconds += time.perf_counter() - start
                else:
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(packed)
                        self._group.broadcast(flat, src=0)  # the stream waits for it; the host does not
                        done = torch.cuda.Event()
                        done.record(self._stream)
                self.sent += 1
                self._free.put((buffer, done))
            if self._stream is not None and first is not None:  # GPU: first hand-over to the last byte sent
                self._stream.synchronize()
                self.send_seconds = time.perf_counter() - first
            self.sent_at = time.perf_counter()
        except BaseException:
            self.broken.set()
            raise
        finally:
            self.ended.set()

    def wait_accepted(self) -> bool:
        """True once the daemon accepted the update; False when it answered (refused) first."""
        while not self.accepted.wait(0.01):
            if self.finished.is_set():
                return self.accepted.is_set()
        return True

    def buffer(self) -> torch.Tensor | None:
        """A free buffer for the next bucket; None: broken, or the daemon answered without
        accepting or with an error (unless an armed gloo broadcast, finished regardless). A GPU buffer may still be in its broadcast: the caller's
        stream is made to wait for it (the host does not)."""
        while not self.broken.is_set() and not (self.finished.is_set() and not self._finish_all
                                                and (self.error is not None or not self.accepted.is_set())):
            with contextlib.suppress(queue.Empty):
                buffer, done = self._free.get(timeout=0.05)
                if done is not None:
                    torch.cuda.current_stream(buffer.device).wait_event(done)
                return buffer
        return None

    def put(self, flat: torch.Tensor, buffer: torch.Tensor) -> None:
        """Hand a packed bucket (``flat``, a view of ``buffer``) to the broadcast; on a GPU the
        packing may still be running on the caller's stream (the broadcast waits for it)."""
        packed = None
        if flat.is_cuda:
            packed = torch.cuda.Event()
            packed.record(torch.cuda.current_stream(flat.device))
        self._ready.put((flat, buffer, packed))

    def fail(self, error: BaseException) -> None:
        """Rank 0 could not pack a bucket: stop the broadcast (the engines time out on the rest)."""
        self.error = error
        self._ready.put(None)

    def result(self) -> tuple[dict[str, Any] | None, BaseException | None]:
        """The daemon's answer or the error, once the call has ended (and an early broadcast
        loop too: the daemon may answer before its last ``broadcast`` returned here)."""
        self.finished.wait()
        if self._early:
            self.ended.wait()
        return self.answer, self.error


def _nothing() -> None:
    """The acceptance's broadcast when it started early."""
