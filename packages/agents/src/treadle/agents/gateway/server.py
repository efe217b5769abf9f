"""The OpenAI-compatible agent gateway: chat completions over the rollout pool, token-exact sessions.

Routes (aiohttp)::

    GET  /health                      {"status": "ok" | "degraded", "rollout": ..., "sessions": N}; no token needed
    GET  /v1/models                   the served model (id, max_model_len)
    POST /v1/chat/completions         OpenAI chat completions (``openai_api``): logprobs and top_logprobs, tool calls
                                      (Hermes <tool_call> blocks parsed into ``tool_calls``), stop strings,
                                      n, stream (server-sent events, ``responses``), plus "session_id",
                                      "weight_version" and, on drift, "drift"
    POST /v1/completions              OpenAI (legacy) completions: a text or token-id prompt, recorded in a
                                      session as tokens (it extends the session when the recorded tokens
                                      are its prefix)
    GET  /metrics                     Prometheus text format (``metrics``)
    POST /tokenize                    {"messages", "tools"?, "add_generation_prompt"?} or {"prompt"}
                                      -> {"tokens", "count", "max_model_len"} (vLLM's shape)
    POST /detokenize                  {"tokens"} -> {"prompt"}
    GET  /v1/sessions                 every open session's summary
    GET  /v1/sessions/{id}            {"session_id", "trajectories": [...], "drift": [...]} (stays open)
    POST /v1/sessions/{id}/finish     body {"reward"?, "score"?, "extra_logs"?, "group_id"?, "info"?}:
                                      the same, with the reward set; the session is closed
    DELETE /v1/sessions/{id}          drop a session
    POST /s/{id}/v1/chat/completions  the same chat and completions routes bound to session {id} by its
    POST /s/{id}/v1/completions       path, so that an unmodified OpenAI client given base_url
    GET  /s/{id}/v1/models            .../s/{id}/v1 stays in it

Each request names its session with ``session_id`` in the body (OpenAI clients: ``extra_body``)
or the ``X-Session-Id`` header; without one, the request starts a fresh session whose id the
response carries. Requests of one session are served one at a time (a per-session lock);
sessions idle longer than ``session_ttl_s`` (or beyond ``max_sessions``, least recently used
first) are dropped.

Token in, token out, whatever the request shape: the tokens a session records are the ones the
engine sampled and the client was shown. A stop string cuts the reply before it (OpenAI's text)
and the recorded tokens after the token that completed it (what an engine checking stop strings
would have sampled; the pool samples on, the gateway drops the rest). A streamed reply is
sampled whole, then sent token by token: the rollout pool answers per sample, not per token, so
streaming changes the shape of the answer, not its latency. ``n > 1`` forks the session: choice
i is recorded in session ``{id}-n{i}`` (a copy of the session's tokens plus that choice), which
the client continues or finishes like any other; a fresh session's parent is dropped. With a bearer token every route but /health needs
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
import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from treadle.agents.api import Message
from treadle.agents.chat import ChatFormat, TemplateError
from treadle.agents.gateway.config import GatewayConfig
from treadle.agents.gateway.metrics import GatewayMetrics
from treadle.agents.gateway.openai_api import (
    Common,
    RequestError,
    error_body,
    normalize_message,
    parse_chat,
    parse_completion,
)
from treadle.agents.gateway.responses import (
    Choice,
    assistant_message,
    chat_chunks,
    chat_completion,
    make_choice,
    sse,
    text_chunks,
    text_completion,
)
from treadle.agents.gateway.session import Session
from treadle.agents.jsonio import trajectory_to_json
from treadle.agents.sampler import RolloutSampler, Turn, with_max_tokens
from treadle.common.errors import TreadleError
from treadle.common.log import get_logger
from treadle.common.records import SamplingParams

log = get_logger(__name__)
OPEN_PATHS = frozenset({"/health"})


def _json_error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, code, param), status=status)


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
        self.metrics = GatewayMetrics()
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
        app = web.Application(middlewares=[self.metrics.middleware, self._auth, self._errors], client_max_size=64 << 20)
        app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat_completions), web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize), web.get("/v1/sessions", self.list_sessions),
            web.get("/v1/sessions/{sid}", self.get_session), web.post("/v1/sessions/{sid}/finish", self.finish),
            web.delete("/v1/sessions/{sid}", self.delete_session),
            web.post("/v1/completions", self.completions), web.get("/metrics", self.metrics_route),
            web.post("/s/{sid}/v1/chat/completions", self.chat_completions),
            web.post("/s/{sid}/v1/completions", self.completions), web.get("/s/{sid}/v1/models", self.models)])
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
            return _json_error(e.status, str(e), e.code, e.param)
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
            s = Session(sid)
            self._register(s)
        self.sessions.move_to_end(sid)
        return s

    def _sampling(self, session: Session, common: Common, room: int) -> tuple[SamplingParams, int]:
        if session.forced is None:
            return common.sampling, min(common.max_tokens or self.cfg.default_max_tokens, room)
        cap = session.forced.max_tokens  # the owner's sampling; its max_tokens caps what the agent asks for
        forced, top = session.forced, common.sampling.top_logprobs
        if top:  # alternatives are what the agent is shown, not how it samples: asked for as it asks
            forced = msgspec.structs.replace(forced, logprobs=True, top_logprobs=top)
        return forced, min(common.max_tokens or cap, cap, room)

    def _choice_ids(self, sid: str, session: Session, n: int) -> list[str]:
        """Session ids the choices are recorded in: the request's for n = 1, ``{sid}-n{i}`` forks for n > 1."""
        if n == 1:
            return [sid]
        if session.forced is not None:
            raise RequestError("n > 1 in a session a trainer opened: the trainer records one trajectory per episode "
                               "(send one request per sample)", code="unsupported_parameter", param="n")
        ids = [f"{sid}-n{i}" for i in range(n)]
        taken = [c for c in ids if c in self.sessions]
        if taken:
            raise RequestError(f"session {taken[0]} (a choice of an earlier n > 1 request in session {sid}) is still "
                               "open: finish or delete it, or use another session_id", code="session_exists", status=409)
        return ids

    async def _sample(self, session: Session, prompt: np.ndarray, common: Common, key: str) -> list[Turn]:
        """``common.n`` turns for ``prompt`` (choice i with seed + i when a seed is set, so choices differ)."""
        room = self.cfg.max_length - prompt.shape[0]
        if room <= 0:
            raise RequestError(f"the session has {prompt.shape[0]} tokens; max_length is {self.cfg.max_length}",
                               code="context_length_exceeded", param="messages")
        sampling, max_tokens = self._sampling(session, common, room)
        assert self._sampler is not None

        def nth(i: int) -> SamplingParams:
            sp = with_max_tokens(sampling, max_tokens)
            return sp if sp.seed is None or i == 0 else msgspec.structs.replace(sp, seed=sp.seed + i)

        return list(await asyncio.gather(*(self._sampler.sample(prompt, nth(i), key=key if common.n == 1 else f"{key}.c{i}")
                                           for i in range(common.n))))

    def _record(self, sid: str, session: Session, prep: Any, names: list[str], turns: list[Turn],
                replies: list[Message | None]) -> None:
        """Commit each choice to its session (forks of ``session`` for n > 1; see ``_choice_ids``)."""
        if len(names) == 1:
            session.commit(prep, turns[0], replies[0])
            return
        for name, turn, reply in zip(names, turns, replies, strict=True):
            child = session.fork(name)
            child.commit(prep, turn, reply)
            self._register(child)
        if not session.segments:  # a fresh session: its choices are the sessions
            self.sessions.pop(sid, None)

    def _register(self, s: Session) -> None:
        self.sessions[s.id] = s
        self.counters["sessions"] += 1
        while len(self.sessions) > self.cfg.max_sessions:
            self.sessions.popitem(last=False)

    def _extras(self, sid: str, names: list[str], prep: Any, turns: list[Turn], common: Common,
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        top: dict[str, Any] = {"session_id": sid, "weight_version": max(v for t in turns for v in t.versions)}
        if prep.drift is not None:
            self.counters["drift"] += 1
            self.metrics.drift.inc()
            top["drift"] = prep.drift
            log.debug("session %s drift: %s", sid, prep.drift)
        if common.return_token_ids:
            top["prompt_token_ids"] = prep.prompt.tolist()
        return [{"session_id": n} if common.n > 1 else {} for n in names], top

    async def _respond(self, request: web.Request, common: Common, body: dict[str, Any] | None,
                       chunks: Any, prompt_tokens: int, choices: list[Choice]) -> web.StreamResponse:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.completion_tokens.inc(sum(len(c.token_ids) for c in choices))
        if not common.stream:
            return web.json_response(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(sse(chunk))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat(await self._body(request), request.headers.get("X-Session-Id"))
        common = req.common
        self._check_size(text_chars([req.messages, req.tools]))
        self.counters["requests"] += 1
        sid = request.match_info.get("sid") or common.session_id or uuid.uuid4().hex
        session = self._session(sid)
        async with session.lock:  # held across the thread hop: nothing else touches this session meanwhile
            names = self._choice_ids(sid, session, common.n)
            prep = await self._off_loop(session.prepare, req.messages, req.tools, self.chat)
            turns = await self._sample(session, prep.prompt, common, f"{sid}:{session.turns}")
            parse = req.parse_tools and self.cfg.tool_parser == "hermes"
            made = [await self._off_loop(make_choice, self.chat, t, common.stop, parse, common.stream) for t in turns]
            choices, recorded = [c for c, _ in made], [t for _, t in made]
            self._record(sid, session, prep, names, recorded, [assistant_message(c.text, c.calls) for c in choices])
        extra, top = self._extras(sid, names, prep, recorded, common)
        kw = {"model": common.model or self.model_name, "choices": choices, "logprobs": req.logprobs,
              "top": req.top_logprobs, "prompt_tokens": int(prep.prompt.shape[0]), "token_ids": common.return_token_ids,
              "extra": extra, "top_extra": top}
        if common.stream:
            return await self._respond(request, common, None, chat_chunks(include_usage=common.include_usage, **kw),
                                       kw["prompt_tokens"], choices)
        return await self._respond(request, common, chat_completion(**kw), None, kw["prompt_tokens"], choices)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion(await self._body(request), request.headers.get("X-Session-Id"))
        common = req.common
        if isinstance(req.prompt, str):
            self._check_size(len(req.prompt))
            prompt = await self._off_loop(self.chat.encode, req.prompt)
        else:
            self._check_size(len(req.prompt), "prompt tokens")
            prompt = np.asarray(req.prompt, dtype=np.int32)
        self.counters["requests"] += 1
        sid = request.match_info.get("sid") or common.session_id or uuid.uuid4().hex
        session = self._session(sid)
        async with session.lock:
            names = self._choice_ids(sid, session, common.n)
            prep = session.prepare_tokens(prompt)
            turns = await self._sample(session, prep.prompt, common, f"{sid}:{session.turns}")
            pieces = common.stream or req.logprobs
            made = [await self._off_loop(make_choice, self.chat, t, common.stop, False, pieces) for t in turns]
            choices, recorded = [c for c, _ in made], [t for _, t in made]
            self._record(sid, session, prep, names, recorded, [None] * len(turns))
        extra, top = self._extras(sid, names, prep, recorded, common)
        kw = {"model": common.model or self.model_name, "choices": choices, "logprobs": req.logprobs,
              "prompt_tokens": int(prep.prompt.shape[0]), "token_ids": common.return_token_ids, "extra": extra,
              "top_extra": top}
        if common.stream:
            return await self._respond(request, common, None, text_chunks(include_usage=common.include_usage, **kw),
                                       kw["prompt_tokens"], choices)
        return await self._respond(request, common, text_completion(**kw), None, kw["prompt_tokens"], choices)

    async def metrics_route(self, request: web.Request) -> web.Response:
        self.metrics.sessions.set(len(self.sessions))
        return web.Response(body=self.metrics.registry.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

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
