"""One generate request through the pool, with failover: every sample answered exactly once.

A request first goes whole to one engine (``Router.pick``: least loaded). Each sample is
yielded the moment it arrives, and its index is remembered. If that engine dies (or its engine
breaks) mid-request, the samples already delivered are kept and never sent again; each missing
sample ``i`` is regenerated as its own request with ``n=1`` and seed ``s + i`` (the engines'
rule for sample ``i`` of a seeded request, so a seeded request keeps its meaning), on whichever
engines are least loaded then. Results are deduplicated by index, so a late duplicate from a
dying engine is dropped. After ``max_retries`` engine deaths the request fails with
``EngineDead``; any other error from an engine (a bad request) is re-raised to the caller.

What this module does not do: choose engines or restart them (``Router``, the pool).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from treadle.common.errors import EngineDead, InternalError, ServiceClosed
from treadle.common.records import GenerateRequest, GenerateResult


class Router(Protocol):
    """What a ``Job`` needs from the pool."""

    async def pick(self, n: int, min_version: int) -> Any:
        """An engine handle that takes ``n`` more samples (its ``load`` already raised by ``n``)."""

    def engine_failed(self, handle: Any, exc: BaseException) -> None:
        """``handle``'s worker answered ``EngineDead``: its engine is broken (restart it)."""

    def note_failover(self, samples: int) -> None:
        """``samples`` samples are being regenerated elsewhere."""


@dataclass(slots=True, eq=False)
class Part:
    """A sub-request in flight on one engine: local sample ``j`` is the job's sample ``indices[j]``."""

    sub: GenerateRequest
    indices: tuple[int, ...]
    handle: Any
    left: int  # samples of this part the engine has not returned
    died: bool = False  # set by the pool before it cancels the task: the engine is gone
    task: asyncio.Task[None] | None = field(default=None, repr=False)


def single_sample(req: GenerateRequest, index: int) -> GenerateRequest:
    """Sample ``index`` of ``req`` as a request of its own: n=1, seed s + index (None stays None)."""
    sp = req.sampling
    seed = None if sp.seed is None else sp.seed + index
    return msgspec.structs.replace(req, sampling=msgspec.structs.replace(sp, n=1, seed=seed))


class Job:
    """Runs one request to completion over the pool's engines (``run`` yields each sample once)."""

    def __init__(self, req: GenerateRequest, router: Router, max_retries: int) -> None:
        self.req = req
        self.router = router
        self.max_retries = max_retries
        self.pending = set(range(req.sampling.n))
        self.deaths = 0
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self._parts: set[Part] = set()

    async def run(self) -> AsyncIterator[GenerateResult]:
        try:
            await self._launch(self.req, tuple(range(self.req.sampling.n)))
            while self.pending:
                item = await self._out.get()
                if type(item) is GenerateResult:
                    if item.index in self.pending:
                        self.pending.discard(item.index)
                        yield item
                else:
                    await self._part_done(*item)
        finally:
            for part in self._parts:
                if part.task is not None:
                    part.task.cancel()

    async def _launch(self, sub: GenerateRequest, indices: tuple[int, ...]) -> None:
        handle = await self.router.pick(sub.sampling.n, self.req.min_version)
        part = Part(sub=sub, indices=indices, handle=handle, left=sub.sampling.n)
        part.task = asyncio.get_running_loop().create_task(self._stream(part))
        part.task.add_done_callback(lambda t, p=part: self._out.put_nowait((p, _outcome(t))))
        self._parts.add(part)
        handle.parts.add(part)

    async def _stream(self, part: Part) -> None:
        handle, key = part.handle, self.req.key
        try:
            async for res in handle.stream("generate", part.sub):
                part.left -= 1
                handle.load -= 1
                idx = part.indices[res.index]
                if idx != res.index or res.key != key:
                    res = msgspec.structs.replace(res, index=idx, key=key)
                self._out.put_nowait(res)
        finally:
            handle.load -= part.left
            part.left = 0
            handle.parts.discard(part)

    async def _part_done(self, part: Part, exc: BaseException | None) -> None:
        self._parts.discard(part)
        missing = tuple(i for i in part.indices if i in self.pending)
        engine_lost = part.died or isinstance(exc, (EngineDead, ServiceClosed))
        if not engine_lost:
            if exc is not None:
                raise exc
            if missing:
                raise InternalError(f"engine {part.handle.engine_id} ended request {self.req.key!r} without "
                                    f"samples {list(missing)}")
            return
        if not missing:
            return
        if not part.died and isinstance(exc, EngineDead):
            self.router.engine_failed(part.handle, exc)
        self.deaths += 1
        if self.deaths > self.max_retries:
            raise EngineDead(f"request {self.req.key!r}: {self.deaths} engines died under it "
                             f"(--max_retries {self.max_retries}); last: {exc or part.handle.engine_id}")
        self.router.note_failover(len(missing))
        for i in missing:
            await self._launch(single_sample(self.req, i), (i,))


def _outcome(task: asyncio.Task[None]) -> BaseException | None:
    """The part task's exception; None when it finished or was cancelled."""
    return None if task.cancelled() else task.exception()


async def generate(req: GenerateRequest, router: Router, max_retries: int) -> AsyncIterator[GenerateResult]:
    """Every sample of ``req`` once, in finishing order, surviving up to ``max_retries`` engine deaths."""
    async for res in Job(req, router, max_retries).run():
        yield res
