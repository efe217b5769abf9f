"""Where a single-turn episode's reward comes from: a function file, the reward daemon, or a URL.

``reward_source(ref)`` picks by the reference's form (OpenRLHF's ``--reward.remote_url`` takes
the same three)::

    path/to/reward.py[:fn] | math | format | code   FunctionReward: OpenRLHF's reward_func(queries,
                                                    prompts, labels) or a native function, loaded by
                                                    treadle.rewards.loader, run in this process
                                                    (sync functions in a thread)
    tcp://host:port | ipc://path                    DaemonReward: treadle-rewards serve over ZeroMQ
    http(s)://host:port/get_reward                  HttpReward: OpenRLHF's JSON contract
                                                    {"query", "prompts", "labels"} -> {"rewards",
                                                    "scores", "extra_logs"}

Every source scores one sample per call (the daemon batches concurrent calls itself) and answers
a ``Score``; a failure raises ``RewardFailed`` (the executor records a failed episode).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class RewardFailed(RuntimeError):
    """The reward source could not score a sample."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    """One sample's reward."""

    reward: float
    """Reward used for training."""
    score: float
    """Verifier score (filtering, pass@k); the reward when the source gave none."""
    extra_logs: dict[str, float] = field(default_factory=dict)
    """Per-sample metrics."""


class RewardSource(Protocol):
    async def score(self, query: str, prompt: str, label: Any) -> Score: ...

    async def close(self) -> None: ...


def _first(values: Any) -> float:
    return float(np.asarray(values, dtype=np.float64).reshape(-1)[0])


class FunctionReward:
    """A reward function run in this process (OpenRLHF's ``reward_func`` or a native one)."""

    def __init__(self, ref: str, params: dict[str, Any] | None = None) -> None:
        from treadle.rewards.loader import load, parse_ref  # noqa: PLC0415  (pulls the built-in rewards)

        self.loaded = load(parse_ref(ref, params))
        self.ref = ref

    async def score(self, query: str, prompt: str, label: Any) -> Score:
        from treadle.rewards.api import RewardBatch, normalize_output  # noqa: PLC0415

        fn = self.loaded.fn
        args: tuple[Any, ...] = ((RewardBatch(queries=[query], prompts=[prompt], labels=[label]),)
                                 if self.loaded.native else ([query], [prompt], [label]))
        try:
            out = await fn(*args) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, *args)
            out = normalize_output(out, 1, where=self.ref)
        except Exception as e:
            raise RewardFailed(f"reward function {self.ref}: {type(e).__name__}: {e}") from e
        if out.is_failed(0):
            raise RewardFailed(f"reward function {self.ref}: {out.errors[0] if out.errors else 'failed'}")
        score = out.rewards[0] if out.scores is None else out.scores[0]
        return Score(reward=out.rewards[0], score=score, extra_logs={k: v[0] for k, v in out.extra_logs.items()})

    async def close(self) -> None:
        return None


class DaemonReward:
    """``treadle-rewards serve`` over ZeroMQ (``treadle.rewards.client.RewardClient``)."""

    def __init__(self, endpoint: str, *, timeout_s: float | None = None) -> None:
        from treadle.rewards.client import RewardClient  # noqa: PLC0415

        self.client = RewardClient(endpoint, timeout_s=timeout_s)
        self.endpoint = endpoint

    async def score(self, query: str, prompt: str, label: Any) -> Score:
        res = await self.client.score([query], [prompt], [label])
        if res.failed and res.failed[0]:
            raise RewardFailed(f"reward daemon {self.endpoint}: {res.errors[0] if res.errors else 'failed'}")
        reward = _first(res.rewards)
        score = reward if res.scores is None else _first(res.scores)
        return Score(reward=reward, score=score, extra_logs={k: float(v[0]) for k, v in res.extra_logs.items()})

    async def close(self) -> None:
        await self.client.close()


class HttpReward:
    """A remote reward URL with OpenRLHF's ``/get_reward`` JSON contract (aiohttp, retried)."""

    def __init__(self, url: str, *, timeout_s: float = 180.0, attempts: int = 3) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._session: Any = None

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        import aiohttp  # noqa: PLC0415

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        last: Exception | None = None
        for attempt in range(self.attempts):
            try:
                async with self._session.post(self.url, json=body) as resp:
                    resp.raise_for_status()
                    return await resp.json()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = e
                await asyncio.sleep(0.2 * (attempt + 1))
        raise RewardFailed(f"reward URL {self.url}: {self.attempts} attempts failed: {last}")

    async def score(self, query: str, prompt: str, label: Any) -> Score:
        d = await self._post({"query": [query], "prompts": [prompt], "labels": [label]})
        try:
            reward = _first(d["rewards"])
            score = reward if d.get("scores") is None else _first(d["scores"])
            logs = {str(k): _first(v) for k, v in (d.get("extra_logs") or {}).items()}
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise RewardFailed(f"reward URL {self.url} answered an unreadable body: {e}") from e
        return Score(reward=reward, score=score, extra_logs=logs)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def reward_source(ref: str) -> RewardSource:
    """The source a reference names (see the module docstring)."""
    if ref.startswith(("http://", "https://")):
        return HttpReward(ref)
    if ref.startswith(("tcp://", "ipc://")):
        return DaemonReward(ref)
    return FunctionReward(ref)
