"""The gateway's Prometheus metrics (``GET /metrics``), on a registry of its own (no global state).

Names (prefix ``treadle_gateway_``): ``requests_total{route,status}``, ``request_seconds{route}``
(histogram, whole request: a streamed one until its last chunk), ``prompt_tokens_total``,
``completion_tokens_total`` (every choice's sampled tokens, as the sessions record them),
``drift_total`` (requests whose recorded tokens are not what the template renders), and
``sessions`` (open sessions, read at scrape time).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from treadle.common.metrics import ServiceMetrics

BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    """Metric handles of one gateway."""

    def __init__(self) -> None:
        self.registry = ServiceMetrics("gateway")
        r = self.registry
        self.requests = r.counter("requests", "HTTP requests by route template and status", ("route", "status"))
        self.seconds = r.histogram("request_seconds", "Request latency by route template", ("route",), BUCKETS)
        self.prompt_tokens = r.counter("prompt_tokens", "Prompt tokens of served completions")
        self.completion_tokens = r.counter("completion_tokens", "Sampled tokens of served completions (all choices)")
        self.drift = r.counter("drift", "Requests with a drift report")
        self.sessions = r.gauge("sessions", "Open sessions")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Count every request by route template and status, and time it (the outermost middleware)."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        start, status = time.perf_counter(), 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            self.requests.labels(route=route, status=str(status)).inc()
            self.seconds.labels(route=route).observe(time.perf_counter() - start)
