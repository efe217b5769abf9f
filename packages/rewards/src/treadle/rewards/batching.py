"""Dynamic batching: merge concurrent requests' samples into batches for one scorer (asyncio).

``DynamicBatcher(fn, max_batch_size=B, max_wait_s=W, max_concurrency=C)``; ``await
submit(batch)`` returns the ``RewardOutput`` for exactly that batch. Requests larger than B
are cut into pieces of B. Pieces wait in one queue; a batch leaves when the queue holds B
samples, or W seconds after its oldest piece arrived, and only while fewer than C batches
are running. While all C are busy the queue keeps filling, so load makes batches bigger
(that is the point: a reward model scores 32 samples in little more time than 1).

Batches are built from whole pieces, in arrival order, up to B samples. A piece whose caller
went away (cancelled) is dropped before it is scored. ``fn`` should not raise (pools return
failed samples); if it does, the batch's samples fail with its message.

Not here: what scoring means (``workers``, ``rm``), caching (``cache``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

from treadle.rewards.api import RewardBatch, RewardOutput, concat_outputs

Scorer = Callable[[RewardBatch], Awaitable[RewardOutput]]


def concat(batches: list[RewardBatch]) -> RewardBatch:
    return RewardBatch(queries=[q for b in batches for q in b.queries],
                       prompts=[p for b in batches for p in b.prompts],
                       labels=[x for b in batches for x in b.labels])


def slice_output(out: RewardOutput, start: int, stop: int) -> RewardOutput:
    """Samples ``start:stop`` of ``out``."""
    return RewardOutput(
        rewards=out.rewards[start:stop],
        scores=None if out.scores is None else out.scores[start:stop],
        extra_logs={k: v[start:stop] for k, v in out.extra_logs.items()},
        failed=out.failed[start:stop] if out.failed else [],
        errors=out.errors[start:stop] if out.errors else [],
    )


class DynamicBatcher:
    """Batches ``submit`` calls for ``fn``; one instance per scorer, bound to one event loop."""

    def __init__(self, fn: Scorer, *, max_batch_size: int = 64, max_wait_s: float = 0.005,
                 max_concurrency: int = 1, on_batch: Callable[[int], None] | None = None) -> None:
        if max_batch_size < 1 or max_concurrency < 1 or max_wait_s < 0:
            raise ValueError(f"need max_batch_size >= 1, max_concurrency >= 1, max_wait_s >= 0; got "
                             f"{max_batch_size}, {max_concurrency}, {max_wait_s}")
        self.fn = fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._sem = asyncio.Semaphore(max_concurrency)
        self._queue: deque[tuple[RewardBatch, asyncio.Future[RewardOutput], float]] = deque()
        self._queued = 0
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._on_batch = on_batch or (lambda n: None)

    async def submit(self, batch: RewardBatch) -> RewardOutput:
        """Score ``batch`` (possibly together with others' samples)."""
        if len(batch) == 0:
            return RewardOutput(rewards=[])
        b = self.max_batch_size
        pieces = [batch.select(range(i, min(i + b, len(batch)))) for i in range(0, len(batch), b)]
        futures = [self._enqueue(p) for p in pieces]
        try:
            outs = await asyncio.gather(*futures)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return outs[0] if len(outs) == 1 else concat_outputs(list(outs))

    def _enqueue(self, piece: RewardBatch) -> asyncio.Future[RewardOutput]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RewardOutput] = loop.create_future()
        self._queue.append((piece, fut, loop.time()))
        self._queued += len(piece)
        self._wake.set()
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run())
        return fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = self._queue[0][2] + self.max_wait_s - loop.time()
            if self._queued < self.max_batch_size and delay > 0:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            await self._sem.acquire()  # while we wait here, more samples join the next batch
            items = self._take()
            if not items:
                self._sem.release()
                continue
            task = loop.create_task(self._dispatch(items))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _drop_cancelled(self) -> None:
        while self._queue and self._queue[0][1].done():
            self._queued -= len(self._queue.popleft()[0])

    def _take(self) -> list[tuple[RewardBatch, asyncio.Future[RewardOutput]]]:
        items: list[tuple[RewardBatch, asyncio.Future[RewardOutput]]] = []
        size = 0
        while self._queue:
            piece, fut, _ = self._queue[0]
            if items and size + len(piece) > self.max_batch_size:
                break
            self._queue.popleft()
            self._queued -= len(piece)
            if not fut.done():
                items.append((piece, fut))
                size += len(piece)
        return items

    async def _dispatch(self, items: list[tuple[RewardBatch, asyncio.Future[RewardOutput]]]) -> None:
        merged = concat([p for p, _ in items])
        try:
            self._on_batch(len(merged))
            try:
                out = await self.fn(merged)
            except Exception as e:
                out = RewardOutput.failure(len(merged), f"{type(e).__name__}: {e}")
            start = 0
            for piece, fut in items:
                if not fut.done():
                    fut.set_result(slice_output(out, start, start + len(piece)))
                start += len(piece)
        except asyncio.CancelledError:
            for _, fut in items:
                fut.cancel()
            raise
        finally:
            self._sem.release()

    async def close(self) -> None:
        """Stop batching; queued and running requests are cancelled."""
        for task in [self._runner, *self._running]:
            if task is not None:
                task.cancel()
        for _, fut, _ in self._queue:
            fut.cancel()
        self._queue.clear()
        await asyncio.gather(*[t for t in [self._runner, *self._running] if t is not None], return_exceptions=True)
