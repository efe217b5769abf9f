"""The typed client of the rollout daemon (``treadle-rollout serve``): async first, plus a sync wrapper.

    async with RolloutClient("tcp://127.0.0.1:5570") as rc:
        results = await rc.generate(prompt_ids, SamplingParams(n=4, max_tokens=256, seed=1))
        async for r in rc.stream(GenerateRequest(...)):   # each sample as it finishes
            ...
        await rc.update_weights(InlineWeights(version=1, ..., tensors=[...]))
        joined, group = await rc.join_weight_group("10.0.0.1", 29500, sender=WeightGroup)
        await rc.update_weights(CollectiveWeights(..., group=group.spec), send=broadcast_buckets)

Every result names the weight version that produced it. Errors arrive as the exceptions of
``treadle.common.errors``, recognised by their wire code (``Busy``, ``BadRequest``,
``EngineDead``, ``WeightGroupStale``, ``NoWeightGroup``, ``EnginesQuarantined``, ``NoEngine``, ...).

Collective updates: the caller owns the sender's side of the group (it needs torch; this module
does not import it): ``join_weight_group(..., sender=f)`` calls ``f(spec)`` in a thread once the
daemon has accepted the join (``spec``: the ``WeightGroupSpec`` of rank 0, the sender), and
``update_weights(update, send=g)`` calls ``g()`` in a thread once the daemon has accepted the
update. A refused request is refused before either runs, so a sender never broadcasts into a
group nobody receives.

Light on purpose: imports neither torch, vLLM nor transformers (tools/check_imports.py checks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

from treadle.common.errors import (
    BadRequest,
    EnginesQuarantined,
    NoEngine,
    NoWeightGroup,
    TreadleError,
    WeightGroupStale,
)
from treadle.common.records import (
    CollectiveWeights,
    Control,
    GenerateRequest,
    GenerateResult,
    InlineWeights,
    IpcWeights,
    SamplingParams,
    WeightGroupSpec,
)
from treadle.common.rpc import ClientCurve, LoopThread, RpcClient

T = TypeVar("T")
UPDATABLE_STATES = ("ready", "quarantined", "behind")
"""Engine states a weight update goes to: loaded, at this version or not (a good update heals a
quarantined engine and brings one behind up to date)."""
UPDATE_TIMEOUT_S = 1800.0  # a weight load may take long; bounded so a dead daemon is noticed

__all__ = ["EnginesQuarantined", "NoEngine", "NoWeightGroup", "RolloutClient", "SyncRolloutClient",
           "WeightGroupStale", "make_request"]


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

    async def close(self) -> None:
        await self._rpc.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, msg: Any = None, timeout: float | None = None) -> Any:
        return await self._rpc.call(method, msg, timeout=timeout)

    # ------------------------------------------------------------------ generation

    async def stream(self, prompt: GenerateRequest | Sequence[int] | np.ndarray,
                     sampling: SamplingParams | None = None, *, key: str = "",
                     min_version: int = -1) -> AsyncIterator[GenerateResult]:
        """Yield each sample as it finishes (finishing order; ``result.index`` says which)."""
        req = make_request(prompt, sampling, key=key, min_version=min_version)
        async for res in self._rpc.stream("generate", req, timeout=self._generate_timeout):
            yield res

    async def generate(self, prompt: GenerateRequest | Sequence[int] | np.ndarray,
                       sampling: SamplingParams | None = None, *, key: str = "",
                       min_version: int = -1) -> list[GenerateResult]:
        """All ``n`` samples of one request, ordered by index."""
        out = [r async for r in self.stream(prompt, sampling, key=key, min_version=min_version)]
        return sorted(out, key=lambda r: r.index)

    async def generate_many(self, requests: Sequence[GenerateRequest]) -> list[list[GenerateResult]]:
        """Several requests at once (all in flight together); results in request order."""
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    async def prompt_logprobs(self, token_ids: Sequence[int] | np.ndarray, temperature: float = 1.0) -> np.ndarray:
        """float32 [P-1]: ``log p(token_t | tokens_<t)`` for t = 1..P-1 on one engine, at
        ``temperature`` (logits divided by it; the hf backend only, vLLM's are temperature 1)."""
        res = await self._call("prompt_logprobs", make_request(token_ids, SamplingParams(temperature=temperature)))
        return np.asarray(res.prompt_logprobs)

    async def prompt_logprobs_many(self, sequences: Sequence[Sequence[int] | np.ndarray],
                                   temperature: float = 1.0) -> list[np.ndarray]:
        """``prompt_logprobs`` of several sequences at once (all in flight, spread over the
        engines); results in order."""
        return list(await asyncio.gather(*(self.prompt_logprobs(s, temperature) for s in sequences)))

    async def abort(self, key: str) -> int:
        """End every in-flight sample of requests with ``key`` (they arrive with finish "abort")."""
        return int((await self._call("abort", Control(op="abort", args={"key": key}))).args["aborted"])

    # ------------------------------------------------------------------ weights

    async def update_weights(self, update: InlineWeights | IpcWeights | CollectiveWeights, *,
                             mode: Literal["wait", "abort"] = "wait", send: Callable[[], Any] | None = None,
                             timeout: float = UPDATE_TIMEOUT_S) -> dict[str, Any]:
        """Load ``update`` into every engine; returns ``{"version", "updated": [engine ids],
        "failed": {engine id: why}, "loads": {engine id: stamps}}`` (stamps: wall-clock times of
        that engine's load: ``received`` by the daemon, then ``Engine.last_load``'s ``called``,
        ``loading``, ``loaded``, ``done``).

        ``mode="wait"``: in-flight samples finish on the old weights first; ``"abort"``: they end
        with finish_reason "abort". A collective update needs ``send`` (the sender's broadcast,
        run in a thread after the daemon accepted the update); the others must not have it.
        Raises ``EnginesQuarantined`` when an engine's canary failed, ``WeightGroupStale`` /
        ``NoWeightGroup`` (collective, before anything was sent), or the engines' error when
        none loaded it.
        """
        if isinstance(update, CollectiveWeights) != (send is not None):
            raise BadRequest("a collective update needs send= (the sender's broadcast); an inline or cuda_ipc one "
                             "must not have it")
        method = "update_weights_abort" if mode == "abort" else "update_weights"
        on_accepted = None if send is None else (lambda spec: send())
        return (await self._two_step(method, update, on_accepted, timeout))[0]

    async def join_weight_group(self, host: str, port: int, *, backend: Literal["gloo", "nccl"] = "gloo",
                                timeout_s: float = 120.0, sender: Callable[[WeightGroupSpec], T] | None = None,
                                ) -> tuple[dict[str, Any], T | None]:
        """Have every engine (and the daemon's weight keeper) join the sender's group.

        ``sender(spec)`` builds the sender's side (``spec``: rank 0, which hosts the TCPStore at
        ``host:port``, and the group's world size); it runs in a thread once the daemon accepted.
        Returns (the daemon's ``joined`` answer: ``world_size``, ``members`` {engine id: first
        rank}, ``keeper_rank``; what ``sender`` returned).
        """
        args = {"host": host, "port": port, "backend": backend, "timeout_s": timeout_s}
        return await self._two_step("join_weight_group", Control(op="join", args=args), sender, timeout_s + 60.0)

    async def _two_step(self, method: str, msg: Any, on_accepted: Callable[[WeightGroupSpec], Any] | None,
                        timeout: float) -> tuple[dict[str, Any], Any]:
        """Stream ``method``: run ``on_accepted(spec)`` in a thread at "accepted"; return the last answer."""
        side: asyncio.Future[Any] | None = None
        final: dict[str, Any] = {}
        try:
            async for ctl in self._rpc.stream(method, msg, timeout=timeout):
                if ctl.op == "accepted" and on_accepted is not None:
                    side = asyncio.ensure_future(asyncio.to_thread(on_accepted, _spec(ctl.args)))
                elif ctl.op != "accepted":
                    final = dict(ctl.args)
        finally:
            if side is not None:  # the sender's collective must end (or time out) before we return
                await asyncio.wait([side])
        return final, (side.result() if side is not None else None)

    async def leave_weight_group(self) -> None:
        await self._call("leave_weight_group")

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

    async def wait_ready(self, timeout: float = 600.0, engines: int | None = None, *,
                         updatable: bool = False) -> dict[str, Any]:
        """Poll ``health`` until every engine (or ``engines`` of them) is ready; ``updatable``:
        loaded and able to take a weight update (ready, quarantined by a failed canary, or behind),
        for a sender about to bring them all to its weights (a good update heals a quarantined one)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                h = await self.health(timeout=5.0)
                want = len(h["engines"]) if engines is None else engines
                have = sum(s in UPDATABLE_STATES for s in h["engines"].values()) if updatable else h["engines_ready"]
                if have >= max(want, 1):
                    return h
            except TreadleError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"rollout daemon at {self.endpoint} not ready within {timeout:g} s")
            await asyncio.sleep(0.2)


def _spec(args: dict[str, Any]) -> WeightGroupSpec:
    """The sender's ``WeightGroupSpec`` from the daemon's "accepted" answer."""
    fields = {k: args[k] for k in WeightGroupSpec.__struct_fields__ if k in args}
    try:
        return msgspec.convert(fields, WeightGroupSpec)
    except msgspec.ValidationError as e:
        raise BadRequest(f"the daemon accepted with a group the sender cannot join: {e}") from None


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
