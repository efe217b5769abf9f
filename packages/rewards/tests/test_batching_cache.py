"""Dynamic batching (merging, splitting, concurrency) and the idempotency cache."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from treadle.common.errors import BadRequest
from treadle.common.records import RewardRequest, RewardResult, same
from treadle.rewards.api import RewardBatch, RewardOutput
from treadle.rewards.batching import DynamicBatcher
from treadle.rewards.cache import IdempotencyCache


def batch(*queries: str) -> RewardBatch:
    return RewardBatch(queries=list(queries), prompts=[""] * len(queries), labels=[None] * len(queries))


class Recorder:
    """A scorer that records batch sizes; reward = len(query), logs the batch size."""

    def __init__(self, delay: float = 0.0) -> None:
        self.sizes: list[int] = []
        self.running = self.peak = 0
        self.delay = delay

    async def __call__(self, b: RewardBatch) -> RewardOutput:
        self.sizes.append(len(b))
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.delay)
        self.running -= 1
        return RewardOutput(rewards=[float(len(q)) for q in b.queries], extra_logs={"size": [float(len(b))] * len(b)})


def test_concurrent_requests_are_merged_and_answered_separately():
    async def main():
        rec = Recorder()
        b = DynamicBatcher(rec, max_batch_size=8, max_wait_s=0.05)
        outs = await asyncio.gather(*(b.submit(batch("x" * i, "y")) for i in range(1, 4)))
        await b.close()
        return rec, outs

    rec, outs = asyncio.run(main())
    assert rec.sizes == [6]  # three requests of two samples, one call
    assert [o.rewards for o in outs] == [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]
    assert outs[0].extra_logs == {"size": [6.0, 6.0]}


def test_large_requests_are_split_and_concurrency_is_bounded():
    async def main():
        rec = Recorder(delay=0.02)
        b = DynamicBatcher(rec, max_batch_size=4, max_wait_s=0.0, max_concurrency=2)
        out = await b.submit(batch(*["ab"] * 10))
        await b.close()
        return rec, out

    rec, out = asyncio.run(main())
    assert sorted(rec.sizes) == [2, 4, 4] and rec.peak == 2
    assert out.rewards == [2.0] * 10 and len(out.extra_logs["size"]) == 10


def test_load_grows_batches_while_the_scorer_is_busy():
    async def main():
        rec = Recorder(delay=0.05)
        b = DynamicBatcher(rec, max_batch_size=64, max_wait_s=0.0, max_concurrency=1)
        first = asyncio.ensure_future(b.submit(batch("a")))
        await asyncio.sleep(0.01)  # the first batch is running; the next ten queue up behind it
        rest = [asyncio.ensure_future(b.submit(batch("b"))) for _ in range(10)]
        await asyncio.gather(first, *rest)
        await b.close()
        return rec

    assert asyncio.run(main()).sizes == [1, 10]


def test_a_cancelled_caller_is_not_scored_and_a_raising_scorer_fails_samples():
    async def main():
        rec = Recorder()
        b = DynamicBatcher(rec, max_batch_size=8, max_wait_s=0.05)
        gone = asyncio.ensure_future(b.submit(batch("gone")))
        kept = asyncio.ensure_future(b.submit(batch("kept")))
        await asyncio.sleep(0)
        gone.cancel()
        out = await kept
        await b.close()

        async def boom(_):
            raise RuntimeError("scorer broke")

        bad = DynamicBatcher(boom, max_wait_s=0.0)
        failed = await bad.submit(batch("x"))
        await bad.close()
        return rec, out, failed

    rec, out, failed = asyncio.run(main())
    assert rec.sizes == [1] and out.rewards == [4.0]
    assert failed.failed == [True] and "scorer broke" in failed.errors[0]


def _result(x: float) -> RewardResult:
    return RewardResult(rewards=np.array([x, 0.1], dtype=np.float32), scores=np.array([1.0, 0.0], dtype=np.float32),
                        failed=[False, True], errors=["", "f: boom"], extra_logs={"a": [0.5, 1.5]},
                        provenance={"components": [{"name": "f", "sha256": "ab"}]})


def test_cache_replays_identical_results_and_refuses_reused_keys(tmp_path):
    async def main():
        cache = IdempotencyCache(size=10, path=tmp_path / "cache.jsonl")
        calls = []

        async def compute():
            calls.append(1)
            await asyncio.sleep(0.01)
            return _result(0.3)

        req = RewardRequest(queries=["q1", "q2"], labels=[{"b": 1, "a": 2}, None], key="step1")
        (r1, hit1), (r2, hit2) = await asyncio.gather(cache.get_or_compute(req, compute),
                                                      cache.get_or_compute(req, compute))
        r3, hit3 = await cache.get_or_compute(req, compute)
        with pytest.raises(BadRequest, match="different request"):
            await cache.get_or_compute(RewardRequest(queries=["q1", "other"], key="step1"), compute)
        same_content = RewardRequest(queries=["q1", "q2"], labels=[{"a": 2, "b": 1}, None], key="step1")
        r4, hit4 = await cache.get_or_compute(same_content, compute)  # map key order does not matter
        unkeyed = [await cache.get_or_compute(RewardRequest(queries=["q"]), compute) for _ in range(2)]
        cache.close()
        return calls, (r1, r2, r3, r4), (hit1, hit2, hit3, hit4), unkeyed

    calls, results, hits, unkeyed = asyncio.run(main())
    assert len(calls) == 3  # once for the key (concurrent duplicates wait), twice without a key
    assert hits == (False, True, True, True)
    assert all(same(results[0], r) for r in results)
    assert [h for _, h in unkeyed] == [False, False]

    reloaded = IdempotencyCache(size=10, path=tmp_path / "cache.jsonl")  # a restarted daemon

    async def again():
        return await reloaded.get_or_compute(RewardRequest(queries=["q1", "q2"], labels=[{"b": 1, "a": 2}, None],
                                                           key="step1"), None)

    r, hit = asyncio.run(again())
    assert hit and same(r, results[0])  # bit-identical float32 after the JSON round trip


def test_cache_is_bounded():
    async def main():
        cache = IdempotencyCache(size=2)
        for k in "abc":
            await cache.get_or_compute(RewardRequest(queries=[k], key=k), lambda: _coro(_result(1.0)))
        return cache

    async def _coro(v):
        return v

    assert len(asyncio.run(main())) == 2
