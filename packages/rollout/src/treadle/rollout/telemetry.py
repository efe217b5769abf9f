"""The rollout daemon's Prometheus metrics (``treadle_rollout_*``), or no-ops without them.

Counters: requests, samples, response tokens, failed-over samples, engine restarts, Busy
replies. Gauges: samples in flight (admitted), queue depth (admitted but not running on an
engine), tokens/s, weight version, engines ready, and per engine (label ``engine``) load,
version and state (1 for the state it is in).

What this module does not do: serve HTTP itself (``ServiceMetrics.serve``) or collect anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

STATES = ("starting", "catching_up", "ready", "behind", "quarantined", "draining", "dead", "stopped")


class _Nothing:
    """Stands in for any metric when metrics are off."""

    def inc(self, *a: Any) -> None: ...

    def set(self, *a: Any) -> None: ...

    def labels(self, *a: Any, **kw: Any) -> _Nothing:
        return self

    def remove(self, *a: Any) -> None: ...


class PoolMetrics:
    """Metric handles on a ``treadle.common.metrics.ServiceMetrics`` (None: all no-ops)."""

    def __init__(self, service: Any | None) -> None:
        self.service = service
        nothing = _Nothing()
        m = service
        self.requests = m.counter("requests_total", "generate requests admitted") if m else nothing
        self.samples = m.counter("samples_total", "samples returned") if m else nothing
        self.tokens = m.counter("tokens_total", "response tokens returned") if m else nothing
        self.failovers = m.counter("failover_samples_total", "samples regenerated after an engine died") if m else nothing
        self.restarts = m.counter("engine_restarts_total", "engine processes restarted") if m else nothing
        self.busy = m.counter("busy_total", "requests refused at the in-flight limit") if m else nothing
        self.in_flight = m.gauge("in_flight_samples", "samples admitted and not yet returned") if m else nothing
        self.queue = m.gauge("queue_depth", "samples admitted but not running on an engine") if m else nothing
        self.tokens_per_s = m.gauge("tokens_per_second", "response tokens per second (30 s window)") if m else nothing
        self.version = m.gauge("weight_version", "weight version the pool serves") if m else nothing
        self.ready = m.gauge("engines_ready", "engines taking work") if m else nothing
        self.load = m.gauge("engine_load", "samples in flight per engine", ("engine",)) if m else nothing
        self.engine_version = m.gauge("engine_weight_version", "weight version per engine", ("engine",)) if m else nothing
        self.state = m.gauge("engine_state", "1 for the state each engine is in", ("engine", "state")) if m else nothing

    def engines(self, handles: Iterable[Any], version: int) -> None:
        """Refresh the per-engine gauges."""
        if self.service is None:
            return
        ready = 0
        for h in handles:
            ready += h.state == "ready"
            self.load.labels(h.engine_id).set(h.load)
            self.engine_version.labels(h.engine_id).set(h.version)
            for s in STATES:
                self.state.labels(h.engine_id, s).set(1 if h.state == s else 0)
        self.ready.set(ready)
        self.version.set(version)

    def pool(self, stats: dict[str, Any], in_flight: int) -> None:
        """Refresh the pool-wide gauges from ``EnginePool.stats()``."""
        self.in_flight.set(in_flight)
        self.queue.set(max(0, in_flight - stats["running"]))
        self.tokens_per_s.set(stats["tokens_per_s"])
