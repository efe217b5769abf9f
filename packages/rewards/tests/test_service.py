"""Combining components: weights, the score component, failures, shaping, provenance."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from treadle.common.errors import BadRequest
from treadle.common.records import RewardRequest, same
from treadle.rewards.api import RewardBatch, RewardOutput
from treadle.rewards.service import Component, RewardService, Shaping


def fixed(out: RewardOutput):
    async def submit(batch: RewardBatch) -> RewardOutput:
        return out
    return submit


def service(outs, weights, **kw) -> RewardService:
    comps = [Component(name=f"c{i}", weight=w, submit=fixed(o), provenance={"kind": "test"})
             for i, (o, w) in enumerate(zip(outs, weights, strict=True))]
    return RewardService(comps, **kw)


BATCH = RewardBatch(queries=["P a<|im_end|>", "P bbbbbbbbbb", "P c"], prompts=["P ", "P ", "P "], labels=[None] * 3)


def test_weights_scores_and_failures_by_hand():
    a = RewardOutput(rewards=[1.0, 0.0, 1.0], scores=[1.0, 0.0, 1.0], extra_logs={"x": [1.0, 2.0, 3.0]})
    b = RewardOutput(rewards=[1.0, 1.0, 0.5], failed=[False, False, True], errors=["", "", "boom"])
    res = service([a, b], [1.0, 0.1], failure_reward=-1.0).combine(BATCH, [a, b], "h")
    # rewards: [1 + 0.1, 0 + 0.1, failed -> -1]; scores: c0's, failed -> -1
    np.testing.assert_allclose(res.rewards, [1.1, 0.1, -1.0], rtol=1e-6)
    np.testing.assert_allclose(res.scores, [1.0, 0.0, -1.0])
    assert res.failed == [False, False, True] and res.errors == ["", "", "c1: boom"]
    assert res.extra_logs["c0/x"] == [1.0, 2.0, 3.0] and res.extra_logs["c1/reward"] == [1.0, 1.0, 0.5]
    assert res.extra_logs["reward_failed"] == [0.0, 0.0, 1.0]
    assert res.provenance["request_sha256"] == "h" and res.provenance["score_from"] == "c0"


def test_score_from_another_component_and_single_component_weight():
    a = RewardOutput(rewards=[2.0, 2.0, 2.0])
    b = RewardOutput(rewards=[0.0, 1.0, 0.0], scores=[0.0, 1.0, 1.0])
    res = service([a, b], [0.5, 1.0], score_from="c1").combine(BATCH, [a, b])
    np.testing.assert_allclose(res.rewards, [1.0, 2.0, 1.0])
    np.testing.assert_allclose(res.scores, [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="names no component"):
        service([a], [1.0], score_from="nope")


def test_shaping_stop_properly_then_overlong():
    a = RewardOutput(rewards=[1.0, 1.0, 1.0])
    shaping = Shaping(overlong_buffer_len=4, max_new_tokens=10, stop_properly_penalty_coef=0.5,
                      stop_texts=("<|im_end|>",))  # lengths in characters: 11, 10, 1
    res = service([a], [1.0], shaping=shaping).combine(BATCH, [a])
    # stopped: [True, False, False] -> [1, 0.5, 0.5]; overlong (expected 6, buffer 4): 11 -> -1, 10 -> -1, 1 -> 0
    np.testing.assert_allclose(res.rewards, [0.0, -0.5, 0.5])
    assert res.extra_logs["stopped"] == [1.0, 0.0, 0.0] and res.extra_logs["overlong_penalty"] == [-1.0, -1.0, 0.0]
    assert res.provenance["shaping"]["overlong_buffer_len"] == 4


def test_score_caches_by_key_and_limits_request_size():
    calls = []

    async def submit(batch):
        calls.append(len(batch))
        return RewardOutput(rewards=[float(len(q)) for q in batch.queries])

    svc = RewardService([Component(name="f", weight=1.0, submit=submit, provenance={})], max_request_samples=3)

    async def main():
        r1 = await svc.score(RewardRequest(queries=["ab", "c"], key="k"))
        r2 = await svc.score(RewardRequest(queries=["ab", "c"], key="k"))
        with pytest.raises(BadRequest, match="at most 3"):
            await svc.score(RewardRequest(queries=["x"] * 4))
        return r1, r2

    r1, r2 = asyncio.run(main())
    assert calls == [2] and same(r1, r2) and r1.rewards.tolist() == [2.0, 1.0]
    exposition = svc.metrics.registry.exposition().decode()
    assert 'treadle_rewards_cache_hits_total 1.0' in exposition
    assert 'treadle_rewards_samples_total{component="f"} 2.0' in exposition
