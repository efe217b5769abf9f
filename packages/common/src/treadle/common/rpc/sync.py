"""Threads for the asyncio RPC layer: a server in the background, a blocking client.

``ServerThread(server).start()`` runs an ``RpcServer`` on its own event loop in a daemon thread
and returns the bound endpoint; ``stop(grace_s)`` closes it. ``SyncRpcClient`` wraps an
``RpcClient`` whose loop runs in a background thread, for programs and tests without asyncio;
it may be called from several threads at once. These loops are uvloop's when uvloop is
installed (``new_event_loop``): small requests cost 10-15% less there.

Not here: the protocol (``server`` / ``client``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import zmq

from treadle.common.errors import ServiceClosed
from treadle.common.records import Record
from treadle.common.rpc.client import RpcClient
from treadle.common.rpc.curve import ClientCurve
from treadle.common.rpc.server import RpcServer

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it is installed, else asyncio's default."""
    try:
        import uvloop  # noqa: PLC0415  (optional; a faster loop for the same code)
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An asyncio event loop (``new_event_loop``) running forever in a daemon thread until ``stop``."""

    def __init__(self, name: str = "treadle-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result; cancels it if the wait is interrupted."""
        if not self.alive:
            coro.close()
            raise ServiceClosed("the event-loop thread has stopped")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result within {timeout} s") from None
        except BaseException:  # KeyboardInterrupt in the waiting thread: stop the work too
            fut.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting: its future."""
        if not self.alive:
            coro.close()
            raise ServiceClosed("the event-loop thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (pending tasks are cancelled) and join the thread."""
        if self.alive:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


class ServerThread:
    """Runs ``server`` in a background thread with its own event loop."""

    def __init__(self, server: RpcServer) -> None:
        self.server = server
        self._lt: LoopThread | None = None
        self.endpoint = ""

    def start(self, timeout_s: float = 30.0) -> str:
        """Bind and serve; returns the endpoint (raises what ``server.start`` raised)."""
        if self._lt is not None:
            raise RuntimeError("ServerThread already started")
        self._lt = LoopThread(name=f"rpc-server:{self.server.name}")
        try:
            self.endpoint = self._lt.run(self.server.start(), timeout=timeout_s)
        except BaseException:
            self._lt.stop()
            raise
        return self.endpoint

    def stop(self, grace_s: float = 5.0) -> None:
        """``server.close(grace_s)``, then end the thread."""
        lt, self._lt = self._lt, None
        if lt is None:
            return
        try:
            if lt.alive:
                lt.run(self.server.close(grace_s), timeout=grace_s * 2 + 10.0)
        finally:
            lt.stop()

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyncRpcClient:
    """A blocking ``RpcClient``: ``call``, ``stream``, ``close``; its loop runs in a thread."""

    def __init__(self, endpoint: str, *, name: str = "", curve: ClientCurve | None = None,
                 timeout_s: float | None = None, max_frame_bytes: int | None = None,
                 context: zmq.Context | None = None, linger_s: float = 0.2) -> None:
        self._client = RpcClient(endpoint, name=name, curve=curve, timeout_s=timeout_s,
                                 max_frame_bytes=max_frame_bytes, context=context, linger_s=linger_s)
        self._lt = LoopThread(name=f"rpc-client:{self._client.name}")

    @property
    def endpoint(self) -> str:
        return self._client.endpoint

    def call(self, method: str, msg: Record | None = None, *, timeout: float | None = None) -> Record:
        """Like ``RpcClient.call``; blocks until the reply, an error, or the timeout."""
        return self._lt.run(self._client.call(method, msg, timeout=timeout))

    def submit(self, method: str, msg: Record | None = None, *,
               timeout: float | None = None) -> concurrent.futures.Future[Record]:
        """Like ``call`` without waiting: the reply's future (``result()`` raises what ``call`` would)."""
        return self._lt.submit(self._client.call(method, msg, timeout=timeout))

    def stream(self, method: str, msg: Record | None = None, *, timeout: float | None = None) -> Iterator[Record]:
        """Like ``RpcClient.stream``; leaving the loop early cancels the request."""
        agen = self._client.stream(method, msg, timeout=timeout)
        try:
            while True:
                try:
                    item = self._lt.run(_anext(agen))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if self._lt.alive:
                self._lt.run(_aclose(agen))

    def close(self) -> None:
        """Close the client (pending calls raise ``ServiceClosed``) and its thread."""
        try:
            if self._lt.alive:
                self._lt.run(self._client.close())
        finally:
            self._lt.stop()

    def __enter__(self) -> SyncRpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _anext(agen: AsyncIterator[T]) -> T:
    return await agen.__anext__()


async def _aclose(agen: Any) -> None:
    await agen.aclose()
