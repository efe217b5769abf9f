"""The OpenAI-compatible agent gateway: chat completions over the rollout pool, token-exact sessions.

Routes (aiohttp)::

    GET  /health                      {"status": "ok" | "degraded", "rollout": ..., "sessions": N}; no token needed
    GET  /v1/models                   the served model (id, max_model_len)
    POST /v1/chat/completions         OpenAI chat completions (``openai_api``): logprobs, tool calls
                                      (Hermes <tool_call> blocks parsed into ``tool_calls``), plus
                                      "session_id", "weight_version" and, on drift, "drift"
    POST /tokenize                    {"messages", "tools"?, "add_generation_prompt"?} or {"prompt"}
                                      -> {"tokens", "count", "max_model_len"} (vLLM's shape)
    POST /detokenize                  {"tokens"} -> {"prompt"}
    GET  /v1/sessions                 every open session's summary
    GET  /v1/sessions/{id}            {"session_id", "trajectories": [...], "drift": [...]} (stays open)
    POST /v1/sessions/{id}/finish     body {"reward"?, "score"?, "extra_logs"?, "group_id"?, "info"?}:
                                      the same, with the reward set; the session is closed
    DELETE /v1/sessions/{id}          drop a session
    POST /s/{id}/v1/chat/completions  the same chat route bound to session {id} by its path, so that an
    GET  /s/{id}/v1/models            unmodified OpenAI client given base_url .../s/{id}/v1 stays in it

Each request names its session with ``session_id`` in the body (OpenAI clients: ``extra_body``)
or the ``X-Session-Id`` header; without one, the request starts a fresh session whose id the
response carries. Requests of one session are served one at a time (a per-session lock);
sessions idle longer than ``session_ttl_s`` (or beyond ``max_sessions``, least recently used
first) are dropped. With a bearer token every route but /health needs
``Authorization: Bearer TOKEN``. Errors are OpenAI-style JSON: 400 malformed, 401 token, 404
unknown session, 413 more text than ``max_tokenize_chars``, 503 when the rollout pool cannot
serve (retry), 500 otherwise.

Templates and the tokenizer run on one thread beside the event loop, never on it: a long text
takes the tokenizer seconds, and the loop keeps serving other requests (and /health) meanwhile.

A gateway owned by a trainer (``agents.program``) opens its sessions itself (``open_session``)
with the run's sampling parameters: requests in them sample with those (temperature, top-p,
seed, stop tokens) whatever the agent asked for, and ``max_tokens`` is capped by them. It may
share the trainer's rollout client and sampler instead of connecting its own.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from treadle.agents.chat import ChatFormat, TemplateError
from treadle.agents.gateway.config import GatewayConfig
from treadle.agents.gateway.openai_api import (
    RequestError,
    assistant_message,
    completion,
    error_body,
    logprob_entries,
    normalize_message,
    parse_chat,
)
from treadle.agents.gateway.session import Session
from treadle.agents.jsonio import trajectory_to_json
from treadle.agents.sampler import RolloutSampler, with_max_tokens
from treadle.agents.tools import parse_tool_calls
from treadle.common.errors import TreadleError
from treadle.common.log import get_logger
from treadle.common.records import SamplingParams

log = get_logger(__name__)
OPEN_PATHS = frozenset({"/health"})


def _json_error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(error_body(message, code), status=status)


def text_chars(value: Any) -> int:
    """Characters in every string of a JSON value, keys included: the text a request asks to tokenize."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


class Gateway:
    """One gateway: an aiohttp app, the rollout client, and the sessions."""

    def __init__(self, cfg: GatewayConfig, *, chat: ChatFormat | None = None, rollout: Any = None,
                 sampler: Any = None) -> None:
        self.cfg = cfg
        self.chat = chat or ChatFormat.load(cfg.model, cfg.chat_template)
        self.token = cfg.bearer_token()
        self.model_name = cfg.served_model_name or Path(cfg.model).name
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.counters = {"requests": 0, "sessions": 0, "drift": 0, "failed": 0}
        self.url = ""
        self._rollout: Any = rollout
        self._owns_rollout = rollout is None  # a client handed in is its owner's to close
        self._sampler: Any = sampler
        self._runner: web.AppRunner | None = None
        self._janitor: asyncio.Task[None] | None = None
        # One thread: a transformers tokenizer is not safe to share between threads (its
        # truncation settings are mutable state), and one bounds the cores tokenizing can take.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-tokenizer")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Connect to the rollout daemon, bind, serve; returns the base URL."""
        from treadle.common.rpc import load_client_keys  # noqa: PLC0415
        from treadle.rollout.client import RolloutClient  # noqa: PLC0415

        if self._rollout is None:
            curve = load_client_keys(self.cfg.rollout_curve_dir) if self.cfg.rollout_curve_dir else None
            self._rollout = RolloutClient(self.cfg.rollout, curve=curve, generate_timeout_s=self.cfg.request_timeout_s)
        if self._sampler is None:
            self._sampler = RolloutSampler(self._rollout)
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._janitor = asyncio.ensure_future(self._sweep())
        return self.url

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
        try:
            if self._runner is not None:
                await self._runner.cleanup()
        finally:
            self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            if self._rollout is not None and self._owns_rollout:
                await self._rollout.close()

    async def _sweep(self) -> None:
        """Drop sessions idle longer than the TTL."""
        every = min(self.cfg.session_ttl_s / 4, 30.0)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for sid in [s.id for s in self.sessions.values() if now - s.last_used > self.cfg.session_ttl_s]:
                self.sessions.pop(sid, None)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth, self._errors], client_max_size=64 << 20)
        app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat_completions), web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize), web.get("/v1/sessions", self.list_sessions),
            web.get("/v1/sessions/{sid}", self.get_session), web.post("/v1/sessions/{sid}/finish", self.finish),
            web.delete("/v1/sessions/{sid}", self.delete_session),
            web.post("/s/{sid}/v1/chat/completions", self.chat_completions), web.get("/s/{sid}/v1/models", self.models)])
        return app

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token and request.path not in OPEN_PATHS:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, f"Bearer {self.token}".encode()):
                return _json_error(401, "missing or wrong bearer token", "invalid_api_key")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:  # aiohttp's own 4xx (404, 405, 413) in the same JSON shape
            if e.status < 400 or e.content_type == "application/json":
                raise
            keep = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
            return web.json_response(error_body(e.text or e.reason, e.reason.lower().replace(" ", "_")),
                                     status=e.status, headers=keep)
        except RequestError as e:
            return _json_error(e.status, str(e), e.code)
        except TemplateError as e:
            return _json_error(400, str(e), "chat_template_error")
        except TreadleError as e:
            self.counters["failed"] += 1
            status = 503 if e.retryable else 500
            return _json_error(status, f"rollout pool: {type(e).__name__}: {e}", e.code)
        except Exception as e:
            self.counters["failed"] += 1
            log.exception("gateway %s %s failed", request.method, request.path)
            return _json_error(500, f"{type(e).__name__}: {e}", "internal_error")

    # ------------------------------------------------------------------ routes

    async def _body(self, request: web.Request) -> Any:
        """The JSON body; RequestError (400) for anything a client can get wrong in one: bad JSON or
        UTF-8, nesting past the parser's recursion limit, an unknown charset, a broken
        Content-Encoding, values no tokenizer or msgpack peer takes (lone surrogates, ints past
        64 bits). aiohttp's own errors (413) pass through."""
        try:
            body = await request.json()
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001  (whatever reading a client's body raises is the client's)
            raise RequestError(f"the body is not valid JSON ({type(e).__name__})") from None
        try:
            msgspec.msgpack.encode(body)
        except (OverflowError, UnicodeError) as e:
            raise RequestError(f"the body holds a value that cannot be used: {e}") from None
        return body

    async def _off_loop(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` on the tokenizer thread (templates, encode, decode of long inputs)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                functools.partial(fn, *args, **kw))

    def _check_size(self, n: int, what: str = "characters of text to tokenize") -> None:
        """RequestError (413) when ``n`` exceeds ``max_tokenize_chars``, naming both and the flag."""
        limit = self.cfg.max_tokenize_chars
        if n > limit:
            raise RequestError(f"the request holds {n:,} {what}; this gateway takes at most {limit:,} per "
                               f"request (--max_tokenize_chars)", code="text_too_long", status=413)

    def _render_ids(self, msgs: list[Any], tools: Any, add_generation_prompt: bool) -> list[int]:
        text = self.chat.render(msgs, tools=tools, add_generation_prompt=add_generation_prompt)
        return self.chat.encode(text).tolist()

    async def health(self, request: web.Request) -> web.Response:
        try:
            rollout = await self._rollout.health(timeout=5.0)
        except (TreadleError, asyncio.TimeoutError) as e:
            return web.json_response({"status": "down", "rollout": {"error": str(e)}}, status=503)
        status = "ok" if rollout.get("status") == "ok" else "degraded"
        return web.json_response({"status": status, "rollout": {"status": rollout.get("status"),
                                                                "version": rollout.get("version")},
                                  "sessions": len(self.sessions), **self.counters})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "treadle",
             "max_model_len": self.cfg.max_length}]})

    def open_session(self, sid: str, sampling: SamplingParams) -> Session:
        """A new session whose requests sample with ``sampling`` (``max_tokens``: a cap)."""
        if sid in self.sessions:
            raise RequestError(f"session {sid} exists already")
        s = self._session(sid)
        s.forced = sampling
        return s

    def _session(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = Session(sid)
            self.counters["sessions"] += 1
            while len(self.sessions) > self.cfg.max_sessions:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(sid)
        return s

    async def chat_completions(self, request: web.Request) -> web.Response:
        req = parse_chat(await self._body(request), request.headers.get("X-Session-Id"))
        self._check_size(text_chars([req.messages, req.tools]))
        self.counters["requests"] += 1
        sid = request.match_info.get("sid") or req.session_id or uuid.uuid4().hex
        session = self._session(sid)
        async with session.lock:  # held across the thread hop: nothing else touches this session meanwhile
            prep = await self._off_loop(session.prepare, req.messages, req.tools, self.chat)
            room = self.cfg.max_length - prep.prompt.shape[0]
            if room <= 0:
                raise RequestError(f"the session has {prep.prompt.shape[0]} tokens; max_length is "
                                   f"{self.cfg.max_length}", code="context_length_exceeded")
            if session.forced is None:
                sampling, max_tokens = req.sampling, min(req.max_tokens or self.cfg.default_max_tokens, room)
            else:  # the owner's sampling; its max_tokens caps what the agent asks for
                cap = session.forced.max_tokens
                sampling, max_tokens = session.forced, min(req.max_tokens or cap, cap, room)
            assert self._sampler is not None
            turn = await self._sampler.sample(prep.prompt, with_max_tokens(sampling, max_tokens),
                                              key=f"{sid}:{session.turns}")
            text = self.chat.decode(turn.token_ids)
            parse = req.parse_tools and self.cfg.tool_parser == "hermes"
            content, calls = parse_tool_calls(text) if parse else (text, [])
            reply = assistant_message(content, calls)
            session.commit(prep, turn, reply)
        ids = turn.token_ids.tolist()
        extra: dict[str, Any] = {"session_id": sid, "weight_version": max(turn.versions)}
        if prep.drift is not None:
            self.counters["drift"] += 1
            extra["drift"] = prep.drift
            log.debug("session %s drift: %s", sid, prep.drift)
        if req.return_token_ids:
            extra["prompt_token_ids"] = prep.prompt.tolist()
        lps = (logprob_entries([self.chat.token_text(t) for t in ids], turn.logprobs.tolist(), req.top_logprobs)
               if req.logprobs else None)
        finish = "tool_calls" if calls else ("length" if turn.finish_reason == "length" else "stop")
        body = completion(model=req.model or self.model_name, message=reply, finish_reason=finish,
                          prompt_tokens=int(prep.prompt.shape[0]), completion_tokens=len(ids), logprobs=lps,
                          extra=extra)
        if req.return_token_ids:
            body["choices"][0]["token_ids"] = ids
        return web.json_response(body)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        if "messages" in body:
            if not isinstance(body["messages"] or [], list):
                raise RequestError("messages must be a list")
            msgs = [normalize_message(m, i) for i, m in enumerate(body["messages"] or [])]
            tools = body.get("tools") or None
            self._check_size(text_chars([msgs, tools]))
            ids = await self._off_loop(self._render_ids, msgs, tools, bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            self._check_size(len(body["prompt"]))
            ids = (await self._off_loop(self.chat.encode, body["prompt"])).tolist()
        else:
            raise RequestError('give "messages" (a chat) or "prompt" (text)')
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.cfg.max_length})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list):
            raise RequestError('"tokens" must be a list of token ids (integers in [0, 2**32))')
        self._check_size(len(tokens), "tokens to detokenize")
        if not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens):
            raise RequestError('"tokens" must be a list of token ids (integers in [0, 2**32))')
        text = await self._off_loop(self.chat.decode, tokens, skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def list_sessions(self, request: web.Request) -> web.Response:
        return web.json_response({"sessions": [s.summary() for s in self.sessions.values()]})

    def _lookup(self, request: web.Request) -> Session:
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            raise web.HTTPNotFound(text='{"error": {"message": "no such session", "code": "not_found"}}',
                                   content_type="application/json")
        return s

    def _stitched(self, s: Session, **kw: Any) -> dict[str, Any]:
        return {"session_id": s.id, "trajectories": [trajectory_to_json(t) for t in s.trajectories(**kw)],
                "drift": list(s.drift)}

    async def get_session(self, request: web.Request) -> web.Response:
        s = self._lookup(request)
        async with s.lock:
            return web.json_response(self._stitched(s))

    async def finish(self, request: web.Request) -> web.Response:
        s = self._lookup(request)
        body = await self._body(request) if request.can_read_body else {}
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        if not isinstance(body.get("extra_logs") or {}, dict) or not isinstance(body.get("info") or {}, dict):
            raise RequestError("finish: extra_logs and info must be JSON objects")
        try:
            kw = {"reward": None if body.get("reward") is None else float(body["reward"]),
                  "score": None if body.get("score") is None else float(body["score"]),
                  "extra_logs": {str(k): float(v) for k, v in (body.get("extra_logs") or {}).items()},
                  "group_id": str(body.get("group_id") or ""), "info": dict(body.get("info") or {})}
        except (TypeError, ValueError, OverflowError) as e:
            raise RequestError(f"finish: {e}") from None
        async with s.lock:
            try:
                out = self._stitched(s, **kw)
            except ValueError as e:  # info that is not msgpack-native, ...
                raise RequestError(f"finish: {e}") from None
        self.sessions.pop(s.id, None)
        return web.json_response(out)

    async def delete_session(self, request: web.Request) -> web.Response:
        s = self._lookup(request)
        self.sessions.pop(s.id, None)
        return web.json_response({"deleted": s.id})
