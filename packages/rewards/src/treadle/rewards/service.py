"""The reward service: score a ``RewardRequest`` with every component, combine, shape, cache.

One ``RewardService`` backs both transports (ZeroMQ and HTTP). For N samples and K components
(rule functions, a reward model), each a scorer behind its own dynamic batcher::

    reward_i = sum_k w_k * r_k,i                      (shaping.weighted_sum)
    score_i  = s_j,i   for the component j named by score_from (the first by default), unweighted
    if stop_properly_coef is set:  reward_i = stop_properly_penalty(reward_i, stopped_i, coef)
    if overlong_buffer_len is set: reward_i += dapo_overlong_penalty(len_i, max_new_tokens, buffer, factor)

A sample any component failed gets ``failure_reward`` as reward and score, ``failed=True`` and
the components' messages in ``errors``; it is counted and logged. ``extra_logs`` carries each
component's per-sample logs as ``<component>/<name>`` (and ``<component>/reward`` when there are
several), ``reward_failed`` (0/1) and the shaping terms. ``provenance`` names every component
(file hash / model hash / built-in parameters, sandbox limits, weights, timeouts), the shaping,
and the request's content hash: all deterministic, so a cached replay is byte-identical.

Not here: building components from the config and the servers (``daemon``, ``http_server``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle.common.errors import BadRequest
from treadle.common.log import get_logger
from treadle.common.metrics import ServiceMetrics
from treadle.common.records import RewardRequest, RewardResult
from treadle.rewards import __version__
from treadle.rewards.api import RewardBatch, RewardOutput
from treadle.rewards.cache import IdempotencyCache, request_hash
from treadle.rewards.shaping import dapo_overlong_penalty, stop_properly_penalty, weighted_sum

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Component:
    """One scorer of the service."""

    name: str
    weight: float
    submit: Callable[[RewardBatch], Awaitable[RewardOutput]]
    provenance: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Shaping:
    """Length shaping applied after combining (see the module docstring)."""

    overlong_buffer_len: int | None = None
    overlong_penalty_factor: float = 1.0
    max_new_tokens: int | None = None
    stop_properly_penalty_coef: float | None = None
    stop_texts: tuple[str, ...] = ()
    count: Callable[[list[str]], list[int]] = field(default=lambda texts: [len(t) for t in texts])
    unit: str = "chars"

    def describe(self) -> dict[str, Any]:
        return {"overlong_buffer_len": self.overlong_buffer_len, "overlong_penalty_factor": self.overlong_penalty_factor,
                "max_new_tokens": self.max_new_tokens, "stop_properly_penalty_coef": self.stop_properly_penalty_coef,
                "stop_texts": list(self.stop_texts), "length_unit": self.unit}

    def apply(self, rewards: np.ndarray, responses: list[str], logs: dict[str, list[float]]) -> np.ndarray:
        if self.stop_properly_penalty_coef is not None:
            stopped = [any(r.endswith(s) for s in self.stop_texts) for r in responses]
            rewards = stop_properly_penalty(rewards, stopped, self.stop_properly_penalty_coef)
            logs["stopped"] = [float(s) for s in stopped]
        if self.overlong_buffer_len is not None:
            assert self.max_new_tokens is not None
            pen = dapo_overlong_penalty(self.count(responses), self.max_new_tokens, self.overlong_buffer_len,
                                        self.overlong_penalty_factor)
            rewards = (rewards + pen).astype(np.float32)
            logs["overlong_penalty"] = pen.tolist()
        return rewards


class RewardService:
    """Scores requests; bound to the event loop it is first used on."""

    def __init__(self, components: list[Component], *, score_from: str = "", failure_reward: float = 0.0,
                 shaping: Shaping | None = None, cache: IdempotencyCache | None = None,
                 metrics: RewardMetrics | None = None, max_request_samples: int = 65536) -> None:
        if not components:
            raise ValueError("a reward service needs at least one component")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique, got {names}")
        if score_from and score_from not in names:
            raise ValueError(f"score_from={score_from!r} names no component; components: {names}")
        self.components = components
        self._score_idx = names.index(score_from) if score_from else 0
        self.failure_reward = failure_reward
        self.shaping = shaping
        self.cache = cache or IdempotencyCache()
        self.max_request_samples = max_request_samples
        self.metrics = self._m = metrics or RewardMetrics()
        self._started = time.monotonic()
        self.provenance: dict[str, Any] = {
            "service": "treadle-rewards", "version": __version__,
            "components": [{"name": c.name, "weight": c.weight, **c.provenance} for c in components],
            "score_from": names[self._score_idx], "failure_reward": failure_reward,
            **({"shaping": shaping.describe()} if shaping else {}),
        }

    async def score(self, req: RewardRequest, *, transport: str = "zmq") -> RewardResult:
        """The result for ``req`` (from the cache when its key was seen); raises ``BadRequest``."""
        n = len(req.queries)
        if n > self.max_request_samples:
            raise BadRequest(f"request has {n} samples; this service takes at most "
                             f"{self.max_request_samples} per request (--batch.max_request_samples)")
        start = time.perf_counter()
        self._m.in_flight.inc()
        try:
            result, cached = await self.cache.get_or_compute(req, lambda: self._compute(req))
        finally:
            self._m.in_flight.dec()
        self._m.requests.labels(transport=transport).inc()
        self._m.latency.labels(transport=transport).observe(time.perf_counter() - start)
        if cached:
            self._m.cache_hits.inc()
        return result

    async def _compute(self, req: RewardRequest) -> RewardResult:
        n = len(req.queries)
        batch = RewardBatch(queries=list(req.queries), prompts=list(req.prompts) or [""] * n,
                            labels=list(req.labels) or [None] * n)
        outs = await asyncio.gather(*(c.submit(batch) for c in self.components))
        return self.combine(batch, list(outs), request_hash(req))

    def combine(self, batch: RewardBatch, outs: list[RewardOutput], digest: str = "") -> RewardResult:
        """Weighted rewards, the score component's scores, shaping, failures (see module docstring)."""
        n = len(batch)
        failed = np.zeros(n, dtype=bool)
        errors: list[list[str]] = [[] for _ in range(n)]
        logs: dict[str, list[float]] = {}
        for c, o in zip(self.components, outs, strict=True):
            for i in range(n):
                if o.is_failed(i):
                    failed[i] = True
                    errors[i].append(f"{c.name}: {o.errors[i] if o.errors else 'failed'}")
            self._m.samples.labels(component=c.name).inc(n)
            self._m.failures.labels(component=c.name).inc(sum(o.is_failed(i) for i in range(n)))
            logs.update({f"{c.name}/{k}": v for k, v in o.extra_logs.items()})
            if len(self.components) > 1:
                logs[f"{c.name}/reward"] = list(o.rewards)
        rewards = weighted_sum([o.rewards for o in outs], [c.weight for c in self.components])
        primary = outs[self._score_idx]
        scores = np.asarray(primary.scores if primary.scores is not None else primary.rewards, dtype=np.float32)
        if self.shaping is not None:
            rewards = self.shaping.apply(rewards, batch.responses, logs)
        rewards[failed] = self.failure_reward
        scores[failed] = self.failure_reward
        logs["reward_failed"] = failed.astype(np.float32).tolist()
        if failed.any():
            log.warning("reward: %d of %d samples failed; first: %s", int(failed.sum()), n,
                        next(e for e in errors if e)[0][:300])
        return RewardResult(rewards=rewards.astype(np.float32), scores=scores, failed=failed.tolist(),
                            errors=["; ".join(e) for e in errors], extra_logs=logs,
                            provenance={**self.provenance, "request_sha256": digest})

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "components": [c.name for c in self.components],
                "uptime_s": round(time.monotonic() - self._started, 3), "cache_entries": len(self.cache),
                "version": __version__}


class RewardMetrics:
    """The reward daemon's Prometheus series (names prefixed treadle_rewards_)."""

    def __init__(self, m: ServiceMetrics | None = None) -> None:
        self.registry = m = m or ServiceMetrics("rewards")
        self.requests = m.counter("requests_total", "Reward requests answered", ("transport",))
        self.latency = m.histogram("request_seconds", "Time to answer a reward request", ("transport",))
        self.samples = m.counter("samples_total", "Samples scored per component", ("component",))
        self.failures = m.counter("failed_samples_total", "Samples a component failed to score", ("component",))
        self.cache_hits = m.counter("cache_hits_total", "Requests answered from the idempotency cache")
        self.in_flight = m.gauge("in_flight", "Requests being scored now")
        self.batch = m.histogram("batch_samples", "Samples per scorer batch", ("component",),
                                 buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.worker_events = m.counter("worker_events_total", "Worker timeouts, deaths and restarts",
                                       ("component", "event"))
