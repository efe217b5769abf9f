"""The daemon at its limits: Busy, a failed canary quarantines, scaling up and down.

Runs against ``tight_daemon`` (one hf engine, 8 samples in flight at most, requests give up
after 3 s without an engine). Leaves it with one engine at weight version 2 (model "b").
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from treadle.common.errors import Busy
from treadle.common.records import InlineWeights, SamplingParams
from treadle.rollout.client import EnginesQuarantined, NoEngine

PROMPT = np.array([5, 6, 7, 8, 9, 10, 11], dtype=np.int32)
CANARY = np.arange(40, 60, dtype=np.int32)


def update_to(version, tensors, canary_logprobs, tolerance=1e-4) -> InlineWeights:
    return InlineWeights(version=version, names=list(tensors), dtypes=["float32"] * len(tensors),
                         shapes=[list(t.shape) for t in tensors.values()], tensors=list(tensors.values()),
                         canary_token_ids=CANARY, canary_logprobs=canary_logprobs.astype(np.float32),
                         canary_tolerance=tolerance)


async def until(pred, timeout=60.0):
    for _ in range(int(timeout / 0.02)):
        if await pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_busy_beyond_the_in_flight_limit(tight_daemon, aio):
    async def scenario(rc):
        big = asyncio.create_task(rc.generate(PROMPT, SamplingParams(n=8, max_tokens=1500, seed=0), key="big"))
        await until(lambda: _stat(rc, "in_flight", 8))
        with pytest.raises(Busy) as busy:
            await rc.generate(PROMPT, SamplingParams(max_tokens=2))
        await rc.abort("big")
        await big
        after = await rc.generate(PROMPT, SamplingParams(max_tokens=2))  # room again
        return busy.value, after, await rc.stats()

    busy, after, stats = tight_daemon.call(aio, scenario)
    assert busy.retryable and "max_in_flight_samples" in str(busy)
    assert len(after) == 1 and stats["in_flight"] == 0
    with urllib.request.urlopen(stats["metrics_url"], timeout=10) as r:  # loopback only
        text = r.read().decode()
    assert stats["metrics_url"].startswith("http://127.0.0.1:")
    assert "treadle_rollout_busy_total 1.0" in text and 'treadle_rollout_engine_load{engine="e0"}' in text


async def _stat(rc, key, value):
    return (await rc.stats())[key] == value


def test_canary_mismatch_quarantines_until_a_good_update(tight_daemon, aio, models, ref, tools):
    b = tools.checkpoint(models["b"])
    good = tools.prompt_logprobs(ref["b"], CANARY)

    async def scenario(rc):
        with pytest.raises(EnginesQuarantined) as bad:
            await rc.update_weights(update_to(1, b, good + 0.5))
        health, stats = await rc.health(), await rc.stats()
        with pytest.raises(NoEngine):  # a quarantined engine takes no work
            await rc.generate(PROMPT, SamplingParams(max_tokens=2))
        with pytest.raises(TimeoutError):  # not ready, but
            await rc.wait_ready(timeout=0.5)
        assert "e0" in (await rc.wait_ready(timeout=30, updatable=True))["quarantined"]  # it takes an update
        report = await rc.update_weights(update_to(2, b, good))
        res = await rc.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        return bad.value, health, stats, report, res, await rc.health()

    bad, health, stats, report, res, healed = tight_daemon.call(aio, scenario)
    assert "e0" in str(bad) and "canary" in str(bad)
    assert health["status"] == "down" and "e0" in health["quarantined"]
    assert stats["engines"][0]["state"] == "quarantined" and stats["version"] == 0
    loads, canary = report.pop("loads"), report.pop("canary")
    assert report == {"version": 2, "updated": ["e0"], "failed": {}}
    assert list(canary) == ["e0"] and 0.0 <= canary["e0"] < 1e-4  # the good update's measured gap
    # the stamps, in order: reached the front end, reached the engine, load started, loaded, canary checked
    assert list(loads) == ["e0"] and loads["e0"]["received"] <= loads["e0"]["called"] <= loads["e0"]["loading"] \
        <= loads["e0"]["loaded"] <= loads["e0"]["done"]
    assert res[0].weight_version == 2
    assert np.abs(tools.logprobs(ref["b"], PROMPT, res[0].response_token_ids, temperature=0.0)
                  - res[0].logprobs).max() <= 1e-4
    assert healed["status"] == "ok" and healed["quarantined"] == {}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treadle.rollout", *args], capture_output=True, text=True,
                          timeout=300, check=True)


def test_scale_up_catches_up_then_scale_down_drains(tight_daemon, aio):
    up = json.loads(cli("scale", "--endpoint", tight_daemon.endpoint, "--engines", "2").stdout)
    status = cli("status", "--endpoint", tight_daemon.endpoint).stdout

    async def scenario(rc):
        stats_up, digests = await rc.stats(), await rc.weight_digest()
        # in flight on the engine that is about to leave: it must finish, not vanish
        reqs = [asyncio.create_task(rc.generate(PROMPT, SamplingParams(max_tokens=64, seed=i), key=f"s{i}"))
                for i in range(4)]
        await asyncio.sleep(0)
        down = await rc.scale(1)
        done = await asyncio.gather(*reqs)
        return stats_up, digests, down, done, await rc.stats()

    stats_up, digests, down, done, stats_down = tight_daemon.call(aio, scenario, timeout=240)
    assert up["added"] == ["e1"] and up["engines"] == 2
    assert status.startswith("status ok  weight version 2  engines ready 2/2")
    assert {(e["engine_id"], e["state"], e["version"]) for e in stats_up["engines"]} == \
        {("e0", "ready", 2), ("e1", "ready", 2)}
    assert len(digests) == 2 and len(set(digests.values())) == 1  # the newcomer got the very same weights
    assert down["removed"] == ["e1"] and down["engines"] == 1
    assert all(len(r) == 1 and r[0].weight_version == 2 for r in done)
    assert [e["engine_id"] for e in stats_down["engines"]] == ["e0"]
