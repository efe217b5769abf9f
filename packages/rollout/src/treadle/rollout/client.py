"""The typed client of the rollout daemon (``treadle-rollout serve``): async first, plus a sync wrapper.

    async with RolloutClient("tcp://127.0.0.1:5570") as rc:
        results = await rc.generate(prompt_ids, SamplingParams(n=4, max_tokens=256, seed=1))
        async for r in rc.stream(GenerateRequest(...)):   # each sample as it finishes
            ...
        await rc.update_weights(WeightUpdate(version=1, ..., tensors=[...]))       # inline
        spec, group = await rc.join_weight_group("10.0.0.1", 29500, sender=make_group)
        await rc.update_weights(update, send=lambda: send_buckets(group, tensors, sizes))

Every result names the weight version that produced it. Errors arrive as the exceptions of
``treadle.common.errors`` (``Busy``, ``BadRequest``, ``EngineDead``, ...) or their rollout
refinements (``WeightGroupStale``, ``EnginesQuarantined``, ``NoEngine``).

Collective updates: the caller owns the sender's side of the group (it needs torch; this module
does not import it): ``join_weight_group(..., sender=f)`` calls ``f(spec)`` in a thread once the
daemon has accepted the join (``spec`` holds host, port, world_size, rank=0, backend,
timeout_s: what ``GroupSpec`` takes), and ``update_weights(update, send=g)`` calls ``g()`` in a
thread once the daemon has accepted the update. A refused request is refused before either
runs, so a sender never broadcasts into a group nobody receives.

Light on purpose: imports neither torch, vLLM nor transformers (tools/check_imports.py checks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

from treadle.common.errors import BadRequest, TreadleError, UnknownMethod
from treadle.common.log import get_logger
from treadle.common.records import (
    Control,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    WeightUpdate,
)
from treadle.common.rpc import ClientCurve, LoopThread, RpcClient
from treadle.rollout.direct import DirectRoute, is_local
from treadle.rollout.errors import EnginesQuarantined, NoEngine, WeightGroupStale, refine

T = TypeVar("T")
log = get_logger(__name__)
BOOK_TIMEOUT_S = 60.0  # the front end books a direct update's outcome within this
UPDATE_TIMEOUT_S = 1800.0  # a weight load may take long; bounded so a dead daemon is noticed

__all__ = ["EnginesQuarantined", "NoEngine", "RolloutClient", "SyncRolloutClient", "WeightGroupStale",
           "make_request"]


def make_request(prompt: GenerateRequest | Sequence[int] | np.ndarray, sampling: SamplingParams | None = None,
                 *, key: str = "", min_version: int = -1) -> GenerateRequest:
    """A ``GenerateRequest`` from token ids (int32) and sampling parameters (or the request itself)."""
    if isinstance(prompt, GenerateRequest):
        return prompt
    return GenerateRequest(prompt_token_ids=np.asarray(prompt, dtype=np.int32).reshape(-1),
                           sampling=sampling or SamplingParams(), key=key, min_version=min_version)


class RolloutClient:
    """Talks to one rollout daemon; share it between the tasks of one event loop."""

    def __init__(self, endpoint: str, *, curve: ClientCurve | None = None, timeout_s: float | None = None,
                 generate_timeout_s: float = math.inf) -> None:
        """``timeout_s``: control calls (default: the TREADLE_RPC_TIMEOUT_S knob);
        ``generate_timeout_s``: the longest wait for the next sample of a request."""
        self._rpc = RpcClient(endpoint, name="rollout", curve=curve, timeout_s=timeout_s)
        self._generate_timeout = generate_timeout_s
        self.endpoint = self._rpc.endpoint
        self._direct: DirectRoute | None = None  # direct updates: the engines' workers (``direct``)
        self._direct_off = ""  # why this daemon's engines are not updated directly from here
        self._booking: asyncio.Future[None] | None = None  # the front end booking the last direct update

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._booked()
        await self._drop_route()
        await self._rpc.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, msg: Any = None, timeout: float | None = None) -> Any:
        await self._booked()  # what the daemon answers reflects the last direct update
        try:
            return await self._rpc.call(method, msg, timeout=timeout)
        except TreadleError as e:
            raise refine(e) from None

    # ------------------------------------------------------------------ generation

    async def stream(self, prompt: GenerateRequest | Sequence[int] | np.ndarray,
                     sampling: SamplingParams | None = None, *, key: str = "",
                     min_version: int = -1) -> AsyncIterator[GenerateResult]:
        """Yield each sample as it finishes (finishing order; ``result.index`` says which)."""
        req = make_request(prompt, sampling, key=key, min_version=min_version)
        try:
            async for res in self._rpc.stream("generate", req, timeout=self._generate_timeout):
                yield res
        except TreadleError as e:
            raise refine(e) from None

    async def generate(self, prompt: GenerateRequest | Sequence[int] | np.ndarray,
                       sampling: SamplingParams | None = None, *, key: str = "",
                       min_version: int = -1) -> list[GenerateResult]:
        """All ``n`` samples of one request, ordered by index."""
        out = [r async for r in self.stream(prompt, sampling, key=key, min_version=min_version)]
        return sorted(out, key=lambda r: r.index)

    async def generate_many(self, requests: Sequence[GenerateRequest]) -> list[list[GenerateResult]]:
        """Several requests at once (all in flight together); results in request order."""
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    async def prompt_logprobs(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 [P-1]: ``log p(token_t | tokens_<t)`` for t = 1..P-1 on one engine."""
        res = await self._call("prompt_logprobs", make_request(token_ids))
        return np.asarray(res.prompt_logprobs)

    async def abort(self, key: str) -> int:
        """End every in-flight sample of requests with ``key`` (they arrive with finish "abort")."""
        return int((await self._call("abort", Control(op="abort", args={"key": key}))).args["aborted"])

    # ------------------------------------------------------------------ weights

    async def update_weights(self, update: WeightUpdate, *, mode: Literal["wait", "abort"] = "wait",
                             send: Callable[[], Any] | None = None, timeout: float = UPDATE_TIMEOUT_S,
                             direct: bool = False) -> dict[str, Any]:
        """Load ``update`` into every engine; returns ``{"version", "updated", "failed", "loads"}``
        (``loads``: per engine that took it, the wall-clock stamps of its load, ``Engine.last_load``;
        with ``update.ipc_event``, ``events`` too: per engine that answered before its copies
        finished, the handle of the CUDA IPC event recorded after them, to wait on).

        ``mode="wait"``: in-flight samples finish on the old weights first; ``"abort"``: they end
        with finish_reason "abort". A collective update needs ``send`` (the sender's broadcast,
        run in a thread after the daemon accepted the update).

        ``direct``: an inline or cuda_ipc update goes straight to the engines' workers when this
        client runs on the daemon's host, and the daemon is told afterwards (``direct``; the
        report then says ``"direct": True``); elsewhere it is relayed as usual. The daemon keeps
        no weights from it to bring new engines up to date. An update that names its header
        (``header_id``) goes direct without it to the engines that keep it (``DirectRoute``).
        """
        if (update.transport == "collective") != (send is not None):
            raise BadRequest("a collective update needs send= (the sender's broadcast); an inline one must not have it")
        method = "update_weights_abort" if mode == "abort" else "update_weights"
        if direct and send is None:
            begun = time.time()
            route = await self._route()
            if route is not None:
                report, booking, error = await route.update(method, update, timeout, begun)
                self._booking = asyncio.ensure_future(self._book(route, booking))
                if error is not None:
                    raise error
                return report
        on_accepted = None if send is None else (lambda spec: send())
        return (await self._two_step(method, update, on_accepted, timeout))[0]

    async def _route(self) -> DirectRoute | None:
        """The engines' workers to update directly (read from the daemon once, while their
        connections stay up), or None: relay through the daemon."""
        if self._direct is not None:
            if self._direct.usable():
                return self._direct
            await self._drop_route()
        if self._direct_off:
            return None
        if not is_local(self.endpoint):
            self._direct_off = f"the daemon at {self.endpoint} is not on this host"
            return None
        try:
            args = dict((await self._call("weight_route")).args)
        except UnknownMethod:
            self._direct_off = "the daemon does not offer direct updates (an older version)"
            return None
        self._direct = await DirectRoute.open(args)
        if self._direct is None:
            log.info("weights: relaying this update through the daemon at %s: its engines' workers %s do not "
                     "answer from here", self.endpoint, sorted(args.get("engines", {}).values()))
        return self._direct

    async def _book(self, route: DirectRoute, booking: dict[str, Any]) -> None:
        """Tell the daemon what the engines answered a direct update; forget the route when it
        is stale (the pool's engines changed) or the daemon could not book it."""
        try:
            answer = await self._rpc.call("weights_loaded", Control(op="loaded", args=booking), timeout=BOOK_TIMEOUT_S)
            stale = str(answer.args.get("stale", ""))
        except TreadleError as e:
            stale = f"it could not book weight version {booking['version']}: {e}"
            log.warning("weights: the daemon at %s: %s", self.endpoint, stale)
        if stale and self._direct is route:
            log.info("weights: reading the daemon's engines again before the next direct update (%s)", stale)
            await self._drop_route()

    async def _booked(self) -> None:
        """Wait until the daemon has booked the last direct update (a no-op when it has)."""
        booking, self._booking = self._booking, None
        if booking is not None:
            await asyncio.wait([booking])

    async def _drop_route(self) -> None:
        route, self._direct = self._direct, None
        if route is not None:
            await route.close()

    async def join_weight_group(self, host: str, port: int, *, backend: Literal["gloo", "nccl"] = "gloo",
                                timeout_s: float = 120.0,
                                sender: Callable[[dict[str, Any]], T] | None = None) -> tuple[dict[str, Any], T | None]:
        """Have every engine (and the daemon's weight keeper) join the sender's group.

        ``sender(spec)`` builds the sender's side (rank 0, which hosts the TCPStore at
        ``host:port``); it runs in a thread once the daemon accepted. Returns (the daemon's
        ``joined`` answer: world_size, members' ranks, keeper_rank; what ``sender`` returned).
        """
        args = {"host": host, "port": port, "backend": backend, "timeout_s": timeout_s}
        done, made = await self._two_step("join_weight_group", Control(op="join", args=args), sender,
                                          timeout_s + 60.0)
        return done, made

    async def _two_step(self, method: str, msg: Any, on_accepted: Callable[[dict[str, Any]], Any] | None,
                        timeout: float) -> tuple[dict[str, Any], Any]:
        """Stream ``method``: run ``on_accepted(spec)`` in a thread at "accepted"; return the last answer."""
        side: asyncio.Future[Any] | None = None
        final: dict[str, Any] = {}
        await self._booked()
        try:
            async for ctl in self._rpc.stream(method, msg, timeout=timeout):
                if ctl.op == "accepted" and on_accepted is not None:
                    spec = {k: ctl.args[k] for k in ("host", "port", "world_size", "rank", "backend", "timeout_s")
                            if k in ctl.args}
                    side = asyncio.ensure_future(asyncio.to_thread(on_accepted, spec))
                elif ctl.op != "accepted":
                    final = dict(ctl.args)
        except TreadleError as e:
            raise refine(e) from None
        finally:
            if side is not None:  # the sender's collective must end (or time out) before we return
                await asyncio.wait([side])
        return final, (side.result() if side is not None else None)

    async def leave_weight_group(self) -> None:
        await self._call("leave_weight_group")

    async def arm_weights(self, update: WeightUpdate) -> dict[str, Any]:
        """Have the engines get ready for ``update`` (collective, the next version; canary left
        out) before it is sent: they pause and wait for the sender's ``WeightGroup.signal``
        (``Engine.arm_weights``). Returns ``{"version", "armed", "failed"}``."""
        return dict((await self._call("arm_weights", update)).args)

    # ------------------------------------------------------------------ control

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Pause every engine (and release memory where the backend can); per-engine answers."""
        return dict((await self._call("sleep", Control(op="sleep", args={"level": level}))).args)

    async def wake(self) -> dict[str, Any]:
        return dict((await self._call("wake")).args)

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return dict((await self._call("reset_prefix_cache")).args)

    async def weight_digest(self) -> dict[str, str]:
        """Engine id -> digest of its weights (equal digests: bit-identical weights)."""
        return dict((await self._call("weight_digest")).args["engines"])

    async def health(self, timeout: float | None = None) -> dict[str, Any]:
        """{"status": "ok" | "degraded" | "down", "version", "engines", "quarantined", ...}."""
        return dict((await self._call("health", timeout=timeout)).args)

    async def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """Queue depth, samples in flight, tokens/s, and per engine: state, load, version, pid."""
        return dict((await self._call("stats", timeout=timeout)).args)

    async def scale(self, engines: int, timeout: float = 900.0) -> dict[str, Any]:
        """Grow or shrink the pool to ``engines``; returns once newcomers serve / leavers drained."""
        return dict((await self._call("scale", Control(op="scale", args={"engines": engines}), timeout)).args)

    async def wait_ready(self, timeout: float = 600.0, engines: int | None = None) -> dict[str, Any]:
        """Poll ``health`` until every engine (or ``engines`` of them) is ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                h = await self.health(timeout=5.0)
                want = len(h["engines"]) if engines is None else engines
                if h["engines_ready"] >= max(want, 1):
                    return h
            except TreadleError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"rollout daemon at {self.endpoint} not ready within {timeout:g} s")
            await asyncio.sleep(0.2)


class SyncRolloutClient:
    """Blocking ``RolloutClient``: the same methods, run on a background event loop."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        self._lt = LoopThread(name="rollout-client")
        self._client = RolloutClient(endpoint, **kwargs)

    def _run(self, coro: Any) -> Any:
        return self._lt.run(coro)

    def generate(self, *args: Any, **kwargs: Any) -> list[GenerateResult]:
        return self._run(self._client.generate(*args, **kwargs))

    def generate_many(self, requests: Sequence[GenerateRequest]) -> list[list[GenerateResult]]:
        return self._run(self._client.generate_many(requests))

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[GenerateResult]:
        agen = self._client.stream(*args, **kwargs)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self._lt.alive:
                self._run(agen.aclose())

    def submit(self, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Start the ``RolloutClient`` method ``name`` on the loop without waiting: its future
        (a caller that must not block, and must not start a thread only to wait)."""
        return self._lt.submit(getattr(self._client, name)(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        """prompt_logprobs, abort, update_weights, join_weight_group, sleep, wake, stats, ..."""
        method = getattr(self._client, name)
        if not asyncio.iscoroutinefunction(method):
            return method
        return lambda *a, **kw: self._run(method(*a, **kw))

    def close(self) -> None:
        try:
            if self._lt.alive:
                self._run(self._client.close())
        finally:
            self._lt.stop()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
