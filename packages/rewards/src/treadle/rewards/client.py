"""Typed clients of the reward daemon; light: no torch, no transformers, no aiohttp at import.

- ``RewardClient`` (asyncio, ZeroMQ): ``await client.score(queries, prompts, labels, key=...)``
  -> ``RewardResult`` (``rewards`` float32 [N], ``scores``, ``failed``, ``errors``,
  ``extra_logs``, ``provenance``); raises the daemon's errors as ``treadle.common.errors``
  exceptions (``BadRequest``, ``Busy``, ``RequestTimeout``, ...).
- ``SyncRewardClient``: the same, blocking (its event loop runs in a thread).
- ``HttpRewardClient`` (blocking, standard library only): ``score`` -> the same
  ``RewardResult`` through ``POST /v1/reward``; ``get_reward`` -> OpenRLHF's
  ``{"rewards", "scores", "extra_logs"}`` through ``POST /get_reward``.

Give the same ``key`` when replaying a request to get the identical result from the daemon's
idempotency cache. Not here: the daemon (``daemon``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from treadle.common.errors import TreadleError, error_for
from treadle.common.records import Control, RewardRequest, RewardResult
from treadle.common.rpc import ClientCurve, RpcClient, SyncRpcClient

METHOD = "reward"


def make_request(queries: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = (),
                 key: str = "") -> RewardRequest:
    return RewardRequest(queries=list(queries), prompts=list(prompts), labels=list(labels), key=key)


def _check(reply: Any) -> RewardResult:
    if not isinstance(reply, RewardResult):
        raise TreadleError(f"the reward daemon answered {type(reply).__name__}, expected RewardResult")
    return reply


class RewardClient:
    """Async ZeroMQ client of ``treadle-rewards serve`` (one event loop)."""

    def __init__(self, endpoint: str, *, curve: ClientCurve | None = None, timeout_s: float | None = None) -> None:
        self._rpc = RpcClient(endpoint, name="rewards", curve=curve, timeout_s=timeout_s)

    async def score(self, queries: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = (), *,
                    key: str = "", timeout: float | None = None) -> RewardResult:
        """Rewards for ``queries`` (prompt + response texts) with their prompts and labels."""
        return _check(await self._rpc.call(METHOD, make_request(queries, prompts, labels, key), timeout=timeout))

    @property
    def closed(self) -> bool:
        """True after ``close()``: every call raises ``ServiceClosed`` (retrying is pointless)."""
        return self._rpc.closed

    async def health(self) -> dict[str, Any]:
        reply = await self._rpc.call("health")
        return dict(reply.args) if isinstance(reply, Control) else {}

    async def close(self) -> None:
        await self._rpc.close()

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SyncRewardClient:
    """Blocking ZeroMQ client; safe to call from several threads."""

    def __init__(self, endpoint: str, *, curve: ClientCurve | None = None, timeout_s: float | None = None) -> None:
        self._rpc = SyncRpcClient(endpoint, name="rewards", curve=curve, timeout_s=timeout_s)

    def score(self, queries: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = (), *,
              key: str = "", timeout: float | None = None) -> RewardResult:
        return _check(self._rpc.call(METHOD, make_request(queries, prompts, labels, key), timeout=timeout))

    def health(self) -> dict[str, Any]:
        reply = self._rpc.call("health")
        return dict(reply.args) if isinstance(reply, Control) else {}

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> SyncRewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpRewardClient:
    """Blocking HTTP client (urllib); ``url`` is the daemon's base, e.g. ``http://127.0.0.1:5000``."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 180.0) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict[str, Any] | None = None, key: str = "") -> Any:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if key:
            headers["Idempotency-Key"] = key
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="GET" if data is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read())
            except ValueError:
                err = {}
            code = err.get("code") or {400: "bad_request", 401: "unauthorized"}.get(e.code, "internal")
            raise error_for(code, err.get("error", f"HTTP {e.code}")) from None

    def get_reward(self, queries: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = ()) -> dict[str, Any]:
        """OpenRLHF's call: ``{"rewards", "scores", "extra_logs"}``."""
        return self._call("/get_reward", {"query": list(queries), "prompts": list(prompts), "labels": list(labels)})

    def score(self, queries: Sequence[str], prompts: Sequence[str] = (), labels: Sequence[Any] = (), *,
              key: str = "") -> RewardResult:
        """The full ``RewardResult`` (failures, provenance) through ``/v1/reward``."""
        d = self._call("/v1/reward", {"query": list(queries), "prompts": list(prompts), "labels": list(labels)}, key)
        return RewardResult(rewards=np.asarray(d["rewards"], dtype=np.float32),
                            scores=np.asarray(d["scores"], dtype=np.float32), failed=d["failed"],
                            errors=d["errors"], extra_logs=d["extra_logs"], provenance=d["provenance"])

    def health(self) -> dict[str, Any]:
        return self._call("/health")
