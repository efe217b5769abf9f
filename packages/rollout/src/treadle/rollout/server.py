"""The rollout daemon's front end: one ZeroMQ ROUTER in front of the engine pool.

Methods (records of ``treadle.common.records``; errors come back as typed ``Error`` replies):

    generate (stream)            GenerateRequest -> one GenerateResult per sample as it finishes
    prompt_logprobs              GenerateRequest -> GenerateResult(prompt_logprobs=[P-1]) at sampling.temperature
    abort                        Control(args={"key"}) -> Control(args={"aborted"})
    update_weights[_abort]       InlineWeights | IpcWeights | CollectiveWeights -> stream:
                                 Control("accepted"), Control("updated", version, updated, failed, loads)
    join_weight_group (stream)   Control(args={host, port, backend, timeout_s})
                                 -> Control("accepted", WeightGroupSpec fields, ranks, keeper_rank),
                                 Control("joined", world_size, members, keeper_rank)
    leave_weight_group           -> Ack
    sleep / wake / reset_prefix_cache / weight_digest -> Control(args={engine id: answer})
    scale                        Control(args={"engines": M}) -> Control(args={added, removed})
    health / stats               -> Control(args=...)

``generate`` admits at most ``--max_in_flight_samples`` samples at once (``Busy`` beyond) and
runs each request through ``dispatch`` (failover, dedupe). A cancelled stream (the client left,
or cancelled) cancels its samples on the engines; ``abort`` ends every sample with that key,
which then arrives with finish_reason "abort". ``update_weights`` pauses each engine while it
loads (in-flight samples finish on the old weights first, or with ``_abort`` end "abort").

What this module does not do: parse flags (``cli``), or manage engines (``pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from treadle.common.errors import BadRequest, Busy, EngineDead, TreadleError
from treadle.common.log import get_logger
from treadle.common.metrics import ServiceMetrics
from treadle.common.records import CollectiveWeights, Control, GenerateRequest, GenerateResult
from treadle.common.rpc import RpcServer, load_server_keys
from treadle.rollout import dispatch
from treadle.rollout.config import ServeConfig
from treadle.rollout.pool import EnginePool
from treadle.rollout.telemetry import PoolMetrics

log = get_logger(__name__)
METRICS_PERIOD_S = 1.0
CONTROL_HEADROOM = 256  # requests beyond the sample limit, so control calls are never "busy"


def _expect(msg: Any, cls: type) -> Any:
    if not isinstance(msg, cls):
        raise BadRequest(f"expected a {cls.__name__}, got {type(msg).__name__}")
    return msg


def _args(msg: Any) -> dict[str, Any]:
    return dict(msg.args) if isinstance(msg, Control) else {}


def _answers(replies: dict[str, Any], op: str, value: Any) -> Control:
    """Fan-out replies as one Control: engine id -> value(reply), and errors by engine id."""
    ok = {k: value(r) for k, r in replies.items() if not isinstance(r, BaseException)}
    errors = {k: str(r) for k, r in replies.items() if isinstance(r, BaseException)}
    if errors and not ok:
        raise EngineDead(f"{op} failed on every engine: {errors}")
    return Control(op=op, args={"engines": ok, "errors": errors})


class RolloutServer:
    """``await start()`` -> endpoint; ``await close()``. One per daemon process."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.service_metrics = ServiceMetrics("rollout") if cfg.metrics_port is not None else None
        self.metrics = PoolMetrics(self.service_metrics)
        self.pool = EnginePool(cfg, self.metrics)
        self.in_flight = 0  # samples admitted and not yet finished
        self.rpc: RpcServer | None = None
        self.metrics_address: tuple[str, int] | None = None
        self._http: Any = None
        self._refresh: asyncio.Task[None] | None = None

    def handlers(self) -> dict[str, Any]:
        return {
            "generate": self.generate, "prompt_logprobs": self.prompt_logprobs, "abort": self.abort,
            "update_weights": self.update_weights, "update_weights_abort": self.update_weights_abort,
            "join_weight_group": self.join_weight_group, "leave_weight_group": self.leave_weight_group,
            "sleep": self.sleep, "wake": self.wake, "reset_prefix_cache": self.reset_prefix_cache,
            "weight_digest": self.weight_digest, "scale": self.scale, "health": self.health,
            "stats": self.stats,
        }

    async def start(self) -> str:
        """Bind (health answers "starting" meanwhile), start every engine, serve metrics."""
        curve = load_server_keys(self.cfg.curve_dir) if self.cfg.curve_dir else None
        self.rpc = RpcServer(name="rollout", endpoint=self.cfg.endpoint, handlers=self.handlers(),
                             max_in_flight=self.cfg.admission_limit + CONTROL_HEADROOM, curve=curve)
        endpoint = await self.rpc.start()
        try:
            await self.pool.start()
            if self.service_metrics is not None:
                self._http, _ = self.service_metrics.serve(self.cfg.metrics_port, host=self.cfg.metrics_host)
                self.metrics_address = self._http.server_address[:2]
            self._refresh = asyncio.create_task(self._refresh_metrics())
        except BaseException:
            await self.close()
            raise
        return endpoint

    async def close(self, grace_s: float = 5.0) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        if self.rpc is not None:
            await self.rpc.close(grace_s=grace_s)
        await self.pool.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    async def _refresh_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_PERIOD_S)
            self.metrics.pool(self.pool.stats(), self.in_flight)
            self.metrics.engines(self.pool.handles.values(), self.pool.version)

    # ------------------------------------------------------------------ generation

    async def generate(self, msg: Any, ctx: Any) -> AsyncIterator[GenerateResult]:
        req = _expect(msg, GenerateRequest)
        n = req.sampling.n
        limit = self.cfg.admission_limit
        if n > limit:
            raise BadRequest(f"n={n} samples exceed the daemon's --max_in_flight_samples {limit}")
        if self.in_flight + n > limit:
            self.metrics.busy.inc()
            raise Busy(f"rollout daemon has {self.in_flight} samples in flight (--max_in_flight_samples "
                       f"{limit}); retry later")
        self.in_flight += n
        self.metrics.requests.inc()
        try:
            async for res in dispatch.generate(req, self.pool, self.cfg.max_retries):
                self.metrics.samples.inc()
                self.metrics.tokens.inc(len(res.response_token_ids))
                yield res
        finally:
            self.in_flight -= n

    async def prompt_logprobs(self, msg: Any, ctx: Any) -> GenerateResult:
        req = _expect(msg, GenerateRequest)
        for attempt in range(self.cfg.max_retries + 1):
            h = await self.pool.pick(1, req.min_version)
            try:
                return await h.call("prompt_logprobs", req)
            except EngineDead:
                if attempt == self.cfg.max_retries:
                    raise
            finally:
                h.load -= 1
        raise AssertionError("unreachable")

    async def abort(self, msg: Any, ctx: Any) -> Control:
        key = str(_args(msg).get("key", ""))
        if not key:
            raise BadRequest("abort needs Control(args={'key': ...}) with the requests' key")
        replies = await self.pool.fan_out("abort", Control(op="abort", args={"key": key}))
        aborted = sum(r.args["aborted"] for r in replies.values() if not isinstance(r, BaseException))
        return Control(op="abort", args={"key": key, "aborted": aborted})

    # ------------------------------------------------------------------ weights

    async def update_weights(self, msg: Any, ctx: Any, mode: str = "wait") -> AsyncIterator[Control]:
        if isinstance(msg, CollectiveWeights):
            async for item in self.pool.weights.update_collective(msg, mode):
                yield item
            return
        self.pool.weights.check(msg)  # refuse before "accepted"
        yield Control(op="accepted", args={"version": msg.version})
        yield Control(op="updated", args=await self.pool.weights.update_fanned(msg, mode))

    async def update_weights_abort(self, msg: Any, ctx: Any) -> AsyncIterator[Control]:
        async for item in self.update_weights(msg, ctx, mode="abort"):
            yield item

    async def join_weight_group(self, msg: Any, ctx: Any) -> AsyncIterator[Control]:
        async for item in self.pool.weights.join(_args(_expect(msg, Control))):
            yield item

    async def leave_weight_group(self, msg: Any, ctx: Any) -> None:
        await self.pool.weights.leave()

    # ------------------------------------------------------------------ control

    async def sleep(self, msg: Any, ctx: Any) -> Control:
        level = _args(msg).get("level", 1)
        # type() and not isinstance(): True is an int too, and int() would accept "2" or 1.5
        if type(level) is not int or level not in (1, 2):
            raise BadRequest(f"sleep needs Control(args={{'level': 1 or 2}}) with an integer level, "
                             f"got level={level!r} ({type(level).__name__})")
        self.pool.sleeping = level
        replies = await self.pool.fan_out("sleep", Control(op="sleep", args={"level": level}))
        return _answers(replies, "sleep", lambda r: dict(r.args))

    async def wake(self, msg: Any, ctx: Any) -> Control:
        self.pool.sleeping = 0
        return _answers(await self.pool.fan_out("wake"), "wake", lambda r: "awake")

    async def reset_prefix_cache(self, msg: Any, ctx: Any) -> Control:
        return _answers(await self.pool.fan_out("reset_prefix_cache"), "reset_prefix_cache", lambda r: "reset")

    async def weight_digest(self, msg: Any, ctx: Any) -> Control:
        return _answers(await self.pool.fan_out("weight_digest"), "weight_digest", lambda r: r.args["digest"])

    async def scale(self, msg: Any, ctx: Any) -> Control:
        engines = _args(msg).get("engines")
        if not isinstance(engines, int) or engines < 1:
            raise BadRequest(f"scale needs Control(args={{'engines': M}}) with M >= 1, got {engines!r}")
        try:
            return Control(op="scale", args=await self.pool.scale(engines))
        except TreadleError:
            raise
        except Exception as e:  # a newcomer that failed to start: say which and why
            raise EngineDead(f"scale to {engines} engines failed: {e}") from e

    async def health(self, msg: Any, ctx: Any) -> Control:
        return Control(op="health", args={**self.pool.health(), "in_flight": self.in_flight})

    async def stats(self, msg: Any, ctx: Any) -> Control:
        s = self.pool.stats()
        s.update(in_flight=self.in_flight, queue_depth=max(0, self.in_flight - s["running"]),
                 max_in_flight_samples=self.cfg.admission_limit,
                 metrics_url=f"http://{self.metrics_address[0]}:{self.metrics_address[1]}/metrics"
                 if self.metrics_address else "")
        if self.rpc is not None:
            with contextlib.suppress(Exception):
                s["rpc"] = {k: v for k, v in self.rpc.stats().items() if k in ("requests", "served", "errors")}
        return Control(op="stats", args=s)
