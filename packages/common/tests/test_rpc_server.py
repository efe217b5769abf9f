"""RPC server and client over real sockets: replies, streams, concurrency, cancellation, errors."""

from __future__ import annotations

import asyncio
import functools
from contextlib import asynccontextmanager

import msgspec
import numpy as np
import pytest
import zmq

from treadle.common.codec import PROTOCOL_MAJOR, decode, encode
from treadle.common.errors import (
    BadRequest,
    Busy,
    Cancelled,
    FrameTooLarge,
    InternalError,
    RequestTimeout,
    ServiceClosed,
    UnknownMethod,
)
from treadle.common.records import Ack, Control, Error, GenerateRequest, GenerateResult
from treadle.common.rpc import RpcClient, RpcServer

TEST_TIMEOUT_S = 30.0


def async_test(fn):
    """Run an async test in a fresh loop, failing after TEST_TIMEOUT_S instead of hanging."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), TEST_TIMEOUT_S))

    return wrapper


@asynccontextmanager
async def serving(handlers, **server_kw):
    server = RpcServer(name="test", handlers=handlers, **server_kw)
    endpoint = await server.start()
    client = RpcClient(endpoint, timeout_s=10)
    try:
        yield server, client
    finally:
        await client.close()
        await server.close(grace_s=0.5)


async def echo(msg, ctx):
    return msg


def raw_dealer(endpoint):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


async def raw_recv(sock, timeout_s=5.0):
    """Next message on a raw DEALER, decoded; polls so the server's loop keeps running."""
    for _ in range(int(timeout_s / 0.005)):
        if sock.poll(0):
            return decode(sock.recv_multipart())
        await asyncio.sleep(0.005)
    raise AssertionError("no reply within the timeout")


@async_test
async def test_round_trip_with_out_of_band_array():
    prompt = np.arange(5000, dtype=np.int32)  # 20 kB: travels as its own frame

    async def generate(msg, ctx):
        assert ctx.method == "generate" and ctx.id > 0
        return GenerateResult(response_token_ids=msg.prompt_token_ids[::-1].copy(), key=msg.key)

    async with serving({"generate": generate}) as (_, client):
        out = await client.call("generate", GenerateRequest(prompt_token_ids=prompt, key="k1"))
    assert isinstance(out, GenerateResult) and out.key == "k1"
    assert out.response_token_ids.dtype == np.int32
    assert np.array_equal(out.response_token_ids, prompt[::-1])


@async_test
async def test_handler_returning_none_replies_ack_and_call_without_record():
    seen = []

    async def ping(msg, ctx):
        seen.append(msg)

    async with serving({"ping": ping}) as (_, client):
        assert await client.call("ping") == Ack()
    assert seen == [None]


@async_test
async def test_stream_yields_chunks_then_ends():
    async def count(msg, ctx):
        for i in range(msg.args["n"]):
            yield Control(op="item", args={"i": i})

    async with serving({"count": count}) as (server, client):
        got = [x.args["i"] async for x in client.stream("count", Control(op="go", args={"n": 5}))]
        assert got == [0, 1, 2, 3, 4]
        assert [x async for x in client.stream("count", Control(op="go", args={"n": 0}))] == []
        assert server.stats()["served"] == 2


@async_test
async def test_stream_error_after_some_chunks():
    async def flaky(msg, ctx):
        yield Control(op="a")
        raise RuntimeError("disk on fire")

    async with serving({"flaky": flaky}) as (_, client):
        got = []
        with pytest.raises(InternalError, match="disk on fire"):
            async for x in client.stream("flaky"):
                got.append(x.op)
        assert got == ["a"]


@async_test
async def test_thousand_requests_in_flight_on_one_socket():
    n = 1000
    arrived = 0
    all_here = asyncio.Event()
    peak = 0

    async def square(msg, ctx):
        nonlocal arrived, peak
        arrived += 1
        peak = max(peak, server.in_flight)
        if arrived == n:
            all_here.set()
        await all_here.wait()  # nobody answers until all 1000 are being handled at once
        return Control(op="sq", args={"x": msg.args["x"] ** 2, "id": ctx.id})

    async with serving({"square": square}, max_in_flight=n) as (server, client):
        outs = await asyncio.gather(*(client.call("square", Control(op="x", args={"x": i})) for i in range(n)))
        assert [o.args["x"] for o in outs] == [i * i for i in range(n)]
        assert len({o.args["id"] for o in outs}) == n
        assert peak == n
        assert server.in_flight == 0 and client.in_flight == 0


@async_test
async def test_cancelling_the_caller_cancels_the_handler():
    started, handler_cancelled = asyncio.Event(), asyncio.Event()

    async def forever(msg, ctx):
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise

    async with serving({"forever": forever}) as (server, client):
        task = asyncio.create_task(client.call("forever"))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(handler_cancelled.wait(), 5)
        while server.in_flight:
            await asyncio.sleep(0.01)
        assert server.stats()["errors"] == {"cancelled": 1}
        assert await client.call("health")  # the connection still works


@async_test
async def test_cancel_op_gets_cancelled_error_reply():
    started = asyncio.Event()

    async def forever(msg, ctx):
        started.set()
        await asyncio.sleep(3600)

    async with serving({"forever": forever}) as (server, _):
        sock = raw_dealer(server.endpoint)
        try:
            sock.send_multipart(encode(None, id=7, op="call", method="forever"))
            await started.wait()
            sock.send_multipart(encode(None, id=7, op="cancel"))
            reply = await raw_recv(sock)
        finally:
            sock.close()
    assert (reply.id, reply.op, reply.msg.code) == (7, "error", "cancelled")


@async_test
async def test_cancel_that_lands_before_the_handler_task_started_still_gets_a_reply():
    """A call and its cancel read in the same batch: the handler's task is cancelled before its
    first step (it never runs). The call still gets its terminal reply and leaves no task behind
    (found by `make chaos`: the reply was missing and the task stayed registered forever)."""
    async def ticks(msg, ctx):
        yield Ack()

    async with serving({"ticks": ticks}) as (server, _):
        sock = raw_dealer(server.endpoint)
        try:
            for rid in range(1, 41):  # both frames queued before the server drains them
                sock.send_multipart(encode(None, id=rid, op="call", method="ticks"))
                sock.send_multipart(encode(None, id=rid, op="cancel"))
            replies = [await raw_recv(sock) for _ in range(40)]
            while True:  # chunks of streams that ran before their cancel
                terminal = [r for r in replies if r.op in ("end", "error")]
                if len(terminal) == 40:
                    break
                replies.append(await raw_recv(sock))
        finally:
            sock.close()
        assert server.in_flight == 0
    assert sorted(r.id for r in terminal) == list(range(1, 41))
    assert any(r.op == "error" and r.msg.code == "cancelled" for r in terminal)


@async_test
async def test_leaving_a_stream_early_cancels_the_handler():
    handler_cancelled = asyncio.Event()

    async def endless(msg, ctx):
        i = 0
        try:
            while True:
                yield Control(op="n", args={"i": i})
                i += 1
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise

    async with serving({"endless": endless}) as (_, client):
        got = []
        async for x in client.stream("endless"):
            got.append(x.args["i"])
            if len(got) == 3:
                break
        await asyncio.wait_for(handler_cancelled.wait(), 5)
    assert got == [0, 1, 2]


@async_test
async def test_timeout_raises_and_cancels_on_the_server():
    handler_cancelled = asyncio.Event()

    async def slow(msg, ctx):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise

    async with serving({"slow": slow}) as (_, client):
        with pytest.raises(RequestTimeout, match="'slow'.*0.2 s.*TREADLE_RPC_TIMEOUT_S"):
            await client.call("slow", timeout=0.2)
        await asyncio.wait_for(handler_cancelled.wait(), 5)
        assert client.in_flight == 0


@async_test
async def test_busy_beyond_max_in_flight_and_health_still_answers():
    release = asyncio.Event()

    async def hold(msg, ctx):
        await release.wait()
        return Ack(note="done")

    async with serving({"hold": hold}, max_in_flight=2) as (server, client):
        held = [asyncio.create_task(client.call("hold")) for _ in range(2)]
        while server.in_flight < 2:
            await asyncio.sleep(0.005)
        with pytest.raises(Busy, match="max_in_flight=2") as info:
            await client.call("hold")
        assert info.value.retryable
        health = await client.call("health")
        assert health.op == "health" and health.args["in_flight"] == 2
        release.set()
        assert [r.note for r in await asyncio.gather(*held)] == ["done", "done"]
        assert server.stats()["errors"] == {"busy": 1}


@async_test
async def test_unknown_method_names_it():
    async with serving({"echo": echo}) as (_, client):
        with pytest.raises(UnknownMethod, match=r"'nosuch'.*known: \['echo', 'health', 'stats'\]"):
            await client.call("nosuch", Ack())


@async_test
async def test_handler_errors_become_typed_errors_and_serving_continues():
    async def boom(msg, ctx):
        raise ValueError("bad thing 42")

    async def reject(msg, ctx):
        raise BadRequest("prompt too long: 9000 > 4096")

    async def wrong_type(msg, ctx):
        return 12345

    async with serving({"boom": boom, "reject": reject, "wrong": wrong_type, "echo": echo}) as (server, client):
        with pytest.raises(InternalError, match="'boom' raised ValueError: bad thing 42"):
            await client.call("boom")
        with pytest.raises(BadRequest, match="9000 > 4096"):
            await client.call("reject")
        with pytest.raises(InternalError, match="'wrong' produced int 12345"):
            await client.call("wrong")
        assert await client.call("echo", Ack(note="still here")) == Ack(note="still here")
        assert server.stats()["errors"] == {"internal": 2, "bad_request": 1}


@async_test
async def test_health_and_stats():
    async with serving({"echo": echo}) as (server, client):
        await client.call("echo", Ack())
        with pytest.raises(UnknownMethod):
            await client.call("nope")
        health = await client.call("health")
        stats = await client.call("stats")
    assert health == Control(op="health", args={"name": "test", "status": "ok", "uptime_s": health.args["uptime_s"],
                                                "in_flight": 0})
    assert stats.op == "stats" and stats.args["served"] == 2  # echo, health
    assert stats.args["errors"] == {"unknown_method": 1} and stats.args["methods"] == ["echo"]
    assert stats.args["uptime_s"] >= health.args["uptime_s"] >= 0
    assert stats.args["max_in_flight"] == 1024 and stats.args["protocol"] == PROTOCOL_MAJOR


@async_test
async def test_ipc_transport(tmp_path):
    server = RpcServer(name="ipc", endpoint=f"ipc://{tmp_path}/rpc.sock", handlers={"echo": echo})
    endpoint = await server.start()
    assert endpoint == f"ipc://{tmp_path}/rpc.sock"
    try:
        async with RpcClient(endpoint) as client:
            assert await client.call("echo", Ack(note="ipc")) == Ack(note="ipc")
    finally:
        await server.close()


@async_test
async def test_version_mismatch_names_both_versions():
    async with serving({"echo": echo}) as (server, _):
        sock = raw_dealer(server.endpoint)
        try:
            header = msgspec.msgpack.encode({"v": 99, "id": 5, "op": "call", "method": "echo"})
            sock.send_multipart([header])
            reply = await raw_recv(sock)
        finally:
            sock.close()
    assert reply.id == 5 and reply.op == "error" and isinstance(reply.msg, Error)
    assert reply.msg.code == "version_mismatch"
    assert "v99" in reply.msg.message and f"v{PROTOCOL_MAJOR}" in reply.msg.message


@async_test
async def test_wrong_op_is_a_bad_request():
    async with serving({"echo": echo}) as (server, _):
        sock = raw_dealer(server.endpoint)
        try:
            sock.send_multipart(encode(Ack(), id=3, op="reply"))
            reply = await raw_recv(sock)
        finally:
            sock.close()
    assert (reply.id, reply.msg.code) == (3, "bad_request") and "'reply'" in reply.msg.message


@async_test
async def test_oversize_frame_gets_frame_too_large_and_serving_continues():
    async with serving({"echo": echo}, max_frame_bytes=4096) as (server, client):
        big = GenerateRequest(prompt_token_ids=np.zeros(2048, dtype=np.int32))  # an 8192-byte frame
        with pytest.raises(FrameTooLarge, match="8192 bytes; the limit is 4096"):
            await client.call("echo", big)
        small = GenerateRequest(prompt_token_ids=np.zeros(16, dtype=np.int32))
        assert np.array_equal((await client.call("echo", small)).prompt_token_ids, small.prompt_token_ids)
        assert server.stats()["errors"] == {"frame_too_large": 1}


@async_test
async def test_closed_client_raises_service_closed():
    started = asyncio.Event()

    async def slow(msg, ctx):
        started.set()
        await asyncio.sleep(3600)

    async with serving({"slow": slow, "echo": echo}) as (_, client):
        pending = asyncio.create_task(client.call("slow"))
        await started.wait()
        await client.close()
        with pytest.raises(ServiceClosed):
            await pending
        with pytest.raises(ServiceClosed):
            await client.call("echo", Ack())
        with pytest.raises(ServiceClosed):
            async for _ in client.stream("echo"):
                pass


@async_test
async def test_graceful_close_finishes_in_flight_and_refuses_new_work():
    started, finish = asyncio.Event(), asyncio.Event()

    async def work(msg, ctx):
        started.set()
        await finish.wait()
        return Ack(note="finished")

    async with serving({"work": work}) as (server, client):
        call = asyncio.create_task(client.call("work"))
        await started.wait()
        closing = asyncio.create_task(server.close(grace_s=10))
        await asyncio.sleep(0.05)
        with pytest.raises(ServiceClosed, match="shutting down"):
            await client.call("work")
        assert (await client.call("health")).args["status"] == "closing"
        finish.set()
        assert (await call).note == "finished"
        await closing


@async_test
async def test_close_cancels_after_grace_and_client_gets_cancelled():
    handler_cancelled = asyncio.Event()

    async def stuck(msg, ctx):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise

    async with serving({"stuck": stuck}) as (server, client):
        call = asyncio.create_task(client.call("stuck"))
        while not server.in_flight:
            await asyncio.sleep(0.005)
        await server.close(grace_s=0.1)
        assert handler_cancelled.is_set()
        with pytest.raises(Cancelled, match="during shutdown") as info:
            await call
        assert info.value.retryable
