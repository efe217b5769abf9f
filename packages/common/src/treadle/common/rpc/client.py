"""The RPC client: a ZeroMQ DEALER with many requests in flight, asyncio-first.

``await client.call(method, msg)`` returns the reply record or raises the exception named by
the server's ``Error`` (``Busy``, ``UnknownMethod``, ``InternalError``, ...; see
``treadle.common.errors``). ``async for item in client.stream(method, msg)`` yields streamed
chunks. Cancelling the awaiting task, leaving a stream early, or a timeout (``RequestTimeout``)
sends ``cancel`` so the server stops working on it. After ``close()`` every call raises
``ServiceClosed``. One task (the ``Pump``) owns the socket; it starts with the first request, in
the running loop, and the client stays bound to that loop.

When an established connection drops (the server was killed, or closed), every request in
flight fails at once with ``ConnectionLost`` (retryable) instead of waiting for its timeout: the
socket's monitor reports the drop. ZeroMQ reconnects by itself, so later requests wait for the
server to come back (until their timeout) and then go through. A peer that vanishes without
closing its TCP connection (a host powered off) is still only noticed by the timeout. A client
with a better signal of its server's death (a parent watching its child process) can turn this
off with ``fail_on_disconnect=False``.

Not here: the blocking wrapper (``sync.SyncRpcClient``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

from treadle.common import env
from treadle.common.codec import StreamDecoder, encode, peek_header
from treadle.common.errors import (
    CodecError,
    ConnectionLost,
    RequestTimeout,
    ServiceClosed,
    TreadleError,
    error_for,
)
from treadle.common.records import Error, Record
from treadle.common.rpc import transport
from treadle.common.rpc._pump import Pump
from treadle.common.rpc.curve import ClientCurve, apply_client

log = logging.getLogger(__name__)
_get_ident = threading.get_ident
_END = object()
_DEADLINE_SLACK_S = 0.005


class _StreamSink:
    """Chunks of one streamed request, waiting to be read."""

    __slots__ = ("items", "waiter", "finished")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.waiter: asyncio.Future[bool] | None = None
        self.finished = False

    def push(self, item: Any) -> None:
        self.items.append(item)
        if item is _END or isinstance(item, BaseException):
            self.finished = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)  # False: the wait timed out


class RpcClient:
    """Calls an ``RpcServer`` at ``endpoint``; safe to share between tasks of one event loop."""

    def __init__(self, endpoint: str, *, name: str = "", curve: ClientCurve | None = None,
                 timeout_s: float | None = None, max_frame_bytes: int | None = None,
                 context: zmq.Context | None = None, linger_s: float = 0.2,
                 fail_on_disconnect: bool = True) -> None:
        self.endpoint = transport.check_endpoint(endpoint, secure=curve is not None, role="connect")
        self.name = name or endpoint
        self._curve = curve
        self._timeout_s = float(env.get("TREADLE_RPC_TIMEOUT_S") if timeout_s is None else timeout_s)
        self._max_frame = transport.default_max_frame_bytes() if max_frame_bytes is None else max_frame_bytes
        self._context = context
        self._linger_ms = int(linger_s * 1000)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any] | _StreamSink] = {}
        self._decoder = StreamDecoder()
        self._pump: Pump | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        """The thread ``_loop`` last ran in: running there, it is the running loop."""
        self._closed = False
        self._deadlines: list[tuple[float, int, str, float]] = []
        self._in_order: dict[int, tuple[float, str]] = {}
        """(deadline, method) of calls with the default timeout, by id: oldest first (a dict
        keeps insertion order), so these need no heap."""
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_at = math.inf
        self._fail_on_disconnect = fail_on_disconnect
        self._connected = False
        """A connection to the server completed its handshake and has not dropped since."""

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """A connection to the server is up (its handshake done, not dropped since); tracked
        only with ``fail_on_disconnect`` (else always False)."""
        return self._connected

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._pending)

    def _start(self) -> Pump:
        if self._closed:
            raise ServiceClosed(f"client of {self.endpoint} is closed")
        self._loop = asyncio.get_running_loop()
        self._thread = _get_ident()
        ctx = self._context or zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        monitor = None
        try:
            transport.configure(sock, self.endpoint, max_frame_bytes=self._max_frame)
            sock.setsockopt(zmq.RCVHWM, 0)  # replies to our own requests: always take them
            if self._curve is not None:
                apply_client(sock, self._curve)
            if self._fail_on_disconnect:
                monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sock.connect(self.endpoint)
        except BaseException:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise
        self._pump = Pump(sock, self._on_message, routed=False, linger_ms=self._linger_ms,
                          monitor=monitor, on_event=self._on_event)
        self._pump.start(name=f"rpc-client:{self.name}").add_done_callback(self._pump_done)
        return self._pump

    def _pump_of_this_loop(self) -> Pump:
        pump = self._pump
        if pump is None:
            return self._start()
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(f"client of {self.endpoint} is bound to the event loop it first ran in; "
                               f"use one RpcClient per loop (or SyncRpcClient from threads)")
        self._thread = _get_ident()  # the loop runs in this thread now
        return pump

    def _pump_done(self, task: asyncio.Task[None]) -> None:
        if self._closed:
            return
        if task.cancelled():  # its loop is shutting down
            log.debug("client of %s: socket task cancelled", self.endpoint)
        else:
            log.error("client of %s: socket task failed", self.endpoint, exc_info=task.exception())
        self._closed = True
        self._fail_pending(lambda rid: ServiceClosed(f"client of {self.endpoint} lost its socket task"))

    def _fail_pending(self, error: Callable[[int], TreadleError]) -> None:
        """Fail every request in flight with ``error(request id)``."""
        for rid, pending in list(self._pending.items()):
            if isinstance(pending, _StreamSink):
                if not pending.finished:
                    pending.push(error(rid))
            elif not pending.done():
                pending.set_exception(error(rid))

    def _on_event(self, event: int) -> None:
        """A connection event from the socket's monitor (run by the pump, after every message
        that arrived before it)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
        elif event == zmq.EVENT_DISCONNECTED and self._connected:
            # Only a connection that was up: a failed handshake (wrong CURVE key) also ends in
            # EVENT_DISCONNECTED, but then nothing was delivered and the timeout says more.
            self._connected = False
            if self._pending:
                log.warning("client of %s: connection lost with %d request(s) in flight; failing them",
                            self.endpoint, len(self._pending))
            self._fail_pending(self._lost_error)

    def _lost_error(self, rid: int) -> ConnectionLost:
        return ConnectionLost(
            f"lost the connection to {self.endpoint} while request {rid} was in flight (the server died, "
            f"restarted or closed); it may or may not have run. The client reconnects by itself: retry "
            f"if the request is idempotent"
        )

    def _timeout(self, timeout: float | None) -> float:
        t = self._timeout_s if timeout is None else float(timeout)
        if not t > 0:
            raise ValueError(f"timeout must be > 0 seconds (math.inf for none), got {timeout}")
        return t

    # ---- calls --------------------------------------------------------------------------

    async def call(self, method: str, msg: Record | None = None, *, timeout: float | None = None) -> Record:
        """Send ``msg`` to ``method`` and return the reply; raises the server's error as its exception.

        ``timeout`` (seconds; default the TREADLE_RPC_TIMEOUT_S knob) raises ``RequestTimeout``.
        """
        if self._closed:
            raise ServiceClosed(f"client of {self.endpoint} is closed; cannot call {method!r}")
        pump, loop = self._pump, self._loop
        # The cheap test first: asyncio.get_running_loop() costs a getpid() system call.
        if pump is None or _get_ident() != self._thread or not loop.is_running():  # type: ignore[union-attr]
            pump = self._pump_of_this_loop()
            loop = self._loop
        t = self._timeout_s if timeout is None else float(timeout)
        if not t > 0:
            raise ValueError(f"timeout must be > 0 seconds (math.inf for none), got {t}")
        rid = next(self._ids)
        frames = encode(msg, id=rid, op="call", method=method)
        fut = loop.create_future()  # type: ignore[union-attr]
        pending = self._pending
        pending[rid] = fut
        pump.send(frames)
        in_order = self._in_order
        if t == self._timeout_s and t != math.inf:
            when = loop.time() + t  # type: ignore[union-attr]
            in_order[rid] = (when, method)
            if when < self._deadline_at:
                self._schedule_deadlines(when)
        elif t != math.inf:
            self._arm_deadline(rid, method, t)
        try:
            return await fut
        except asyncio.CancelledError:
            if rid in pending and not self._closed:
                pump.send(encode(None, id=rid, op="cancel"))
            raise
        finally:
            pending.pop(rid, None)
            in_order.pop(rid, None)

    # Deadlines: one loop timer for the earliest, instead of a TimerHandle per call (their
    # Python-level heap comparisons were ~10% of a small call). Calls with the default timeout
    # expire in call order (``_in_order``); others go through one heap of plain tuples.

    def _arm_deadline(self, rid: int, method: str, t: float) -> None:
        when = self._loop.time() + t  # type: ignore[union-attr]
        heapq.heappush(self._deadlines, (when, rid, method, t))
        if when < self._deadline_at:
            self._schedule_deadlines(when)
        if len(self._deadlines) > 4 * len(self._pending) + 4096:  # drop answered requests' entries
            self._deadlines = [d for d in self._deadlines if d[1] in self._pending]
            heapq.heapify(self._deadlines)

    def _schedule_deadlines(self, when: float) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_at = when
        self._deadline_timer = self._loop.call_at(when, self._expire_due)  # type: ignore[union-attr]

    def _expire_due(self) -> None:
        self._deadline_timer, self._deadline_at = None, math.inf
        heap, in_order, now = self._deadlines, self._in_order, self._loop.time()  # type: ignore[union-attr]
        while heap and heap[0][0] <= now:
            _, rid, method, t = heapq.heappop(heap)
            self._expire(rid, method, t)
        while in_order:
            rid = next(iter(in_order))
            when, method = in_order[rid]
            if when > now:
                break
            del in_order[rid]
            self._expire(rid, method, self._timeout_s)
        earliest = min(heap[0][0] if heap else math.inf,
                       next(iter(in_order.values()))[0] if in_order else math.inf)
        # A little slack, so that a steady stream of calls does not wake the loop each time.
        if earliest != math.inf:
            self._schedule_deadlines(max(earliest, now + _DEADLINE_SLACK_S))

    def _expire(self, rid: int, method: str, t: float) -> None:
        fut = self._pending.get(rid)
        if isinstance(fut, asyncio.Future) and not fut.done():
            fut.set_exception(self._timeout_error(rid, method, t))
            self._pump.send(encode(None, id=rid, op="cancel"))  # type: ignore[union-attr]

    def _timeout_error(self, rid: int, method: str, t: float) -> RequestTimeout:
        return RequestTimeout(
            f"no reply to {method!r} (request {rid}) from {self.endpoint} within {t:g} s; the server was "
            f"asked to cancel it (raise timeout= or the TREADLE_RPC_TIMEOUT_S knob)"
        )

    async def stream(self, method: str, msg: Record | None = None, *,
                     timeout: float | None = None) -> AsyncIterator[Record]:
        """Yield the records a streaming ``method`` sends, until its end.

        ``timeout`` bounds the wait for each next item, not the whole stream. Leaving the loop
        early (``break``, an exception, cancellation) cancels the request on the server.
        """
        if self._closed:
            raise ServiceClosed(f"client of {self.endpoint} is closed; cannot stream {method!r}")
        pump = self._pump_of_this_loop()
        t = self._timeout(timeout)
        rid = next(self._ids)
        frames = encode(msg, id=rid, op="call", method=method)
        sink = _StreamSink()
        self._pending[rid] = sink
        pump.send(frames)
        try:
            while True:
                while not sink.items:
                    await self._wait_item(sink, rid, method, t)
                item = sink.items.popleft()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._pending.pop(rid, None)
            if not sink.finished and not self._closed:
                pump.send(encode(None, id=rid, op="cancel"))

    async def _wait_item(self, sink: _StreamSink, rid: int, method: str, t: float) -> None:
        waiter = sink.waiter = self._loop.create_future()  # type: ignore[union-attr]
        timer = None if t == math.inf else self._loop.call_later(t, _expire_waiter, waiter)  # type: ignore[union-attr]
        try:
            if not await waiter:
                raise self._timeout_error(rid, method, t)
        finally:
            sink.waiter = None
            if timer is not None:
                timer.cancel()

    # ---- replies ------------------------------------------------------------------------

    def _on_message(self, frames: list[Any]) -> None:
        try:
            env, msg = self._decoder.decode(frames, self._max_frame)
        except TreadleError as e:
            self._fail_undecodable(frames, e)
            return
        pending = self._pending.get(env.id)
        if pending is None:
            return  # a late answer to a request that timed out or was cancelled
        op = env.op
        if type(pending) is _StreamSink:
            self._to_stream(pending, op, msg)
        elif not pending.done():
            if op == "reply":
                pending.set_result(msg)
            elif op == "error":
                pending.set_exception(_error(msg))
            else:
                pending.set_exception(CodecError(f"a call got a {op!r} message; expected 'reply' or 'error'"))

    def _to_stream(self, sink: _StreamSink, op: str, msg: Record | None) -> None:
        if sink.finished:
            return
        if op == "chunk":
            sink.push(msg)
        elif op == "end":
            sink.push(_END)
        elif op == "error":
            sink.push(_error(msg))
        else:
            sink.push(CodecError(f"a stream got a {op!r} message; expected 'chunk', 'end' or 'error'"))

    def _fail_undecodable(self, frames: list[Any], e: TreadleError) -> None:
        try:
            rid = peek_header(frames[0]).id if len(frames[0]) <= self._max_frame else 0
        except TreadleError:
            rid = 0
        pending = self._pending.get(rid)
        log.warning("client of %s: undecodable message for request %d: %s", self.endpoint, rid, e)
        if isinstance(pending, _StreamSink):
            pending.push(e)
        elif pending is not None and not pending.done():
            pending.set_exception(e)

    # ---- shutdown -----------------------------------------------------------------------

    async def close(self) -> None:
        """Fail every pending request with ``ServiceClosed``, ask the server to cancel them, close."""
        if self._closed:
            return
        self._closed = True
        pump = self._pump
        for rid, pending in list(self._pending.items()):
            err = ServiceClosed(f"client of {self.endpoint} closed while request {rid} was in flight")
            if isinstance(pending, _StreamSink):
                pending.push(err)
            elif not pending.done():
                pending.set_exception(err)
            if pump is not None:
                pump.send(encode(None, id=rid, op="cancel"))
        self._pending.clear()
        self._deadlines.clear()
        self._in_order.clear()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        if pump is not None and pump.task is not None:
            pump.stop()
            done, _ = await asyncio.wait([pump.task], timeout=self._linger_ms / 1000 + 1.0)
            if not done:
                pump.task.cancel()
                await asyncio.wait([pump.task])

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _expire_waiter(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _error(err: Record | None) -> TreadleError:
    if not isinstance(err, Error):
        return CodecError(f"an error reply must carry an Error record, got {type(err).__name__}")
    return error_for(err.code, err.message, err.retryable)
