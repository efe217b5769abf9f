"""treadle RPC against raw pyzmq, on tcp loopback, in one process and one thread each.

Two pairs, each in one ``benchmark.group`` with ``extra_info["role"]`` "baseline" (raw pyzmq)
or "treadle":

- ``rpc-64MiB``: one 64 MiB uint8 array inside an ``InlineWeights`` update sent with
  ``call`` and acknowledged, vs the same bytes through raw PUSH/PULL (``copy=False`` on both).
- ``rpc-small``: ``REQUESTS`` small round trips with ``WINDOW`` requests outstanding, vs a raw
  DEALER/ROUTER echo keeping the same window and draining both sockets without blocking, as
  treadle's pump does (the baseline); "raw-blocking", a raw loop with one blocking recv per
  message, is shown for context.

Both sides share one ZeroMQ context (one IO thread); the treadle server and client share one
event loop (uvloop's when installed, as ``LoopThread`` uses), so the numbers compare the Python
work per message, not thread hand-offs. Run:
``.venv/bin/python -m pytest tools/bench/test_bench_rpc.py --benchmark-only -m bench``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq

from treadle.common.codec import encode
from treadle.common.records import Ack, Control, InlineWeights
from treadle.common.rpc import RpcClient, RpcServer
from treadle.common.rpc.sync import new_event_loop

PAYLOAD_BYTES = 64 << 20
REQUESTS = 2000
WINDOW = 64
SMALL = Control(op="ping", args={"step": 1})

pytestmark = pytest.mark.bench


async def _put(msg, ctx):
    if msg.tensors[0].nbytes != PAYLOAD_BYTES:
        raise ValueError(f"got {msg.tensors[0].nbytes} bytes")
    return Ack()


async def _echo(msg, ctx):
    return msg


@pytest.fixture(scope="module")
def payload():
    return np.random.default_rng(0).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8)


@pytest.fixture(scope="module")
def treadle_rpc():
    """(loop, client) with an RpcServer serving ``put`` and ``echo`` on the same loop."""
    loop = new_event_loop()
    server = RpcServer(name="bench", handlers={"put": _put, "echo": _echo},
                       max_frame_bytes=2 * PAYLOAD_BYTES)
    endpoint = loop.run_until_complete(server.start())
    client = RpcClient(endpoint, timeout_s=60, max_frame_bytes=2 * PAYLOAD_BYTES)
    yield loop, client
    loop.run_until_complete(client.close())
    loop.run_until_complete(server.close(grace_s=1))
    loop.close()


def _pair(kind_a: int, kind_b: int):
    ctx = zmq.Context.instance()
    a, b = ctx.socket(kind_a), ctx.socket(kind_b)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    return a, b


def test_64mib_raw_push_pull(benchmark, payload):
    pull, push = _pair(zmq.PULL, zmq.PUSH)

    def once():
        push.send(payload, copy=False)
        frame = pull.recv(copy=False)
        assert len(frame) == PAYLOAD_BYTES

    benchmark.group = "rpc-64MiB"
    benchmark.extra_info.update(role="baseline", bytes=PAYLOAD_BYTES)
    try:
        benchmark.pedantic(once, rounds=15, warmup_rounds=2)
    finally:
        push.close()
        pull.close()


def test_64mib_treadle_call(benchmark, payload, treadle_rpc):
    loop, client = treadle_rpc
    update = InlineWeights(version=1, names=["blob"], dtypes=["uint8"], shapes=[[PAYLOAD_BYTES]],
                           tensors=[payload])

    def once():
        assert loop.run_until_complete(client.call("put", update)) == Ack()

    benchmark.group = "rpc-64MiB"
    benchmark.extra_info.update(role="treadle", bytes=PAYLOAD_BYTES)
    benchmark.pedantic(once, rounds=15, warmup_rounds=2)


def test_small_raw_dealer_router(benchmark):
    router, dealer = _pair(zmq.ROUTER, zmq.DEALER)
    request = encode(SMALL, id=1, method="echo")[0]  # the same bytes treadle sends
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(dealer, zmq.POLLIN)

    def window():
        # Event-driven like treadle's pump: wait for either socket, then drain each without
        # blocking. (Blocking recv per message instead is 2-8x slower here and very noisy.)
        for _ in range(WINDOW):
            dealer.send(request)
        sent, done = WINDOW, 0
        while done < REQUESTS:
            poller.poll()
            while True:
                try:
                    ident, msg = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                router.send_multipart([ident, msg])
            while True:
                try:
                    dealer.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                done += 1
                if sent < REQUESTS:
                    dealer.send(request)
                    sent += 1

    benchmark.group = "rpc-small"
    benchmark.extra_info.update(role="baseline", requests=REQUESTS, window=WINDOW)
    try:
        benchmark.pedantic(window, rounds=10, warmup_rounds=1)
    finally:
        router.close()
        dealer.close()


def test_small_raw_blocking_recv(benchmark):
    """For context: the same window with one blocking recv per message (no draining)."""
    router, dealer = _pair(zmq.ROUTER, zmq.DEALER)
    request = encode(SMALL, id=1, method="echo")[0]

    def window():
        for _ in range(WINDOW):
            dealer.send(request)
        sent = WINDOW
        for _ in range(REQUESTS):
            ident, msg = router.recv_multipart()
            router.send_multipart([ident, msg])
            dealer.recv()
            if sent < REQUESTS:
                dealer.send(request)
                sent += 1

    benchmark.group = "rpc-small"
    benchmark.extra_info.update(role="raw-blocking", requests=REQUESTS, window=WINDOW)
    try:
        benchmark.pedantic(window, rounds=10, warmup_rounds=1)
    finally:
        router.close()
        dealer.close()


def test_small_treadle_calls(benchmark, treadle_rpc):
    loop, client = treadle_rpc

    async def worker(n: int) -> None:
        for _ in range(n):
            await client.call("echo", SMALL)

    async def window():
        await asyncio.gather(*(worker(REQUESTS // WINDOW) for _ in range(WINDOW)))

    benchmark.group = "rpc-small"
    benchmark.extra_info.update(role="treadle", requests=REQUESTS, window=WINDOW)
    benchmark.pedantic(lambda: loop.run_until_complete(window()), rounds=10, warmup_rounds=1)
