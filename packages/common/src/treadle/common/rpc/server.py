"""The RPC server: a ZeroMQ ROUTER that runs async handlers by method name.

A handler is ``async def fn(msg, ctx) -> Record`` (one ``reply``) or an async generator
``async def fn(msg, ctx): yield Record`` (one ``chunk`` per item, then ``end``). Each request
runs in its own task, so many are in flight on one connection, told apart by the header id;
a ``cancel`` with that id cancels the task (the handler sees ``CancelledError``). Every call
ends with exactly one terminal message: ``reply``, ``end`` or ``error``. A call handler's first
step runs at once, as the request is read (``_eager``): one that returns without waiting never
needs a task of its own, which halves the cost of a small request.

Whatever arrives (undecodable, oversized, another protocol version, an unknown method, a
handler that raises) is answered with a typed ``Error`` to the sender, carrying the request id
when the header could be read (else 0); the server keeps serving. ``health`` and ``stats`` are
built in and answered inline (never ``Busy``), unless a handler is registered under that name.

One task (the ``Pump``) owns the socket; handlers hand replies to it. There is no flow control
on streamed chunks beyond ZeroMQ's: a handler that yields faster than the peer reads grows the
send queue.

Not here: the client (``client``), threads (``sync``), key files (``curve``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Union

import zmq

from treadle.common.codec import PROTOCOL_MAJOR, StreamDecoder, encode, peek_header
from treadle.common.errors import CodecError, TreadleError
from treadle.common.records import Ack, Control, Error, Record
from treadle.common.rpc import transport
from treadle.common.rpc._eager import Starter
from treadle.common.rpc._pump import Pump
from treadle.common.rpc.curve import ServerCurve, apply_server, start_authenticator

log = logging.getLogger(__name__)

CallHandler = Callable[[Union[Record, None], "RequestContext"], Awaitable[Union[Record, None]]]
StreamHandler = Callable[[Union[Record, None], "RequestContext"], AsyncIterator[Record]]
Handler = Union[CallHandler, StreamHandler]
_MAX_DETAIL = 200
_ACK = Ack()


class RequestContext:
    """What a handler knows about the request besides its record."""

    __slots__ = ("id", "method", "peer", "server", "client_key")

    def __init__(self, id: int, method: str, peer: bytes, server: str, client_key: str | None) -> None:
        self.id = id
        """Request id chosen by the client (unique among its requests in flight)."""
        self.method = method
        """The method name the client called."""
        self.peer = peer
        """The caller's ROUTER identity (one per connection)."""
        self.server = server
        """The server's name."""
        self.client_key = client_key
        """The caller's CURVE public key (z85), or None without CURVE."""

    def __repr__(self) -> str:
        return f"RequestContext(id={self.id}, method={self.method!r}, peer={self.peer.hex()})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_DETAIL else text[:_MAX_DETAIL] + "..."


def _header_id(frames: list[Any], limit: int) -> int:
    """The request id in a message that failed to decode, or 0 when the header is unreadable."""
    if not frames or len(frames[0]) > limit:
        return 0
    try:
        return peek_header(frames[0]).id
    except TreadleError:
        return 0


class RpcServer:
    """A ROUTER service: ``register`` handlers, ``await start()``, ``await close(grace_s)``."""

    def __init__(self, *, name: str = "treadle", endpoint: str = "tcp://127.0.0.1:0",
                 handlers: Mapping[str, Handler] | None = None, max_in_flight: int = 1024,
                 max_frame_bytes: int | None = None, curve: ServerCurve | None = None,
                 context: zmq.Context | None = None, linger_s: float = 1.0) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.name = name
        self._requested = endpoint
        self._endpoint = ""
        self._curve = curve
        self._max_in_flight = max_in_flight
        self._max_frame = transport.default_max_frame_bytes() if max_frame_bytes is None else max_frame_bytes
        if self._max_frame < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {self._max_frame}")
        self._context = context
        self._owns_context = False
        self._linger_s = linger_s
        self._handlers: dict[str, tuple[Handler, bool]] = {}
        self._builtins = {"health": self._health, "stats": self._stats_reply}
        self._tasks: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        self._starter: Starter | None = None
        self._decoder = StreamDecoder()
        self._pump: Pump | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._auth: Any = None
        self._closing = False
        self._closed = asyncio.Event()
        self._started_at = 0.0
        self._served = 0
        self._requests = 0
        self._errors: dict[str, int] = {}
        for method, fn in (handlers or {}).items():
            self.register(method, fn)

    # ---- set-up -------------------------------------------------------------------------

    def register(self, method: str, fn: Handler) -> None:
        """Serve ``method`` with ``fn`` (an async function or an async generator function)."""
        if self._pump is not None:
            raise RuntimeError(f"server {self.name!r} already started: register handlers before start()")
        if not method or not isinstance(method, str):
            raise ValueError(f"method name must be a non-empty str, got {method!r}")
        stream = inspect.isasyncgenfunction(fn)
        if not stream and not inspect.iscoroutinefunction(fn):
            raise TypeError(f"handler for {method!r} must be an async function or async generator "
                            f"function, got {fn!r}")
        self._handlers[method] = (fn, stream)

    async def start(self) -> str:
        """Bind and start serving; returns the real endpoint (the random port filled in)."""
        if self._pump is not None:
            raise RuntimeError(f"server {self.name!r} already started")
        endpoint = transport.check_endpoint(self._requested, secure=self._curve is not None, role="bind")
        if self._context is None:
            # zmq's authenticator is per context: a CURVE server gets a private one.
            self._context = zmq.Context() if self._curve is not None else zmq.Context.instance()
            self._owns_context = self._curve is not None
        sock = self._context.socket(zmq.ROUTER)
        try:
            transport.configure(sock, endpoint, max_frame_bytes=self._max_frame)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises, not vanishes
            if self._curve is not None:
                self._auth = start_authenticator(self._context, self._curve)
                apply_server(sock, self._curve)
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as e:
                raise OSError(e.errno, f"server {self.name!r} cannot bind {endpoint}: {e.strerror}") from None
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            sock.close(linger=0)
            self._release()
            raise
        self._started_at = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._starter = Starter(self._loop, name=f"rpc-handler:{self.name}")
        # With CURVE the header stays a zmq.Frame: its metadata names the caller's key (User-Id).
        self._pump = Pump(sock, self._on_message, routed=True, header_as_bytes=self._curve is None,
                          on_send_error=self._on_send_error,
                          linger_ms=int(self._linger_s * 1000))
        self._pump.start(name=f"rpc-server:{self.name}").add_done_callback(self._pump_done)
        log.info("rpc server %r serving on %s", self.name, self._endpoint)
        return self._endpoint

    @property
    def endpoint(self) -> str:
        """The bound endpoint ("" before start)."""
        return self._endpoint

    @property
    def in_flight(self) -> int:
        """Handler tasks running now."""
        return len(self._tasks)

    def stats(self) -> dict[str, Any]:
        """Counters, as the built-in ``stats`` method reports them."""
        return {
            "name": self.name, "endpoint": self._endpoint, "status": "closing" if self._closing else "ok",
            "uptime_s": round(time.monotonic() - self._started_at, 3) if self._started_at else 0.0,
            "in_flight": len(self._tasks), "max_in_flight": self._max_in_flight,
            "requests": self._requests, "served": self._served, "errors": dict(self._errors),
            "methods": sorted(self._handlers), "protocol": PROTOCOL_MAJOR,
        }

    # ---- receiving ----------------------------------------------------------------------

    def _on_message(self, frames: list[Any]) -> None:
        ident, body = frames[0], frames[1:]
        try:
            env, msg = self._decoder.decode(body, self._max_frame)
        except TreadleError as e:
            self._reply_error(ident, _header_id(body, self._max_frame), e.code, e.message)
            return
        op = env.op
        if op == "call":
            self._on_call(ident, env.id, env.method, msg, body)
        elif op == "cancel":
            task = self._tasks.get((ident, env.id))
            if task is not None:
                task.cancel()
        else:
            self._reply_error(ident, env.id, "bad_request",
                              f"a server accepts ops 'call' and 'cancel', got {_short(op)}")

    def _on_call(self, ident: bytes, rid: int, method: str, msg: Record | None, body: list[Any]) -> None:
        self._requests += 1
        entry = self._handlers.get(method)
        if entry is None:
            self._on_builtin(ident, rid, method)
            return
        tasks, key = self._tasks, (ident, rid)
        if self._closing or len(tasks) >= self._max_in_flight or key in tasks:
            self._refuse(ident, rid)
            return
        fn, stream = entry
        client_key = body[0].get("User-Id") if self._curve is not None else None
        ctx = RequestContext(rid, method, ident, self.name, client_key)
        if stream:
            self._track(key, ctx, self._loop.create_task(  # type: ignore[union-attr]
                self._serve_stream(key, fn, msg, ctx)))
            return
        try:
            task, out = self._starter.start(  # type: ignore[union-attr]
                fn(msg, ctx), self._serve_call, key, ctx)
        except asyncio.CancelledError:
            frames = self._cancelled_frames(ctx)
        except Exception as e:
            frames = self._exception_frames(e, ctx)
        else:
            if task is not None:  # it waits for something: its task replies when it is done
                self._track(key, ctx, task)
                return
            try:  # it returned without waiting
                frames = self._encode_out(out, ctx, "reply")
            except Exception as e:
                frames = self._exception_frames(e, ctx)
            else:
                self._served += 1
        frames.insert(0, ident)
        self._pump.send(frames)  # type: ignore[union-attr]

    def _on_builtin(self, ident: bytes, rid: int, method: str) -> None:
        builtin = self._builtins.get(method)
        if builtin is None:
            known = sorted({*self._handlers, *self._builtins})
            self._reply_error(ident, rid, "unknown_method",
                              f"server {self.name!r} has no method {_short(method)}; known: {known}")
        else:
            self._send(ident, encode(builtin(), id=rid, op="reply"))
            self._served += 1

    def _refuse(self, ident: bytes, rid: int) -> None:
        if self._closing:
            self._reply_error(ident, rid, "closed", f"server {self.name!r} is shutting down", True)
        elif (ident, rid) in self._tasks:
            self._reply_error(ident, rid, "bad_request", f"request id {rid} is already in flight on this connection")
        else:
            self._reply_error(ident, rid, "busy", f"server {self.name!r} has {len(self._tasks)} requests "
                              f"in flight (max_in_flight={self._max_in_flight}); retry later", True)

    # ---- running handlers ---------------------------------------------------------------

    def _track(self, key: tuple[bytes, int], ctx: RequestContext, task: asyncio.Task[Any]) -> None:
        self._tasks[key] = task
        task.add_done_callback(lambda t: self._untracked(key, ctx, t))

    def _untracked(self, key: tuple[bytes, int], ctx: RequestContext, task: asyncio.Task[Any]) -> None:
        """A task cancelled before its first step never entered ``_serve_*`` (the cancel is
        raised before its ``try``): it is still registered and owes the call its terminal reply."""
        if self._tasks.get(key) is task:
            del self._tasks[key]
            self._send(key[0], self._cancelled_frames(ctx))

    async def _serve_call(self, handler: Awaitable[Any], key: tuple[bytes, int], ctx: RequestContext) -> None:
        try:
            out = await handler
            frames = self._encode_out(out, ctx, "reply")
            self._served += 1
        except asyncio.CancelledError:
            frames = self._cancelled_frames(ctx)
        except Exception as e:
            frames = self._exception_frames(e, ctx)
        finally:
            del self._tasks[key]
        self._send(key[0], frames)

    async def _serve_stream(self, key: tuple[bytes, int], fn: Any, msg: Record | None,
                            ctx: RequestContext) -> None:
        ident = key[0]
        agen = fn(msg, ctx)
        try:
            try:
                async for item in agen:
                    self._send(ident, self._encode_out(item, ctx, "chunk"))
            finally:
                await agen.aclose()
            frames = encode(None, id=ctx.id, op="end")
            self._served += 1
        except asyncio.CancelledError:
            frames = self._cancelled_frames(ctx)
        except Exception as e:
            frames = self._exception_frames(e, ctx)
        finally:
            del self._tasks[key]
        self._send(ident, frames)

    def _encode_out(self, out: Any, ctx: RequestContext, op: str) -> list[Any]:
        if out is None and op == "reply":
            out = _ACK
        try:
            if out is None:
                raise CodecError("None")
            return encode(out, id=ctx.id, op=op)  # raises CodecError for what is not a record
        except TreadleError as e:
            if not isinstance(out, Record):
                raise _BadReply(f"handler {ctx.method!r} produced {type(out).__name__} {_short(out)}; "
                                f"expected a Record") from None
            raise _BadReply(f"cannot encode the {out.wire_name} that {ctx.method!r} produced: {e.message}") from None

    def _cancelled_frames(self, ctx: RequestContext) -> list[Any]:
        why = "during shutdown" if self._closing else "by the client"
        return self._error_frames(ctx.id, "cancelled", f"request {ctx.id} ({ctx.method!r}) was cancelled {why}",
                                  self._closing)

    def _exception_frames(self, e: Exception, ctx: RequestContext) -> list[Any]:
        if isinstance(e, TreadleError) and not isinstance(e, _BadReply):
            return self._error_frames(ctx.id, e.code, e.message or str(e), e.retryable)
        log.error("handler %r of server %r failed (request %d)", ctx.method, self.name, ctx.id, exc_info=e)
        text = str(e) if isinstance(e, _BadReply) else f"handler {ctx.method!r} raised {type(e).__name__}: {e}"
        return self._error_frames(ctx.id, "internal", text[:4000])

    # ---- sending ------------------------------------------------------------------------

    def _send(self, ident: bytes, frames: list[Any]) -> None:
        frames.insert(0, ident)
        self._pump.send(frames)  # type: ignore[union-attr]

    def _error_frames(self, rid: int, code: str, message: str, retryable: bool = False) -> list[Any]:
        self._errors[code] = self._errors.get(code, 0) + 1
        return encode(Error(code=code, message=message, retryable=retryable), id=rid, op="error")

    def _reply_error(self, ident: bytes, rid: int, code: str, message: str, retryable: bool = False) -> None:
        self._send(ident, self._error_frames(rid, code, message, retryable))

    def _on_send_error(self, frames: list[Any], exc: Exception) -> None:
        # The peer is gone (ROUTER_MANDATORY): nobody will read what its requests produce.
        ident = frames[0]
        log.debug("server %r: peer %s unreachable (%s); cancelling its requests", self.name, ident.hex(), exc)
        for (peer, _), task in list(self._tasks.items()):
            if peer == ident:
                task.cancel()

    # ---- built-ins ----------------------------------------------------------------------

    def _health(self) -> Control:
        s = self.stats()
        return Control(op="health", args={k: s[k] for k in ("name", "status", "uptime_s", "in_flight")})

    def _stats_reply(self) -> Control:
        return Control(op="stats", args=self.stats())

    # ---- shutdown -----------------------------------------------------------------------

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop taking work, let in-flight requests finish for ``grace_s``, cancel the rest, close."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            await self._drain_tasks(grace_s)
            if self._starter is not None:
                self._starter.close()
            if self._pump is not None and self._pump.task is not None:
                self._pump.stop()
                done, _ = await asyncio.wait([self._pump.task], timeout=self._linger_s + 1.0)
                if not done:
                    self._pump.task.cancel()
                    await asyncio.wait([self._pump.task])
        finally:
            self._release()
            self._closed.set()
            log.info("rpc server %r closed", self.name)

    async def _drain_tasks(self, grace_s: float) -> None:
        pending = set(self._tasks.values())
        if pending and grace_s > 0:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=max(grace_s, 1.0))
            if stuck:
                log.warning("server %r: %d handlers ignored cancellation", self.name, len(stuck))

    def _release(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._owns_context and self._context is not None:
            self._context.term()
            self._context = None

    def _pump_done(self, task: asyncio.Task[None]) -> None:
        if self._closing:
            return
        if task.cancelled():  # its loop is shutting down without close()
            log.warning("rpc server %r: socket task cancelled before close()", self.name)
        else:
            log.error("rpc server %r: socket task failed", self.name, exc_info=task.exception())
        asyncio.get_running_loop().create_task(self.close(grace_s=0.0))

    async def wait_closed(self) -> None:
        """Return once ``close`` has finished."""
        await self._closed.wait()

    async def __aenter__(self) -> RpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _BadReply(TreadleError):
    """A handler produced something that cannot be sent (reported as ``internal``)."""

    code = "internal"
