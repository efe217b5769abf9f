"""The typed clients: light imports, the async client, errors re-raised as treadle exceptions."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from treadle.common.errors import BadRequest, Unauthorized
from treadle.rewards.client import HttpRewardClient, RewardClient, SyncRewardClient
from treadle.rewards.config import HttpConfig, WorkerConfig


def test_client_module_imports_no_heavy_package():
    code = ("import sys, treadle.rewards.client\n"
            "heavy = [m for m in ('torch', 'transformers', 'aiohttp', 'math_verify') if m in sys.modules]\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_async_client_and_errors(serve):
    d = serve(functions=("format",), workers=WorkerConfig(num_workers=1), http=HttpConfig(port=0, token="tok"))

    async def main():
        async with RewardClient(d.daemon.addresses.zmq, timeout_s=30) as c:
            res = await c.score(["<think>a</think><answer>b</answer>", "plain"], key="a")
            health = await c.health()
            return res, health

    res, health = asyncio.run(main())
    assert res.rewards.tolist() == [1.0, 0.0] and health["status"] == "ok"
    with SyncRewardClient(d.daemon.addresses.zmq) as c, pytest.raises(BadRequest, match="different request"):
        c.score(["other"], key="a")
    with pytest.raises(Unauthorized):
        HttpRewardClient(d.daemon.addresses.http).score(["x"])
    with pytest.raises(BadRequest, match="different request"):
        HttpRewardClient(d.daemon.addresses.http, token="tok").score(["other"], key="a")
