"""The HTTP face of the reward service (aiohttp), compatible with OpenRLHF's remote reward URL.

Routes::

    POST /get_reward   {"query": [...], "prompts": [...], "labels": [...]}
                       -> {"rewards": [...], "scores": [...], "extra_logs": {name: [...]}}
                       exactly what OpenRLHF's ``--remote_rm_url http://host:port/get_reward``
                       sends and reads; a failed sample shows as extra_logs["reward_failed"] = 1
    POST /v1/reward    the same request ("queries" also accepted, "key" optional) -> the whole
                       RewardResult as JSON: rewards, scores, failed, errors, extra_logs, provenance
    GET  /health       {"status": "ok", ...}  (never needs the token)
    GET  /metrics      Prometheus text format
    GET  /info         the service's provenance (components, hashes, limits)

An ``Idempotency-Key`` header (or "key" in the body) makes a replayed request return the cached
result. With a token, every route but /health needs ``Authorization: Bearer TOKEN`` (or
``?access_token=TOKEN``, for clients such as OpenRLHF's that cannot set headers: the URL then
carries the secret, so prefer the header). Errors are JSON ``{"error": ...}`` with 400/401/500.

Not here: scoring (``service``), deciding whether binding a host is allowed (``config``).
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from treadle.common.errors import TreadleError
from treadle.common.log import get_logger
from treadle.common.records import RewardRequest, RewardResult
from treadle.common.rpc import InsecureEndpoint
from treadle.common.rpc.transport import is_loopback
from treadle.rewards.service import RewardService

log = get_logger(__name__)
OPEN_PATHS = frozenset({"/health"})


def parse_request(body: Any, header_key: str | None) -> RewardRequest:
    """A ``RewardRequest`` from OpenRLHF's JSON body; ValueError naming what is wrong."""
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
    queries = body.get("query", body.get("queries"))
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError('"query" must be a list of strings (prompt + response texts)')
    prompts = body.get("prompts") or []
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError('"prompts" must be a list of strings')
    labels = body.get("labels") or []
    if not isinstance(labels, list):
        raise ValueError('"labels" must be a list')
    key = header_key or body.get("key") or ""
    if not isinstance(key, str):
        raise ValueError('"key" must be a string')
    try:  # JSON carries what msgpack cannot (ints beyond 64 bits, lone surrogates): refuse it here
        msgspec.msgpack.encode((queries, prompts, labels))
    except (OverflowError, UnicodeError, TypeError) as e:
        raise ValueError(f"the request holds a value that cannot be scored: {e}") from None
    return RewardRequest(queries=queries, prompts=prompts, labels=labels, key=key)


async def read_json(request: web.Request) -> Any:
    """The request's JSON body; ValueError for any body that is not JSON.

    Besides bad JSON and bad UTF-8 that covers nesting deeper than the parser's recursion
    limit, an unknown ``charset`` (LookupError) and a broken ``Content-Encoding`` (aiohttp's
    payload errors). HTTP errors aiohttp raises itself (413 body too large) pass through.
    """
    try:
        return await request.json()
    except web.HTTPException:
        raise
    except Exception as e:  # noqa: BLE001  (whatever reading a client's body raises is the client's)
        raise ValueError(f"the body is not valid JSON: {type(e).__name__}: {e}"[:2000]) from None


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own 4xx (404, 405, 413) as JSON ``{"error": ...}``, like every other error here."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":
            raise
        keep = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.json_response({"error": e.text or e.reason}, status=e.status, headers=keep)


def _floats(a: Any) -> list[float]:
    return np.asarray(a, dtype=np.float32).tolist()


def openrlhf_reply(res: RewardResult) -> dict[str, Any]:
    """The body OpenRLHF reads: rewards, scores, extra_logs (per-sample lists)."""
    scores = res.scores if res.scores is not None else res.rewards
    return {"rewards": _floats(res.rewards), "scores": _floats(scores),
            "extra_logs": {k: list(v) for k, v in res.extra_logs.items()}}


def full_reply(res: RewardResult) -> dict[str, Any]:
    return {**openrlhf_reply(res), "failed": list(res.failed), "errors": list(res.errors),
            "provenance": res.provenance}


class HttpServer:
    """aiohttp application + runner for one ``RewardService``."""

    def __init__(self, service: RewardService, *, token: str | None = None, max_body_mb: int = 256) -> None:
        self.service = service
        self._token = token
        self.app = web.Application(client_max_size=max_body_mb << 20, middlewares=[json_errors, self._auth])
        self.app.add_routes([
            web.post("/get_reward", self._get_reward), web.post("/v1/reward", self._v1_reward),
            web.get("/health", self._health), web.get("/metrics", self._metrics), web.get("/info", self._info),
        ])
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> str:
        """Bind and serve; returns ``http://host:port`` with the real port. A non-loopback host
        without a token raises ``InsecureEndpoint`` (the config refuses it too; this is the backstop)."""
        if self._token is None and not is_loopback(host):
            raise InsecureEndpoint(f"refusing to serve HTTP on {host} without a bearer token")
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        return f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._token is None or request.path in OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "")
        given = given[7:] if given.startswith("Bearer ") else request.query.get("access_token", "")
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": 'Bearer realm="treadle-rewards"'})
        return await handler(request)

    async def _score(self, request: web.Request) -> RewardResult | web.Response:
        try:
            body = await read_json(request)
            req = parse_request(body, request.headers.get("Idempotency-Key"))
        except (ValueError, TypeError) as e:  # bad JSON, bad fields, RewardRequest's own checks
            return web.json_response({"error": str(e)[:2000]}, status=400)
        try:
            return await self.service.score(req, transport="http")
        except TreadleError as e:
            status = 400 if e.code == "bad_request" else 500
            return web.json_response({"error": e.message, "code": e.code}, status=status)
        except Exception as e:
            log.error("HTTP reward request failed", exc_info=e)
            return web.json_response({"error": f"{type(e).__name__}: {e}"[:2000], "code": "internal"}, status=500)

    async def _get_reward(self, request: web.Request) -> web.Response:
        res = await self._score(request)
        return res if isinstance(res, web.Response) else web.json_response(openrlhf_reply(res))

    async def _v1_reward(self, request: web.Request) -> web.Response:
        res = await self._score(request)
        return res if isinstance(res, web.Response) else web.json_response(full_reply(res))

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.health())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.service.metrics.registry.exposition(),
                            content_type="text/plain", charset="utf-8")

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.provenance)
