"""The one task that owns a ZeroMQ socket inside an asyncio loop.

Both the server (ROUTER) and the client (DEALER) hand every outgoing message to a ``Pump`` and
receive every incoming one from it, so only ``Pump.run`` ever touches the socket. It drives a
plain (non-asyncio) pyzmq socket with non-blocking calls: it waits on the socket's file
descriptor only when there is nothing to do, and otherwise drains receives and sends in
batches. That saves a future and a loop round per message compared with ``zmq.asyncio``.

The ZeroMQ descriptor is edge-triggered: it only signals *new* activity, so before sleeping the
pump reads ``ZMQ_EVENTS`` (which also clears the signal) and keeps working if a message is
already waiting.

A pump may also own the socket's monitor (a PAIR socket carrying connection events): it reads
events only once the socket has been drained, and drains it once more before handing them on,
so that a reply which arrived before its connection dropped is delivered before the drop.

Not here: what messages mean (``server`` / ``client``), socket options (``transport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.backend
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

RECV_BATCH = 256
"""Messages received per turn before the pump lets other tasks (the handlers) run."""
_RETRY_S = 0.001
_RETRY_MAX_S = 0.05
"""Back-off when a send would block (a full pipe); ZMQ_POLLOUT is not per peer on a ROUTER."""
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
# The backend's send: pyzmq's Python-level wrapper only adds DRAFT-socket options we never use,
# and a Python frame per send is measurable at tens of thousands of messages per second.
_send = zmq.backend.Socket.send
_COPY_BELOW = zmq.COPY_THRESHOLD
"""``bytes`` frames shorter than this are sent by copy: cheaper than pyzmq's zero-copy wrapper,
which would copy them anyway (its ``copy_threshold``) after building a memoryview."""


class Pump:
    """Owns ``sock``: sends what ``send`` queued, passes each received message to ``on_message``.

    ``on_message(frames)`` runs inside the pump task and must not block; it may call ``send``.
    Frames arrive as a list of ``zmq.Frame`` (zero-copy) but for two, which arrive as ``bytes``:
    with ``routed``, the first (a ROUTER's peer identity, a dict key); with ``header_as_bytes``,
    the message's own first frame, its header (small, and decoded faster from ``bytes``).
    ``on_send_error(frames, exc)`` is told about a message that could not be sent (its peer is
    gone); it is dropped. ``monitor`` (from ``sock.get_monitor_socket``) passes each connection
    event (``zmq.EVENT_*``) to ``on_event``. The pump closes the socket (and the monitor) when it
    ends (``linger_ms`` for queued messages to leave), however it ends.
    """

    __slots__ = ("_sock", "_on_message", "_on_send_error", "_routed", "_header_as_bytes", "_outbox",
                 "_wake", "_stopping", "_task", "_linger_ms", "_retry_s", "_monitor", "_on_event",
                 "_events_waiting")

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[Any]], None], *,
                 routed: bool, header_as_bytes: bool = True,
                 on_send_error: Callable[[list[Any], Exception], None] | None = None,
                 linger_ms: int = 1000, monitor: zmq.Socket | None = None,
                 on_event: Callable[[int], None] | None = None) -> None:
        self._sock = sock
        self._on_message = on_message
        self._on_send_error = on_send_error
        self._monitor = monitor
        self._on_event = on_event
        self._events_waiting = monitor is not None  # read once at start: events may predate the reader
        self._routed = routed
        self._header_as_bytes = header_as_bytes
        self._outbox: deque[list[Any]] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._linger_ms = linger_ms
        self._retry_s = _RETRY_S

    def start(self, name: str) -> asyncio.Task[None]:
        """Start the owning task in the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=name)
        return self._task

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def send(self, frames: list[Any]) -> None:
        """Queue one multipart message; the pump sends it on its next turn (FIFO)."""
        self._outbox.append(frames)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def stop(self) -> None:
        """Ask the pump to send what is queued and then return (the caller closes the socket)."""
        self._stopping = True
        self._poke()

    def _poke(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _monitor_ready(self) -> None:
        self._events_waiting = True
        self._poke()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        fd = self._sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._poke)
        mfd = self._monitor.getsockopt(zmq.FD) if self._monitor is not None else None
        if mfd is not None:
            loop.add_reader(mfd, self._monitor_ready)
        try:
            while True:
                blocked = self._flush()
                if self._stopping and (blocked or not self._outbox):
                    return  # what cannot leave now is dropped: the socket's linger covers the rest
                received = 0 if self._stopping else self._drain()
                if received and self._outbox and not blocked:
                    # Replies made while reading (handlers that finished at once) leave now, so
                    # ZeroMQ's I/O thread works on them while this loop runs everything else.
                    blocked = self._flush()
                if received or (self._outbox and not blocked):
                    await asyncio.sleep(0)  # let the handlers just created (or woken) run
                    continue
                if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    continue  # arrived while we were sending; the descriptor will not fire for it
                if self._events_waiting and self._read_events():
                    continue
                self._wake = loop.create_future()
                retry = None
                if blocked:  # no peer can take it (e.g. reconnecting): retry, backing off
                    retry = loop.call_later(self._retry_s, self._poke)
                    self._retry_s = min(2 * self._retry_s, _RETRY_MAX_S)
                try:
                    await self._wake
                finally:
                    self._wake = None
                    if retry is not None:
                        retry.cancel()
        finally:
            loop.remove_reader(fd)
            if mfd is not None:
                loop.remove_reader(mfd)
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disable_monitor()
                self._monitor.close(linger=0)  # type: ignore[union-attr]
            self._sock.close(linger=self._linger_ms)

    def _read_events(self) -> bool:
        """Hand waiting monitor events to ``on_event``, after the messages that came before them.

        True when there were any. libzmq queues a connection's last messages before it reports
        the connection's end, so one more drain here delivers them first.
        """
        self._events_waiting = False
        events = []
        while True:
            try:
                frames = self._monitor.recv_multipart(_NOBLOCK)  # type: ignore[union-attr]
            except zmq.Again:
                break
            events.append(parse_monitor_message(frames)["event"])
        if not events:
            return False
        while self._drain() == RECV_BATCH:
            pass
        for event in events:
            if self._on_event is not None:
                try:
                    self._on_event(event)
                except Exception:  # a bug in a listener must not kill the socket's owner
                    log.exception("connection event handler failed")
        return True

    def _flush(self) -> bool:
        """Send queued messages; True when the socket would block (the rest stay queued)."""
        outbox, sock = self._outbox, self._sock
        while outbox:
            frames = outbox[0]
            n = len(frames)
            f = frames[0]
            by_copy = type(f) is bytes and len(f) < _COPY_BELOW
            try:
                # Only the first frame can block: the rest of a multipart message follows it.
                _send(sock, f, _MORE if n > 1 else _NOBLOCK, by_copy)
            except zmq.Again:
                return True
            except zmq.ZMQError as e:  # EHOSTUNREACH: the peer disconnected (ROUTER_MANDATORY)
                outbox.popleft()
                if self._on_send_error is not None:
                    self._on_send_error(frames, e)
                else:
                    log.debug("dropped a message that could not be sent: %s", e)
                continue
            outbox.popleft()
            self._retry_s = _RETRY_S
            for i in range(1, n):
                f = frames[i]
                by_copy = type(f) is bytes and len(f) < _COPY_BELOW
                _send(sock, f, _MORE if i < n - 1 else _NOBLOCK, by_copy)
        return False

    def _drain(self) -> int:
        """Receive up to RECV_BATCH waiting messages and hand each to ``on_message``."""
        on_message, recv = self._on_message, self._sock.recv
        routed, as_bytes = self._routed, self._header_as_bytes
        n = 0
        while n < RECV_BATCH:
            try:
                if routed:  # the identity by copy: a Frame costs more, and a body always follows it
                    frames: list[Any] = [recv(_NOBLOCK)]
                    frame = recv(0, copy=False)
                else:
                    frames = []
                    frame = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            frames.append(frame.bytes if as_bytes else frame)
            while frame.more:  # cheaper than getsockopt(RCVMORE), which builds an enum each call
                frame = recv(0, copy=False)
                frames.append(frame)
            n += 1
            try:
                on_message(frames)
            except Exception:  # a bug in a dispatcher must not kill the socket's owner
                log.exception("message handler failed; message dropped")
        return n
