"""A client whose server dies: in-flight requests fail at once with ``ConnectionLost``; the client
reconnects by itself and a restarted server on the same endpoint answers.

The server runs in a child process (``SERVER``) so that it can be killed with SIGKILL, as a
crashed daemon would be: no goodbye on the wire, only the kernel closing its sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys

import pytest

from treadle.common.errors import ConnectionLost, RequestTimeout, ServiceClosed
from treadle.common.records import Ack
from treadle.common.rpc import RpcClient

# The child: "echo" answers at once; "slow" and "ticks" (a stream) say on stdout that they
# started, then hang. Each prints the request's note so the test knows which call arrived.
SERVER = r"""
import asyncio, sys
from treadle.common.records import Ack
from treadle.common.rpc import RpcServer

async def echo(msg, ctx):
    return msg

async def slow(msg, ctx):
    print("started", msg.note, flush=True)
    await asyncio.sleep(3600)

async def ticks(msg, ctx):
    yield Ack(note="first")
    print("started", msg.note, flush=True)
    await asyncio.sleep(3600)

async def main():
    server = RpcServer(endpoint=sys.argv[1], handlers={"echo": echo, "slow": slow, "ticks": ticks})
    await server.start()
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""
NO_TIMEOUT_S = 120.0
"""Far beyond the test's own limit: a call can only end in time through ConnectionLost."""


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def start_server(endpoint: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SERVER, endpoint,
                                                stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    assert await proc.stdout.readline() == b"ready\n"
    return proc


async def kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    await proc.wait()


@contextlib.asynccontextmanager
async def servers(endpoint: str):
    """``await start()`` starts a server on ``endpoint``; every one is killed at the end."""
    started: list[asyncio.subprocess.Process] = []

    async def start() -> asyncio.subprocess.Process:
        started.append(await start_server(endpoint))
        return started[-1]

    try:
        yield start
    finally:
        for proc in started:
            await kill(proc)


@pytest.mark.timeout(30)
def test_killed_server_fails_calls_in_flight_and_a_restarted_one_answers():
    async def main():
        endpoint = free_endpoint()
        async with servers(endpoint) as start, RpcClient(endpoint, timeout_s=NO_TIMEOUT_S) as client:
            first = await start()
            assert await client.call("echo", Ack(note="up")) == Ack(note="up")
            slow = [asyncio.ensure_future(client.call("slow", Ack(note=f"s{i}"), timeout=NO_TIMEOUT_S))
                    for i in range(3)]
            for _ in slow:
                assert (await first.stdout.readline()).startswith(b"started s")
            await kill(first)
            for call in slow:
                with pytest.raises(ConnectionLost, match=f"lost the connection to {endpoint}") as e:
                    await call
                assert e.value.retryable and isinstance(e.value, ServiceClosed)
            assert client.in_flight == 0 and not client.closed

            # Sent while nobody listens: queued by ZeroMQ, answered once a server is back.
            waiting = asyncio.ensure_future(client.call("echo", Ack(note="queued"), timeout=NO_TIMEOUT_S))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await start()
            assert await waiting == Ack(note="queued")
            assert await client.call("echo", Ack(note="again")) == Ack(note="again")

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_stream_in_flight_fails_with_connection_lost():
    async def main():
        endpoint = free_endpoint()
        async with servers(endpoint) as start, RpcClient(endpoint, timeout_s=NO_TIMEOUT_S) as client:
            proc = await start()
            items = []
            with pytest.raises(ConnectionLost):
                async for item in client.stream("ticks", Ack(note="t")):
                    items.append(item)
                    assert await proc.stdout.readline() == b"started t\n"
                    await kill(proc)
            assert items == [Ack(note="first")] and client.in_flight == 0

    asyncio.run(main())


def test_a_server_that_never_came_up_still_times_out():
    # No connection was ever made, so there is nothing to lose: the deadline decides, as before.
    async def main():
        async with RpcClient(free_endpoint()) as client:
            with pytest.raises(RequestTimeout):
                await client.call("echo", Ack(), timeout=0.3)

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_fail_on_disconnect_off_leaves_calls_to_their_timeout():
    # For a client with a better death signal (the rollout pool watches its workers' exits).
    async def main():
        endpoint = free_endpoint()
        async with servers(endpoint) as start, RpcClient(endpoint, fail_on_disconnect=False) as client:
            proc = await start()
            call = asyncio.ensure_future(client.call("slow", Ack(note="s"), timeout=2.0))
            assert await proc.stdout.readline() == b"started s\n"
            await kill(proc)
            with pytest.raises(RequestTimeout):
                await call

    asyncio.run(main())
