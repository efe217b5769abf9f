"""Typed clients of the agent gateway (``treadle-agents serve``); light: no torch, vLLM or transformers.

    async with GatewayClient("http://127.0.0.1:8000", token=None) as gw:
        reply = await gw.chat([{"role": "user", "content": "hi"}], session_id="ep-1", max_tokens=64)
        ...                                           # more turns with the same session_id
        [traj] = await gw.finish("ep-1", reward=1.0)  # the session as Trajectories (usually one)

``SyncGatewayClient`` has the same methods, blocking (standard library only). Chat replies are
the OpenAI JSON (plus "session_id", "weight_version", "drift" when found); the official
``openai`` client works as well (pass ``extra_body={"session_id": ...}``) and this client then
only fetches the trajectories. Failures raise ``GatewayError`` (HTTP status, OpenAI error code).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from treadle.agents.jsonio import trajectory_from_json
from treadle.common.records import Trajectory

__all__ = ["GatewayClient", "GatewayError", "SyncGatewayClient"]


class GatewayError(RuntimeError):
    """The gateway answered an error (``status``: HTTP status, ``code``: OpenAI-style code)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} [{code}] {message}")
        self.status, self.code, self.message = status, code, message


def _error(status: int, raw: bytes) -> GatewayError:
    try:
        err = json.loads(raw).get("error", {})
    except (ValueError, AttributeError):
        err = {}
    return GatewayError(status, str(err.get("code") or "error"), str(err.get("message") or raw[:200]))


def _chat_body(messages: Sequence[dict[str, Any]], session_id: str | None, tools: Sequence[dict[str, Any]] | None,
               params: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": list(messages), **params}
    if session_id is not None:
        body["session_id"] = session_id
    if tools:
        body["tools"] = list(tools)
    return body


def _finish_body(reward: float | None, score: float | None, extra_logs: dict[str, float] | None, group_id: str,
                 info: dict[str, Any] | None) -> dict[str, Any]:
    return {"reward": reward, "score": score, "extra_logs": extra_logs or {}, "group_id": group_id, "info": info or {}}


def _trajectories(d: dict[str, Any]) -> list[Trajectory]:
    return [trajectory_from_json(t) for t in d["trajectories"]]


class GatewayClient:
    """Async client (aiohttp, imported when the first request is made)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self._session: Any = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        import aiohttp  # noqa: PLC0415

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        async with self._session.request(method, self.url + path, json=body) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise _error(resp.status, raw)
            return json.loads(raw)

    async def chat(self, messages: Sequence[dict[str, Any]], *, session_id: str | None = None,
                   tools: Sequence[dict[str, Any]] | None = None, **params: Any) -> dict[str, Any]:
        """One chat completion (``params``: max_tokens, temperature, seed, logprobs, ...)."""
        return await self._call("POST", "/v1/chat/completions", _chat_body(messages, session_id, tools, params))

    async def tokenize(self, *, messages: Sequence[dict[str, Any]] | None = None, prompt: str | None = None,
                       tools: Sequence[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> list[int]:
        body = {"prompt": prompt} if messages is None else {
            "messages": list(messages), "tools": list(tools or []), "add_generation_prompt": add_generation_prompt}
        return list((await self._call("POST", "/tokenize", body))["tokens"])

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/health")

    async def models(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/models"))["data"])

    async def sessions(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/sessions"))["sessions"])

    async def trajectories(self, session_id: str) -> list[Trajectory]:
        """The session stitched so far (it stays open)."""
        return _trajectories(await self._call("GET", f"/v1/sessions/{session_id}"))

    async def finish(self, session_id: str, *, reward: float | None = None, score: float | None = None,
                     extra_logs: dict[str, float] | None = None, group_id: str = "",
                     info: dict[str, Any] | None = None) -> list[Trajectory]:
        """Close the session; its Trajectories with the reward set."""
        body = _finish_body(reward, score, extra_logs, group_id, info)
        return _trajectories(await self._call("POST", f"/v1/sessions/{session_id}/finish", body))

    async def delete(self, session_id: str) -> None:
        await self._call("DELETE", f"/v1/sessions/{session_id}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SyncGatewayClient:
    """Blocking client (urllib); the same methods as ``GatewayClient``."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self._headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise _error(e.code, e.read()) from None

    def chat(self, messages: Sequence[dict[str, Any]], *, session_id: str | None = None,
             tools: Sequence[dict[str, Any]] | None = None, **params: Any) -> dict[str, Any]:
        return self._call("POST", "/v1/chat/completions", _chat_body(messages, session_id, tools, params))

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def models(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/models")["data"])

    def sessions(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/sessions")["sessions"])

    def trajectories(self, session_id: str) -> list[Trajectory]:
        return _trajectories(self._call("GET", f"/v1/sessions/{session_id}"))

    def finish(self, session_id: str, *, reward: float | None = None, score: float | None = None,
               extra_logs: dict[str, float] | None = None, group_id: str = "",
               info: dict[str, Any] | None = None) -> list[Trajectory]:
        return _trajectories(self._call("POST", f"/v1/sessions/{session_id}/finish",
                                        _finish_body(reward, score, extra_logs, group_id, info)))

    def delete(self, session_id: str) -> None:
        self._call("DELETE", f"/v1/sessions/{session_id}")

    def close(self) -> None:
        return None

    def __enter__(self) -> SyncGatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
