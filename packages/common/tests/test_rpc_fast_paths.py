"""The RPC layer's fast paths behave like the plain ones they replaced.

Eager first steps of handlers (rpc/_eager.py): what a handler sees must match a real task.
Deadlines of default-timeout calls (kept in call order, not in the heap) still expire.
The codec's StreamDecoder (one-pass decode betting on the last record type) equals ``decode``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import sys

import msgspec
import numpy as np
import pytest

from treadle.common.codec import PROTOCOL_MAJOR, Envelope, StreamDecoder, decode, encode
from treadle.common.errors import CodecError, InternalError, RequestTimeout, VersionMismatch
from treadle.common.records import Ack, Control, Error, GenerateResult, same
from treadle.common.rpc import RpcClient, RpcServer
from treadle.common.rpc._eager import Starter

TEST_TIMEOUT_S = 30.0
REQUEST_TAG: contextvars.ContextVar[str] = contextvars.ContextVar("request_tag", default="unset")


def async_test(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), TEST_TIMEOUT_S))

    return wrapper


async def _finish(aw, outcome: list):
    """A ``then`` for Starter: records the coroutine's result or exception."""
    try:
        outcome.append(("ok", await aw))
    except BaseException as e:  # noqa: BLE001  (the test inspects it)
        outcome.append(("raised", e))


async def _spare_ready(starter: Starter) -> Starter:
    """Let the starter's idle spare task start (it is lent only once it runs)."""
    task, _ = starter.start(_returns(0), _finish, [])  # makes the spare; falls back to a task this once
    await task
    await asyncio.sleep(0)
    return starter


async def _returns(value):
    return value


@async_test
async def test_a_step_that_finishes_returns_the_result_and_makes_no_task():
    starter = await _spare_ready(Starter(asyncio.get_running_loop(), "t"))
    before = len(asyncio.all_tasks())
    assert starter.start(_returns(42), _finish, []) == (None, 42)
    assert len(asyncio.all_tasks()) == before


@async_test
async def test_exceptions_of_the_first_step_reach_the_caller():
    starter = await _spare_ready(Starter(asyncio.get_running_loop(), "t"))

    async def boom():
        raise KeyError("first step")

    with pytest.raises(KeyError, match="first step"):
        starter.start(boom(), _finish, [])


@async_test
async def test_the_current_task_of_the_first_step_carries_the_rest():
    starter = await _spare_ready(Starter(asyncio.get_running_loop(), "t"))
    me = asyncio.current_task()
    seen = []

    async def handler():
        seen.append(asyncio.current_task())
        await asyncio.sleep(0)
        seen.append(asyncio.current_task())
        return "done"

    outcome: list = []
    task, _ = starter.start(handler(), _finish, outcome)
    assert asyncio.current_task() is me  # the caller's task is restored after the step
    await task
    assert seen[0] is seen[1] is task and seen[0] is not me and outcome == [("ok", "done")]


@async_test
async def test_steps_run_in_one_private_copy_of_the_context():
    starter = await _spare_ready(Starter(asyncio.get_running_loop(), "t"))
    seen = []

    async def handler(tag, wait):
        seen.append(REQUEST_TAG.get())
        REQUEST_TAG.set(tag)
        if wait:
            await asyncio.sleep(0)
        seen.append(REQUEST_TAG.get())
        return tag

    assert starter.start(handler("a", False), _finish, []) == (None, "a")
    task, _ = starter.start(handler("b", True), _finish, [])
    await task
    assert seen == ["unset", "a", "unset", "b"] and REQUEST_TAG.get() == "unset"


@async_test
async def test_cancel_before_the_carrier_ran_cancels_what_the_coroutine_waits_on():
    starter = await _spare_ready(Starter(asyncio.get_running_loop(), "t"))
    waited = asyncio.get_running_loop().create_future()
    cleaned = []

    async def handler():
        try:
            await waited
        except asyncio.CancelledError:
            cleaned.append(True)
            raise

    outcome: list = []
    task, _ = starter.start(handler(), _finish, outcome)
    task.cancel()  # the carrier has not run a single step since it was handed the coroutine
    await asyncio.wait([task])
    assert waited.cancelled() and cleaned == [True]
    assert outcome[0][0] == "raised" and isinstance(outcome[0][1], asyncio.CancelledError)


@async_test
async def test_a_first_step_that_cancels_its_own_task_and_waits_sees_the_cancellation():
    starter = await _spare_ready(Starter(asyncio.get_running_loop(), "t"))

    async def handler():
        asyncio.current_task().cancel()
        await asyncio.sleep(30)

    outcome: list = []
    task, _ = starter.start(handler(), _finish, outcome)
    await asyncio.wait([task])
    assert outcome[0][0] == "raised" and isinstance(outcome[0][1], asyncio.CancelledError)
    await _spare_ready(starter)  # and the starter goes on working
    assert starter.start(_returns(7), _finish, []) == (None, 7)


@async_test
async def test_many_suspending_starts_in_a_row_all_finish():
    starter = await _spare_ready(Starter(asyncio.get_running_loop(), "t"))

    async def handler(i):
        await asyncio.sleep(0.001)
        return i

    outcomes = [[] for _ in range(20)]
    tasks = [starter.start(handler(i), _finish, outcomes[i])[0] for i in range(20)]
    await asyncio.gather(*tasks)
    assert [o[0] for o in outcomes] == [("ok", i) for i in range(20)]
    starter.close()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout and TaskGroup are Python 3.11+")
@async_test
async def test_timeouts_and_task_groups_in_handlers_bind_to_the_request_not_the_server():
    """asyncio.timeout and TaskGroup cancel "the current task": it must be the request's."""

    async def with_timeout(msg, ctx):
        try:
            async with asyncio.timeout(0.05):
                await asyncio.sleep(30)
        except TimeoutError:
            return Ack(note="timed out")

    async def with_group(msg, ctx):
        async def fail():
            await asyncio.sleep(0.01)
            raise ValueError("child failed")

        async with asyncio.TaskGroup() as tg:
            tg.create_task(fail())
            tg.create_task(asyncio.sleep(30))

    async def quick(msg, ctx):
        return Ack(note="quick")

    server = RpcServer(name="eager", handlers={"timeout": with_timeout, "group": with_group, "quick": quick})
    client = RpcClient(await server.start(), timeout_s=10)
    try:
        for _ in range(2):
            assert (await client.call("timeout")).note == "timed out"
            with pytest.raises(InternalError, match="TaskGroup"):
                await client.call("group")
            assert (await client.call("quick")).note == "quick"
        health = await client.call("health")
        assert isinstance(health, Control) and health.args["status"] == "ok" and health.args["in_flight"] == 0
    finally:
        await client.close()
        await server.close(grace_s=0.5)


@async_test
async def test_default_timeout_calls_expire_in_order_and_others_still_work():
    release = asyncio.Event()

    async def slow(msg, ctx):
        await release.wait()
        return Ack(note="late")

    async def quick(msg, ctx):
        return Ack(note="quick")

    server = RpcServer(name="deadlines", handlers={"slow": slow, "quick": quick})
    client = RpcClient(await server.start(), timeout_s=0.2)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        calls = [asyncio.create_task(client.call("slow")) for _ in range(3)]
        longer = asyncio.create_task(client.call("slow", timeout=5))  # the heap, not the in-order path
        assert (await client.call("quick")).note == "quick"
        for call in calls:
            with pytest.raises(RequestTimeout, match="'slow'.*0.2 s"):
                await call
        assert 0.15 < loop.time() - t0 < 2.0 and not longer.done()
        release.set()
        assert (await longer).note == "late"
        assert client.in_flight == 0 and not client._in_order and (await client.call("quick")).note == "quick"
    finally:
        await client.close()
        await server.close(grace_s=0.5)


def _frames_of(rec, **kw):
    return [encode(rec, **kw)[0]]


def test_stream_decoder_equals_decode_across_type_switches_and_errors():
    stream = StreamDecoder()
    ok = [Control(op="a", args={"x": 1}), Control(op="b"), Ack(note="n"), Ack(), Control(op="c"),
          Error(code="busy", message="m", retryable=True), GenerateResult(response_token_ids=np.arange(4))]
    one_pass = 0
    for i, rec in enumerate(ok):
        frames = _frames_of(rec, id=i, op="reply")
        env, msg = stream.decode(frames, 1 << 20)
        want = decode(frames)
        assert (env.id, env.op, env.method, env.type) == (want.id, want.op, want.method, rec.wire_name)
        assert same(msg, want.msg) and same(msg, rec)
        one_pass += not isinstance(env, Envelope)  # the bet on the previous type won
    assert one_pass == 2  # the second Control and the second Ack
    stream.decode(_frames_of(Control(op="warm")), None)  # the bet is on Control now
    bad = [
        ([msgspec.msgpack.encode({"v": PROTOCOL_MAJOR + 1, "id": 1, "op": "call", "type": "Control",
                                  "body": {"op": "x"}})], VersionMismatch, "v2"),
        ([msgspec.msgpack.encode({"v": PROTOCOL_MAJOR, "id": 1, "op": "nope", "type": "Control",
                                  "body": {"op": "x"}})], CodecError, "unknown op"),
        ([msgspec.msgpack.encode({"v": PROTOCOL_MAJOR, "id": 1, "op": "call", "type": "Control",
                                  "body": {"op": 5}})], CodecError, "Expected `str`"),
        (_frames_of(Control(op="big", args={"s": "x" * 100})), CodecError, "limit is 50"),
    ]
    for frames, exc, match in bad:
        with pytest.raises(exc, match=match):
            stream.decode(frames, 50 if match == "limit is 50" else None)
        with pytest.raises(exc, match=match):
            decode(frames, max_frame_bytes=50 if match == "limit is 50" else None)


@async_test
async def test_replies_that_are_not_records_or_cannot_be_encoded_are_named():
    async def gives_none_chunk(msg, ctx):
        yield None

    async def unencodable(msg, ctx):
        return GenerateResult(response_token_ids=np.array([object()], dtype=object))

    async def nothing(msg, ctx):
        return None

    server = RpcServer(name="replies", handlers={"chunk": gives_none_chunk, "bad": unencodable, "ack": nothing})
    client = RpcClient(await server.start(), timeout_s=10)
    try:
        with pytest.raises(InternalError, match="'chunk' produced NoneType None; expected a Record"):
            async for _ in client.stream("chunk"):
                pass
        with pytest.raises(InternalError, match="cannot encode the GenerateResult that 'bad' produced"):
            await client.call("bad")
        assert await client.call("ack") == Ack()
    finally:
        await client.close()
        await server.close(grace_s=0.5)
