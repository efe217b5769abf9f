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

Several sources (``reward_sources(refs, reduce=...)``, ``--reward.remote_url a,b``) make one
``CombinedReward``: ``sum`` / ``mean`` score every sample with every source and combine them,
``spread`` treats them as replicas and deals the samples out in turn (``CombinedReward``).

Every source scores one sample per call (the daemon batches concurrent calls itself) and answers
a ``Score``; a failure raises ``RewardFailed`` (the executor records a failed episode). The two
remote sources retry what may pass (the daemon killed and restarted, a timeout, ``Busy``, an HTTP
5xx or a dropped connection) for up to ``retry_s`` seconds, each attempt limited to ``timeout_s``;
the daemon gets the same idempotency key on every attempt, so a sample it already scored is
answered from its cache instead of scored twice.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

log = logging.getLogger(__name__)

TIMEOUT_S = 60.0
"""Default limit of one attempt at a remote reward."""
RETRY_S = 600.0
"""Default time a remote reward is retried before the sample counts as failed."""


class RewardFailed(RuntimeError):
    """The reward source could not score a sample."""


def backoff_s(attempt: int, first: float = 0.5, cap: float = 5.0) -> float:
    """Wait before retry number ``attempt`` (1, 2, ...): ``min(cap, first * 2**(attempt-1))``."""
    return min(cap, first * 2.0 ** (attempt - 1))


async def retrying(call: Callable[[], Awaitable[Any]], *, retry_s: float, what: str,
                   retryable: Callable[[BaseException], bool]) -> Any:
    """``await call()``, again after a back-off while it raises a ``retryable`` error and fewer
    than ``retry_s`` seconds have passed; then ``RewardFailed`` naming ``what`` and the last error."""
    deadline = time.monotonic() + retry_s
    attempt = 0
    while True:
        try:
            return await call()
        except Exception as e:
            attempt += 1
            wait = backoff_s(attempt)
            if not retryable(e) or time.monotonic() + wait > deadline:
                tries = f"after {attempt} attempt(s) over {retry_s:g} s" if retryable(e) else "(not retryable)"
                raise RewardFailed(f"{what} {tries}: {type(e).__name__}: {e}") from e
            log.warning("%s: attempt %d failed (%s: %s); retrying in %.1f s", what, attempt, type(e).__name__, e, wait)
            await asyncio.sleep(wait)


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
    """``treadle-rewards serve`` over ZeroMQ (``treadle.rewards.client.RewardClient``), retried."""

    def __init__(self, endpoint: str, *, timeout_s: float = TIMEOUT_S, retry_s: float = RETRY_S,
                 curve: Any = None) -> None:
        from treadle.rewards.client import RewardClient  # noqa: PLC0415

        self.client = RewardClient(endpoint, timeout_s=timeout_s, curve=curve)
        self.endpoint = endpoint
        self.retry_s = retry_s

    async def score(self, query: str, prompt: str, label: Any) -> Score:
        key = uuid.uuid4().hex  # one per sample, kept across attempts (the daemon's idempotency cache)
        res = await retrying(lambda: self.client.score([query], [prompt], [label], key=key),
                             retry_s=self.retry_s, what=f"reward daemon {self.endpoint}",
                             retryable=lambda e: bool(getattr(e, "retryable", False)) and not self.client.closed)
        if res.failed and res.failed[0]:
            raise RewardFailed(f"reward daemon {self.endpoint}: {res.errors[0] if res.errors else 'failed'}")
        reward = _first(res.rewards)
        score = reward if res.scores is None else _first(res.scores)
        return Score(reward=reward, score=score, extra_logs={k: float(v[0]) for k, v in res.extra_logs.items()})

    async def close(self) -> None:
        await self.client.close()


def _http_retryable(e: BaseException) -> bool:
    """Connection errors, timeouts and 5xx may pass on a retry; a 4xx (our request is wrong) won't."""
    import aiohttp  # noqa: PLC0415

    if isinstance(e, aiohttp.ClientResponseError):
        return e.status >= 500 or e.status == 429
    return isinstance(e, (aiohttp.ClientError, asyncio.TimeoutError))


class HttpReward:
    """A remote reward URL with OpenRLHF's ``/get_reward`` JSON contract (aiohttp, retried)."""

    def __init__(self, url: str, *, timeout_s: float = TIMEOUT_S, retry_s: float = RETRY_S,
                 token: str | None = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: Any = None

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        import aiohttp  # noqa: PLC0415

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  headers=self._headers)

        async def once() -> dict[str, Any]:
            async with self._session.post(self.url, json=body) as resp:
                resp.raise_for_status()
                return await resp.json()

        return await retrying(once, retry_s=self.retry_s, what=f"reward URL {self.url}", retryable=_http_retryable)

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


Reduce = Literal["sum", "mean", "spread"]
"""How ``CombinedReward`` makes one reward of several sources."""


def combine(scores: Sequence[Score], reduce: Literal["sum", "mean"]) -> Score:
    """One ``Score`` of every source's (``n`` >= 1) for one sample: reward and score are
    ``sum_i x_i`` (sum) or ``sum_i x_i / n`` (mean) over the sources (OpenRLHF's ``reward_fn``
    was ``torch.stack(rewards).sum(0)``). ``extra_logs``: source ``i``'s own reward and score as
    ``reward/source<i>`` and ``score/source<i>``; the names the sources logged, as given, except
    a name several sources logged, which goes under ``<name>/source<i>`` for each."""
    n = len(scores)
    div = 1.0 if reduce == "sum" else float(n)
    logs: dict[str, float] = {}
    given = collections.Counter(k for s in scores for k in s.extra_logs)
    for i, s in enumerate(scores):
        logs[f"reward/source{i}"], logs[f"score/source{i}"] = s.reward, s.score
        logs.update({(k if given[k] == 1 else f"{k}/source{i}"): v for k, v in s.extra_logs.items()})
    return Score(reward=sum(s.reward for s in scores) / div, score=sum(s.score for s in scores) / div,
                 extra_logs=logs)


class CombinedReward:
    """Several reward sources as one (``--reward.remote_url a,b,...``).

    ``sum`` / ``mean``: every source scores every sample, concurrently, and ``combine`` makes one
    score of theirs; one source failing fails the sample, naming it. ``spread``: the sources are
    replicas of one remote reward (OpenRLHF's URL list since 0.6.3); sample ``k`` goes to source
    ``k mod n``, so each source scores an ``n``-th of the samples, and nothing is combined.
    """

    def __init__(self, sources: Sequence[RewardSource], *, reduce: Reduce = "sum") -> None:
        if len(sources) < 2:
            raise ValueError(f"CombinedReward takes two or more sources, got {len(sources)}")
        self.sources = list(sources)
        self.reduce = reduce
        self._turn = itertools.count()

    async def score(self, query: str, prompt: str, label: Any) -> Score:
        if self.reduce == "spread":
            return await self.sources[next(self._turn) % len(self.sources)].score(query, prompt, label)
        scores = await asyncio.gather(*(s.score(query, prompt, label) for s in self.sources), return_exceptions=True)
        for i, out in enumerate(scores):
            if isinstance(out, BaseException):
                if isinstance(out, RewardFailed):
                    raise RewardFailed(f"reward source {i}: {out}") from out
                raise out
        return combine(scores, self.reduce)  # type: ignore[arg-type]  # no exceptions left

    async def close(self) -> None:
        closed = await asyncio.gather(*(s.close() for s in self.sources), return_exceptions=True)
        for out in closed:  # every source closed before the first failure is raised
            if isinstance(out, BaseException):
                raise out


def reward_sources(refs: Sequence[str], *, reduce: Reduce = "sum", timeout_s: float = TIMEOUT_S,
                   retry_s: float = RETRY_S, curve_dir: str = "", token: str | None = None) -> RewardSource:
    """One ``reward_source`` per reference, a ``CombinedReward`` of them by ``reduce`` when there
    are several (``curve_dir`` and ``token`` serve every daemon / URL)."""
    if not refs:
        raise ValueError("no reward source given")
    made = [reward_source(r, timeout_s=timeout_s, retry_s=retry_s, curve_dir=curve_dir, token=token) for r in refs]
    return made[0] if len(made) == 1 else CombinedReward(made, reduce=reduce)


def reward_source(ref: str, *, timeout_s: float = TIMEOUT_S, retry_s: float = RETRY_S, curve_dir: str = "",
                  token: str | None = None) -> RewardSource:
    """The source a reference names (see the module docstring); remote ones retry as it says.
    ``curve_dir``: CURVE client keys for a ZeroMQ daemon (``treadle-keys generate``); ``token``:
    the bearer token of an HTTP endpoint."""
    if ref.startswith(("http://", "https://")):
        return HttpReward(ref, timeout_s=timeout_s, retry_s=retry_s, token=token)
    if ref.startswith(("tcp://", "ipc://")):
        from treadle.common.rpc import load_client_keys  # noqa: PLC0415

        curve = load_client_keys(curve_dir) if curve_dir else None
        return DaemonReward(ref, timeout_s=timeout_s, retry_s=retry_s, curve=curve)
    return FunctionReward(ref)
