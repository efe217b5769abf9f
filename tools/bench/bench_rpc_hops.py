#!/usr/bin/env python3
"""Benchmark: what one RPC hop between idle processes costs, as a weight update's hops see it.

A weight sync's request leaves the trainer after its step (the daemon's processes were idle),
goes trainer -> daemon front end -> engine worker and back. Each case here times one small
round trip after ``--idle-ms`` of quiet, with the servers in processes of their own (this file
with ``--serve``), median and 90th percentile of ``--rounds``:

- ``raw``: a blocking pyzmq DEALER -> ROUTER echo (the baseline);
- ``rpc``: treadle's ``RpcClient`` on the caller's event loop -> an ``RpcServer`` echo;
- ``rpc_thread``: the same call from a plain thread through a ``LoopThread`` (as the trainer's
  weight sender calls the rollout client);
- ``relay``: ``rpc_thread`` to a server whose handler calls a second echo server (as the front
  end relays an update to its engine worker);
- ``two_calls``: ``rpc_thread``'s call made twice, one after the other (what a relay's two hops
  would cost without the relay's own work).

    .venv/bin/python tools/bench/bench_rpc_hops.py --rounds 40 --idle-ms 50

Ratios are against ``raw`` in the same run; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _serve(kind: str, endpoint: str, next_endpoint: str) -> None:
    """A server process: ``raw`` (blocking ROUTER echo), ``echo`` or ``relay`` (``RpcServer``)."""
    if kind == "raw":
        import zmq

        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(endpoint)
        while True:
            frames = sock.recv_multipart()
            if frames[-1] == b"stop":
                sock.send_multipart(frames)
                return
            sock.send_multipart(frames)

    from treadle.common.records import Control
    from treadle.common.rpc import RpcClient, RpcServer
    from treadle.common.rpc.sync import new_event_loop

    async def main() -> None:
        stop = asyncio.Event()
        inner = RpcClient(next_endpoint, name="relay") if kind == "relay" else None

        async def echo(msg, ctx):  # noqa: ANN001, ANN202
            if inner is not None:
                return await inner.call("echo", msg)
            return Control(op="echo", args=msg.args)

        async def halt(msg, ctx):  # noqa: ANN001, ANN202
            asyncio.get_running_loop().call_later(0.05, stop.set)

        server = RpcServer(name=kind, endpoint=endpoint, handlers={"echo": echo, "stop": halt})
        await server.start()
        await stop.wait()
        await server.close(grace_s=0.5)
        if inner is not None:
            await inner.close()

    loop = new_event_loop()
    loop.run_until_complete(main())


def _spawn(kind: str, endpoint: str, next_endpoint: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--serve", kind, endpoint, next_endpoint])


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_ms": 1e3 * statistics.median(s), "p90_ms": 1e3 * s[int(0.9 * (len(s) - 1))]}


def run(rounds: int, idle_s: float) -> dict[str, dict[str, float]]:
    import zmq

    from treadle.common.records import Control
    from treadle.common.rpc import LoopThread, RpcClient

    tmp = Path(tempfile.mkdtemp(prefix="treadle-hops-"))
    ep = {k: f"ipc://{tmp}/{k}.sock" for k in ("raw", "echo", "relay")}
    procs = [_spawn("raw", ep["raw"]), _spawn("echo", ep["echo"]), _spawn("relay", ep["relay"], ep["echo"])]
    msg = Control(op="echo", args={"version": 1, "names": ["model.layers.0.mlp.up_proj.weight"] * 8})
    out: dict[str, list[float]] = {k: [] for k in ("raw", "rpc", "rpc_thread", "relay", "two_calls")}
    lt = LoopThread(name="bench-hops")
    try:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(ep["raw"])
        thread_client = RpcClient(ep["echo"], name="thread")
        relay_client = RpcClient(ep["relay"], name="relay-caller")
        loop = asyncio.new_event_loop()
        own_client = RpcClient(ep["echo"], name="own")

        def call(client: RpcClient, method: str = "echo", body: object = msg) -> None:
            asyncio.run_coroutine_threadsafe(client.call(method, body, timeout=30), lt.loop).result()

        def raw_echo(payload: bytes = b"x" * 64) -> None:
            raw.send_multipart([payload])
            raw.recv_multipart()

        for _ in range(3):  # connect every path (servers bind while we start)
            raw_echo()
            loop.run_until_complete(own_client.call("echo", msg, timeout=60))
            call(thread_client)
            call(relay_client)
        for k in range(rounds):
            for case in (out if k % 2 == 0 else reversed(list(out))):
                time.sleep(idle_s)
                start = time.perf_counter()
                if case == "raw":
                    raw_echo()
                elif case == "rpc":
                    loop.run_until_complete(own_client.call("echo", msg, timeout=30))
                elif case == "rpc_thread":
                    call(thread_client)
                elif case == "relay":
                    call(relay_client)
                else:
                    call(thread_client)
                    call(thread_client)
                out[case].append(time.perf_counter() - start)
        raw_echo(b"stop")
        loop.run_until_complete(own_client.call("stop", None, timeout=30))
        call(relay_client, "stop")
        loop.run_until_complete(own_client.close())
        loop.close()
        asyncio.run_coroutine_threadsafe(thread_client.close(), lt.loop).result()
        asyncio.run_coroutine_threadsafe(relay_client.close(), lt.loop).result()
        raw.close(0)
    finally:
        lt.stop()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return {k: _stats(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--idle-ms", type=float, default=50.0, help="quiet before each round trip, ms")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--serve", nargs=3, metavar=("KIND", "ENDPOINT", "NEXT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        _serve(*a.serve)
        return
    from treadle.common.rpc.sync import new_event_loop

    res = run(a.rounds, a.idle_ms / 1e3)
    base = res["raw"]["median_ms"]
    print(f"round trip after {a.idle_ms:g} ms idle, {a.rounds} rounds (event loops: {type(new_event_loop()).__module__})")
    for k, v in res.items():
        print(f"{k:12s} median {v['median_ms']:6.3f} ms  p90 {v['p90_ms']:6.3f} ms  {v['median_ms'] / base:5.2f}x raw")
    if a.json:
        Path(a.json).write_text(json.dumps({"idle_ms": a.idle_ms, "rounds": a.rounds, "results": res}, indent=1))


if __name__ == "__main__":
    main()
