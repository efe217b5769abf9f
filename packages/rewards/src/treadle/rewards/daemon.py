"""The reward daemon: build the service from a ``ServeConfig`` and serve it over ZeroMQ and HTTP.

``RewardDaemon(cfg)``: ``await start()`` starts the worker pools (one per rule function), loads
the reward model (in a thread), puts a dynamic batcher in front of each scorer, then binds the
ZeroMQ server (method ``reward``: ``RewardRequest`` -> ``RewardResult``; ``health``/``stats``
built in) and the HTTP server; ``await close()`` releases everything in reverse order.
``DaemonThread`` runs one on a background event loop (tests, benchmarks, notebooks).

Not here: the request semantics (``service``), HTTP routes (``http_server``), flags (``config``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.common.errors import BadRequest
from treadle.common.log import get_logger
from treadle.common.records import RewardRequest, RewardResult
from treadle.common.rpc import LoopThread, RequestContext, RpcServer, load_server_keys
from treadle.rewards.batching import DynamicBatcher
from treadle.rewards.cache import IdempotencyCache
from treadle.rewards.config import ServeConfig
from treadle.rewards.loader import FunctionSpec, parse_ref
from treadle.rewards.service import Component, RewardMetrics, RewardService, Shaping
from treadle.rewards.workers import FunctionPool

log = get_logger(__name__)


def builtin_params(cfg: ServeConfig, name: str) -> dict[str, Any]:
    """The keyword parameters of built-in ``name`` from its config group."""
    if name == "math":
        m = cfg.math
        return {"extraction": m.extraction, "max_response_chars": m.max_response_chars,
                "max_answer_chars": m.max_answer_chars}
    if name == "format":
        return {"pattern": cfg.format.pattern}
    c = cfg.code
    return {"cpu_s": c.cpu_s, "wall_s": c.wall_s, "memory_mb": c.memory_mb, "nproc": c.nproc, "fsize_mb": c.fsize_mb,
            "isolation": c.isolation, "binary": c.binary, "stop_on_failure": c.stop_on_failure, "max_tests": c.max_tests}


def function_specs(cfg: ServeConfig) -> list[FunctionSpec]:
    """One spec per ``--functions`` entry; names made unique (f, f_2, ...)."""
    specs, seen = [], {}
    for ref in cfg.functions:
        spec = parse_ref(ref)
        if spec.builtin:
            spec = parse_ref(ref, builtin_params(cfg, ref))
        n = seen[spec.name] = seen.get(spec.name, 0) + 1
        if n > 1:
            spec = FunctionSpec(name=f"{spec.name}_{n}", source=spec.source, function=spec.function, params=spec.params)
        specs.append(spec)
    return specs


def _token(cfg: ServeConfig) -> str | None:
    if cfg.http.token_file:
        return Path(cfg.http.token_file).read_text().strip() or None
    return cfg.http.token


@dataclass(frozen=True, slots=True, kw_only=True)
class Addresses:
    """Where a started daemon listens."""

    zmq: str | None
    http: str | None  # http://host:port


class RewardDaemon:
    """The whole daemon; ``start`` / ``close`` on one event loop."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.metrics = RewardMetrics()
        self.service: RewardService | None = None
        self._pools: list[FunctionPool] = []
        self._batchers: list[DynamicBatcher] = []
        self._rpc: RpcServer | None = None
        self._http: Any = None
        self._cache: IdempotencyCache | None = None
        self.addresses = Addresses(zmq=None, http=None)

    def _batcher(self, name: str, fn: Any, concurrency: int) -> DynamicBatcher:
        hist = self.metrics.batch.labels(component=name)
        b = DynamicBatcher(fn, max_batch_size=self.cfg.batch.max_batch_size,
                           max_wait_s=self.cfg.batch.max_wait_ms / 1000.0, max_concurrency=concurrency,
                           on_batch=hist.observe)
        self._batchers.append(b)
        return b

    async def _function_components(self) -> list[Component]:
        cfg, out = self.cfg, []
        specs = function_specs(cfg)
        events = self.metrics.worker_events
        for spec in specs:
            pool = FunctionPool(spec, size=cfg.workers.num_workers, timeout_s=cfg.workers.timeout_s,
                                memory_mb=cfg.workers.memory_mb, isolate=cfg.workers.isolate_failures,
                                start_timeout_s=cfg.workers.start_timeout_s,
                                on_event=lambda kind, n=spec.name: events.labels(component=n, event=kind).inc())
            self._pools.append(pool)
        await asyncio.gather(*(p.start() for p in self._pools))
        weights = cfg.weights or (1.0,) * len(specs)
        for spec, pool, w in zip(specs, self._pools, weights, strict=True):
            b = self._batcher(spec.name, pool.score, pool.size)
            out.append(Component(name=spec.name, weight=w, submit=b.submit, provenance=pool.provenance))
        return out

    async def _rm_component(self) -> Component | None:
        r = self.cfg.rm
        if r.path is None:
            return None
        from treadle.rewards.rm import ReplicaPool, RewardModelScorer, replica_devices  # noqa: PLC0415  (torch)

        def load(device: str) -> RewardModelScorer:
            return RewardModelScorer(r.path, dtype=r.dtype, device=device, max_len=r.max_len,
                                     micro_batch_size=r.micro_batch_size, append_eos=r.append_eos,
                                     normalize=r.normalize, attn_implementation=r.attn_implementation,
                                     value_head_prefix=r.value_head_prefix, use_fast=not r.disable_fast_tokenizer)

        # One copy after another: transformers' model loading patches process-wide state (weight init,
        # tying), and two loads in two threads at once left later models in this process untied.
        scorers = [await asyncio.to_thread(load, d) for d in replica_devices(r.device, r.replicas)]
        pool = ReplicaPool(scorers)
        self._rm = pool.scorers[0]
        b = self._batcher("rm", pool.score, pool.size)
        return Component(name="rm", weight=r.weight, submit=b.submit, provenance=pool.provenance)

    def _shaping(self) -> Shaping | None:
        s = self.cfg.shaping
        if not s.enabled:
            return None
        count, unit = (lambda texts: [len(t) for t in texts]), "chars"
        if s.length_unit == "tokens" and s.overlong_buffer_len is not None:
            tok_path = s.tokenizer or self.cfg.rm.path
            from transformers import AutoTokenizer  # noqa: PLC0415  (rm extra)

            tok = AutoTokenizer.from_pretrained(tok_path)
            count = lambda texts: [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]  # noqa: E731
            unit = f"tokens ({Path(tok_path).name})"
        return Shaping(overlong_buffer_len=s.overlong_buffer_len, overlong_penalty_factor=s.overlong_penalty_factor,
                       max_new_tokens=s.max_new_tokens, stop_properly_penalty_coef=s.stop_properly_penalty_coef,
                       stop_texts=s.stop_texts, count=count, unit=unit)

    async def start(self) -> Addresses:
        """Start scorers and servers; on failure everything started is released again."""
        cfg = self.cfg
        try:
            components = await self._function_components()
            rm = await self._rm_component()
            if rm is not None:
                components.append(rm)
            self._cache = IdempotencyCache(cfg.cache.size, cfg.cache.path)
            self.service = RewardService(components, score_from=cfg.score_from, failure_reward=cfg.failure_reward,
                                         shaping=self._shaping(), cache=self._cache, metrics=self.metrics,
                                         max_request_samples=cfg.batch.max_request_samples)
            zmq_addr = await self._start_rpc()
            http_addr = await self._start_http()
            if cfg.metrics_port is not None:
                self.metrics.registry.serve(cfg.metrics_port)
        except BaseException:
            await self.close()
            raise
        self.addresses = Addresses(zmq=zmq_addr, http=http_addr)
        log.info("reward daemon ready", extra={"fields": {"zmq": zmq_addr, "http": http_addr,
                                                          "components": [c.name for c in components]}})
        return self.addresses

    async def _reward(self, msg: Any, ctx: RequestContext) -> RewardResult:
        if not isinstance(msg, RewardRequest):
            raise BadRequest(f"method 'reward' takes a RewardRequest, got {type(msg).__name__}")
        assert self.service is not None
        return await self.service.score(msg, transport="zmq")

    async def _start_rpc(self) -> str | None:
        z = self.cfg.zmq
        if z.endpoint is None:
            return None
        curve = load_server_keys(z.curve_dir) if z.curve_dir else None
        self._rpc = RpcServer(name="rewards", endpoint=z.endpoint, handlers={"reward": self._reward},
                              max_in_flight=z.max_in_flight, curve=curve)
        return await self._rpc.start()

    async def _start_http(self) -> str | None:
        h = self.cfg.http
        if h.port is None:
            return None
        from treadle.rewards.http_server import HttpServer  # noqa: PLC0415

        assert self.service is not None
        self._http = HttpServer(self.service, token=_token(self.cfg), max_body_mb=h.max_body_mb)
        return await self._http.start(h.host, h.port)

    async def close(self) -> None:
        """Stop servers, then batchers and workers; safe to call twice or after a failed start."""
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._rpc is not None:
            await self._rpc.close(grace_s=2.0)
            self._rpc = None
        for b in self._batchers:
            await b.close()
        await asyncio.gather(*(p.close() for p in self._pools), return_exceptions=True)
        self._batchers, self._pools = [], []
        if self._cache is not None:
            self._cache.close()


class DaemonThread:
    """A ``RewardDaemon`` on its own event loop in a daemon thread: ``start()`` -> ``Addresses``."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.daemon = RewardDaemon(cfg)
        self._lt: LoopThread | None = None

    def start(self, timeout_s: float = 300.0) -> Addresses:
        self._lt = LoopThread(name="treadle-rewards")
        try:
            return self._lt.run(self.daemon.start(), timeout=timeout_s)
        except BaseException:
            self._lt.stop()
            self._lt = None
            raise

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the daemon's loop (e.g. ``service.score``) and wait for it."""
        assert self._lt is not None
        return self._lt.run(coro, timeout=timeout)

    def stop(self) -> None:
        lt, self._lt = self._lt, None
        if lt is None:
            return
        with contextlib.suppress(Exception):
            lt.run(self.daemon.close(), timeout=30.0)
        lt.stop()

    def __enter__(self) -> DaemonThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
