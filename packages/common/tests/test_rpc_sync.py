"""The thread helpers: ServerThread, SyncRpcClient, and the server/client lifecycle rules."""

from __future__ import annotations

import asyncio
import threading

import pytest

from treadle.common.errors import InternalError, RequestTimeout, ServiceClosed, UnknownMethod
from treadle.common.records import Ack, Control
from treadle.common.rpc import LoopThread, RpcClient, RpcServer, ServerThread, SyncRpcClient


async def echo(msg, ctx):
    return msg


async def boom(msg, ctx):
    raise RuntimeError("nope")


async def count(msg, ctx):
    for i in range(msg.args["n"]):
        yield Control(op="i", args={"i": i})


stream_cancelled = threading.Event()


async def endless(msg, ctx):
    try:
        i = 0
        while True:
            yield Control(op="i", args={"i": i})
            i += 1
            await asyncio.sleep(0.001)
    except asyncio.CancelledError:
        stream_cancelled.set()
        raise


@pytest.fixture(scope="module")
def endpoint():
    server = RpcServer(name="sync", handlers={"echo": echo, "boom": boom, "count": count, "endless": endless})
    with ServerThread(server) as thread:
        assert thread.endpoint.startswith("tcp://127.0.0.1:") and thread.endpoint == server.endpoint
        yield thread.endpoint


def test_sync_call_stream_and_errors(endpoint):
    with SyncRpcClient(endpoint, timeout_s=10) as client:
        assert client.call("echo", Ack(note="x")) == Ack(note="x")
        assert [c.args["i"] for c in client.stream("count", Control(op="go", args={"n": 4}))] == [0, 1, 2, 3]
        with pytest.raises(InternalError, match="RuntimeError: nope"):
            client.call("boom")
        with pytest.raises(UnknownMethod):
            client.call("missing")
    with pytest.raises(ServiceClosed):
        client.call("echo", Ack())


def test_sync_stream_left_early_cancels_on_server(endpoint):
    stream_cancelled.clear()
    with SyncRpcClient(endpoint, timeout_s=10) as client:
        for chunk in client.stream("endless"):
            if chunk.args["i"] == 2:
                break
        assert stream_cancelled.wait(5)
        assert client.call("echo", Ack()) == Ack()  # the client still works


def test_sync_client_from_many_threads(endpoint):
    results: list[int] = []
    with SyncRpcClient(endpoint, timeout_s=10) as client:
        def worker(k: int) -> None:
            for j in range(20):
                results.append(client.call("echo", Control(op="x", args={"v": k * 100 + j})).args["v"])

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sorted(results) == sorted(k * 100 + j for k in range(4) for j in range(20))


def test_sync_timeout():
    async def slow(msg, ctx):
        await asyncio.sleep(3600)

    with ServerThread(RpcServer(handlers={"slow": slow})) as thread, SyncRpcClient(thread.endpoint) as client, \
            pytest.raises(RequestTimeout):
        client.call("slow", timeout=0.2)


def test_bind_conflict_names_the_endpoint(endpoint):
    with pytest.raises(OSError, match=f"cannot bind {endpoint}"):
        ServerThread(RpcServer(endpoint=endpoint)).start()


def test_lifecycle_misuse_fails_loudly():
    server = RpcServer()
    with pytest.raises(TypeError, match="async function"):
        server.register("sync", lambda msg, ctx: msg)
    with pytest.raises(ValueError, match="max_in_flight"):
        RpcServer(max_in_flight=0)

    async def main():
        await server.start()
        try:
            with pytest.raises(RuntimeError, match="already started"):
                server.register("late", echo)
            with pytest.raises(RuntimeError, match="already started"):
                await server.start()
            client = RpcClient(server.endpoint)
            with pytest.raises(ValueError, match="timeout must be > 0"):
                await client.call("health", timeout=0)
            assert (await client.call("health", timeout=5)).op == "health"
            await client.close()
        finally:
            await server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_client_is_bound_to_its_first_loop():
    with ServerThread(RpcServer(handlers={"echo": echo})) as thread:
        client = RpcClient(thread.endpoint, timeout_s=10)
        home = LoopThread()
        try:
            assert home.run(client.call("echo", Ack())) == Ack()
            with pytest.raises(RuntimeError, match="bound to the event loop"):
                asyncio.run(client.call("echo", Ack()))
            home.run(client.close())
        finally:
            home.stop()


def test_client_whose_loop_ended_is_closed():
    with ServerThread(RpcServer(handlers={"echo": echo})) as thread:
        client = RpcClient(thread.endpoint, timeout_s=10)
        assert asyncio.run(client.call("echo", Ack())) == Ack()
        assert client.closed
        with pytest.raises(ServiceClosed):
            asyncio.run(client.call("echo", Ack()))


def test_loop_thread_submit_returns_at_once_and_refuses_once_stopped():
    home = LoopThread()
    gate = threading.Event()

    async def wait_for_gate() -> str:
        await asyncio.to_thread(gate.wait)
        return "done"

    try:
        fut = home.submit(wait_for_gate())
        assert not fut.done()  # the caller was not made to wait
        gate.set()
        assert fut.result(timeout=10) == "done"
    finally:
        home.stop()
    coro = wait_for_gate()
    with pytest.raises(ServiceClosed):
        home.submit(coro)
    assert coro.cr_frame is None  # closed, not left to warn "never awaited"
