"""OpenAI request parsing for the gateway (pure: dicts in, typed requests out).

Two request kinds: chat completions (``parse_chat``) and legacy completions (``parse_completion``).

Chat fields: ``messages`` (roles system / developer / user / assistant / tool; content as text,
null, or a list of text parts), ``tools``, ``tool_choice`` ("none" turns tool parsing off),
``parallel_tool_calls``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
``seed``, ``logprobs``, ``top_logprobs`` (0..``MAX_TOP_LOGPROBS``), ``n`` (1..``MAX_N``), ``stream``,
``stream_options`` (``include_usage``), ``stop`` (a string or up to ``MAX_STOP`` strings),
``user``, ``frequency_penalty`` / ``presence_penalty`` (0 only), and the extensions
``session_id`` (also the ``X-Session-Id`` header; OpenRLHF's executor passes it in
``extra_body``), ``top_k``, ``min_tokens``, ``stop_token_ids``, ``return_token_ids`` (vLLM's:
the prompt's and the completion's token ids in the response).

Completions fields: ``prompt`` (a string, a list of token ids, or a one-element list of either),
and the sampling fields above, with ``logprobs`` an integer k as in OpenAI's legacy API (0..20 as
vLLM's server takes; OpenAI's own stops at 5): the sampled token's logprob and the k most likely.

Either way the k alternatives are asked of the rollout pool (``SamplingParams.top_logprobs``): the
engines return them from the distribution each token was drawn from.

Any other field, or a malformed one, raises ``RequestError`` (HTTP 400, OpenAI's error body with
``param`` naming the field): a client that asks for something treadle would silently not do
gets told so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from treadle.agents.api import Message
from treadle.agents.chat import refuse_non_text
from treadle.common.records import MAX_TOP_LOGPROBS, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 128  # OpenAI's limit
MAX_STOP = 4  # OpenAI's limit
SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "n", "stream", "stream_options", "stop", "user",
    "frequency_penalty", "presence_penalty", "session_id", "top_k", "min_tokens", "stop_token_ids",
    "return_token_ids", "logprobs"})
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                                 "top_logprobs"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt"}


class RequestError(ValueError):
    """A malformed request; ``code`` is OpenAI's error code, ``status`` the HTTP status, ``param`` the field."""

    def __init__(self, message: str, code: str = "invalid_request_error", status: int = 400,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.status, self.param = code, status, param


def error_body(message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code, "param": param}}


@dataclass(frozen=True, slots=True, kw_only=True)
class Common:
    """What chat and completions requests share."""

    sampling: SamplingParams
    """The request's sampling; ``top_logprobs`` is the alternatives asked for (0: none)."""
    max_tokens: int | None
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    session_id: str | None
    return_token_ids: bool
    model: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    logprobs: bool
    top_logprobs: int
    common: Common


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRequest:
    prompt: str | list[int]
    logprobs: bool
    top_logprobs: int
    """The legacy ``logprobs`` integer: alternatives per token besides the sampled one."""
    common: Common


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        try:
            refuse_non_text(content, where)
        except ValueError as e:
            raise RequestError(str(e), param=where) from None
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}: content must be a string, null or a list of text parts", param=where)


def normalize_message(m: Any, i: int) -> Message:
    """A message with text content ("" for null), roles checked; developer becomes system."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(f"messages[{i}] must be an object with a role in {list(ROLES)}", param=f"messages[{i}]")
    out = {k: v for k, v in m.items() if v is not None}
    out["role"] = "system" if m["role"] == "developer" else m["role"]
    out["content"] = _text(m.get("content"), f"messages[{i}]") or ""
    if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
        raise RequestError(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
    return out


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}", param=name)
    return kind(v)


def _unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    for k, v in body.items():
        if k not in known and v is not None:
            raise RequestError(f"unknown or unsupported field {k!r} (treadle-agents accepts: {', '.join(sorted(known))})",
                               code="unsupported_parameter", param=k)
    for k in ("frequency_penalty", "presence_penalty"):
        if _number(body, k, float, 0.0) != 0.0:
            raise RequestError(f"{k} must be 0 (penalties are not applied by the rollout pool)",
                               code="unsupported_parameter", param=k)


def parse_stop(v: Any) -> tuple[str, ...]:
    """``stop``: null, a string, or a list of at most ``MAX_STOP`` non-empty strings."""
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, "
                           f"got {v!r}", param="stop")
    return tuple(dict.fromkeys(stops))


def _common(body: dict[str, Any], header_session: str | None, max_tokens_field: str | None) -> Common:
    max_tokens = (_number(body, max_tokens_field, int, None) if max_tokens_field else None) \
        or _number(body, "max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise RequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
    n = _number(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be in [1, {MAX_N}], got {n}", param="n")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_usage"}):
        raise RequestError(f"stream_options must be an object with only include_usage, got {opts!r}",
                           param="stream_options")
    if opts and not body.get("stream"):
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    session = body.get("session_id") or header_session
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= 256):
        raise RequestError("session_id must be a non-empty string of at most 256 characters", param="session_id")
    min_tokens = _number(body, "min_tokens", int, 0)
    fields = {"temperature": (float, 1.0), "top_p": (float, 1.0), "top_k": (int, -1), "seed": (int, None)}
    try:
        sp = SamplingParams(**{k: _number(body, k, kind, d) for k, (kind, d) in fields.items()},
                            min_tokens=min_tokens, stop_token_ids=stop_ids, max_tokens=max(max_tokens or 1, min_tokens, 1))
    except ValueError as e:
        param = next((k for k in (*fields, "min_tokens") if k in str(e)), None)
        raise RequestError(str(e), param=param) from None
    return Common(sampling=sp, max_tokens=max_tokens, n=n, stop=parse_stop(body.get("stop")),
                  stream=bool(body.get("stream")), include_usage=bool((opts or {}).get("include_usage")),
                  session_id=session, return_token_ids=bool(body.get("return_token_ids")),
                  model=str(body.get("model") or ""))


def parse_chat(body: Any, header_session: str | None = None) -> ChatRequest:
    """A ``ChatRequest`` from a chat-completions JSON body; ``RequestError`` naming what is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    _unknown(body, CHAT_FIELDS)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list", param="messages")
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list", param="tools")
    common = _common(body, header_session, "max_completion_tokens")
    top = _number(body, "top_logprobs", int, 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
    if top and not body.get("logprobs"):
        raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    return ChatRequest(messages=[normalize_message(m, i) for i, m in enumerate(msgs)], tools=tools,
                       parse_tools=bool(tools) and body.get("tool_choice") != "none",
                       logprobs=bool(body.get("logprobs")), top_logprobs=top, common=_with_top(common, top))


def _with_top(common: Common, top: int) -> Common:
    """``common`` asking the pool for ``top`` alternatives per token."""
    if not top:
        return common
    sp = msgspec.structs.replace(common.sampling, logprobs=True, top_logprobs=top)
    return dataclasses.replace(common, sampling=sp)


def parse_completion(body: Any, header_session: str | None = None) -> CompletionRequest:
    """A ``CompletionRequest`` from a /v1/completions JSON body; ``RequestError`` naming what is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    _unknown(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids_ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                        and 0 <= t < 2**31 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids_ok:
        raise RequestError("prompt must be a non-empty string or a non-empty list of token ids (one prompt per "
                           f"request; use n for several samples), got {str(prompt)[:80]!r}", param="prompt")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {lp!r}", param="logprobs")
    return CompletionRequest(prompt=prompt, logprobs=lp is not None, top_logprobs=lp or 0,
                             common=_with_top(_common(body, header_session, None), lp or 0))
