"""One rollout engine in its own OS process, served over ZeroMQ to the daemon's front end.

``python -m treadle.rollout.worker SPEC_JSON`` (the pool spawns it; see ``WorkerSpec``) pins
itself to its CPUs, builds one ``Engine`` of the named backend, and serves the engine API on
an ``ipc://`` (or loopback tcp) endpoint, one method per ``Engine`` method:

    generate (stream)           GenerateRequest -> GenerateResult per sample
    prompt_logprobs             GenerateRequest -> GenerateResult(prompt_logprobs=...)
    abort                       Control(args={"key"}) -> Control(args={"aborted"})
    update_weights[_abort]      InlineWeights | IpcWeights -> Control(args={"version", "load"})
    join_weight_group           WeightGroupSpec (this engine's first rank) -> Ack
    receive_weights[_abort]     CollectiveWeights -> Control(args={"version", "load"})
    leave_weight_group, wake, reset_prefix_cache -> Ack
    sleep                       Control(args={"level"}) -> Control(args=SleepState fields)
    weight_digest               -> Control(args={"digest"})
    stats, health               -> Control(args=EngineStats fields + pid)
    close                       -> Ack, then the process exits

On another machine (``--engine_placement ray``) it serves tcp on its node's address with the
CURVE keys the pool made for the run (``WorkerSpec.curve_dir``); only the pool holds the client key.

The ``_abort`` variants pause with ``mode="abort"`` (in-flight samples end "abort") instead of
letting them finish on the old weights. The worker exits when its parent dies (it polls its
parent pid), on SIGTERM, or after ``close``.

What this module does not do: routing, failover, restarts or keeping weights (``pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

PARENT_POLL_S = 1.0  # how often the worker checks that the front end is still alive


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """Everything a worker process needs, passed as JSON on its command line."""

    backend: str  # a key of ``engine.ENGINES``
    engine: dict[str, Any]  # keyword arguments of the backend's config class
    endpoint: str  # where to serve (ipc://, or tcp: loopback, or any address with curve_dir)
    cpus: tuple[int, ...] = ()  # CPU affinity of the whole process; () keeps the inherited one
    parent_pid: int = 0  # exit when this process is gone (0: do not watch)
    env: dict[str, str] = field(default_factory=dict)  # informational: what the pool set for us
    curve_dir: str = ""  # CURVE server keys (server.key_secret, authorized_clients/); "": none

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        d = json.loads(text)
        d["cpus"] = tuple(d.get("cpus", ()))
        return cls(**d)


def engine_config(backend: str, fields: dict[str, Any]) -> Any:
    """The backend's config object from JSON fields (lists become tuples where tuples are meant)."""
    from treadle.rollout.engine import ENGINES

    _, cfg_cls = ENGINES[backend]
    kw = dict(fields)
    if kw.get("eos_token_ids") is not None:
        kw["eos_token_ids"] = tuple(kw["eos_token_ids"])
    return cfg_cls(**kw)


class WorkerService:
    """The RPC handlers: a thin shell over one ``Engine`` (kept apart from process setup)."""

    def __init__(self, engine: Any, stop: asyncio.Event) -> None:
        self.engine = engine
        self._stop = stop

    def handlers(self) -> dict[str, Any]:
        return {
            "generate": self.generate, "prompt_logprobs": self.prompt_logprobs, "abort": self.abort,
            "update_weights": self.update_weights, "update_weights_abort": self.update_weights_abort,
            "join_weight_group": self.join_weight_group, "receive_weights": self.receive_weights,
            "receive_weights_abort": self.receive_weights_abort,
            "leave_weight_group": self.leave_weight_group, "sleep": self.sleep, "wake": self.wake,
            "reset_prefix_cache": self.reset_prefix_cache, "weight_digest": self.weight_digest,
            "stats": self.stats, "health": self.stats, "close": self.close,
        }

    async def generate(self, msg: Any, ctx: Any) -> AsyncIterator[Any]:
        async for res in self.engine.generate(_expect(msg, "GenerateRequest")):
            yield res

    async def prompt_logprobs(self, msg: Any, ctx: Any) -> Any:
        import numpy as np

        from treadle.common.records import GenerateResult

        req = _expect(msg, "GenerateRequest")
        lp = await self.engine.prompt_logprobs(req.prompt_token_ids, req.sampling.temperature)
        return GenerateResult(response_token_ids=np.zeros(0, dtype=np.int32), prompt_logprobs=lp,
                              finish_reason="stop", key=req.key, weight_version=self.engine.weight_version,
                              engine_id=self.engine.engine_id)

    async def abort(self, msg: Any, ctx: Any) -> Any:
        key = str(_expect(msg, "Control").args.get("key", ""))
        return _control("abort", aborted=await self.engine.abort(key))

    async def update_weights(self, msg: Any, ctx: Any, mode: str = "wait") -> Any:
        v = await self.engine.update_weights(_expect(msg, "InlineWeights", "IpcWeights"), mode=mode)
        return _control("update_weights", version=v, load=dict(self.engine.last_load),
                        canary=self.engine.last_canary_gap)

    async def update_weights_abort(self, msg: Any, ctx: Any) -> Any:
        return await self.update_weights(msg, ctx, mode="abort")

    async def join_weight_group(self, msg: Any, ctx: Any) -> None:
        await self.engine.join_weight_group(_expect(msg, "WeightGroupSpec"))

    async def receive_weights(self, msg: Any, ctx: Any, mode: str = "wait") -> Any:
        v = await self.engine.receive_weights(_expect(msg, "CollectiveWeights"), mode=mode)
        return _control("receive_weights", version=v, load=dict(self.engine.last_load),
                        canary=self.engine.last_canary_gap)

    async def receive_weights_abort(self, msg: Any, ctx: Any) -> Any:
        return await self.receive_weights(msg, ctx, mode="abort")

    async def leave_weight_group(self, msg: Any, ctx: Any) -> None:
        await self.engine.leave_weight_group()

    async def sleep(self, msg: Any, ctx: Any) -> Any:
        level = int(msg.args.get("level", 1)) if msg is not None else 1
        return _control("sleep", **asdict(await self.engine.sleep(level)))

    async def wake(self, msg: Any, ctx: Any) -> None:
        await self.engine.wake()

    async def reset_prefix_cache(self, msg: Any, ctx: Any) -> None:
        await self.engine.reset_prefix_cache()

    async def weight_digest(self, msg: Any, ctx: Any) -> Any:
        return _control("weight_digest", digest=await self.engine.weight_digest())

    async def stats(self, msg: Any, ctx: Any) -> Any:
        return _control("stats", pid=os.getpid(), **self.engine.stats().as_dict())

    async def close(self, msg: Any, ctx: Any) -> None:
        # Reply first, then stop: the server's close lets this reply leave.
        asyncio.get_running_loop().call_soon(self._stop.set)


def _expect(msg: Any, *wire_names: str) -> Any:
    from treadle.common.errors import BadRequest

    if msg is None or type(msg).__name__ not in wire_names:
        raise BadRequest(f"expected a {' or '.join(wire_names)}, got {type(msg).__name__}")
    return msg


def _control(op: str, **args: Any) -> Any:
    from treadle.common.records import Control

    return Control(op=op, args=args)


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if os.getppid() != parent:
            stop.set()
            return
        await asyncio.sleep(PARENT_POLL_S)


async def serve(spec: WorkerSpec) -> None:
    """Start the engine, serve it until told to stop, then close both."""
    from treadle.common.log import get_logger
    from treadle.common.rpc import RpcServer
    from treadle.rollout.engine import ENGINES

    log = get_logger("treadle.rollout.worker")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cls, _ = ENGINES[spec.backend]
    engine = cls(engine_config(spec.backend, spec.engine))
    watch = asyncio.create_task(_watch_parent(spec.parent_pid, stop)) if spec.parent_pid else None
    server = None
    try:
        await engine.start()
        service = WorkerService(engine, stop)
        # The front end bounds the work it sends; the server must never answer it "busy".
        curve = None
        if spec.curve_dir:
            from treadle.common.rpc import load_server_keys

            curve = load_server_keys(spec.curve_dir)
        server = RpcServer(name=f"rollout-worker:{engine.engine_id}", endpoint=spec.endpoint,
                           handlers=service.handlers(), max_in_flight=1 << 20, curve=curve)
        await server.start()
        log.info("engine %s (%s, pid %d) serving on %s", engine.engine_id, spec.backend, os.getpid(), spec.endpoint)
        await stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
        if server is not None:
            await server.close(grace_s=1.0)
        await engine.close()


def pin(cpus: tuple[int, ...]) -> None:
    """Restrict this process (and the threads and children it starts later) to ``cpus``."""
    if cpus and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):  # a CPU outside our cgroup: keep the inherited mask
            os.sched_setaffinity(0, set(cpus))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m treadle.rollout.worker SPEC_JSON  (started by the rollout pool)", file=sys.stderr)
        raise SystemExit(2)
    spec = WorkerSpec.from_json(args[0])
    pin(spec.cpus)  # before torch starts its thread pools
    asyncio.run(serve(spec))


if __name__ == "__main__":
    main()
