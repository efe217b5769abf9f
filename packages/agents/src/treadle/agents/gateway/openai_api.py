"""OpenAI chat-completions request parsing and response building (pure: dicts in, dicts out).

Accepted request fields: ``messages`` (roles system / developer / user / assistant / tool;
content as text, null, or a list of text parts), ``tools``, ``tool_choice`` ("none" turns tool
parsing off), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``logprobs``, ``top_logprobs``, ``n`` (1 only), ``stream`` (false only), ``stop`` (refused: the
pool works on token ids; use ``stop_token_ids``), and the extensions ``session_id`` (also the
``X-Session-Id`` header; OpenRLHF's executor passes it in ``extra_body``), ``top_k``,
``min_tokens``, ``stop_token_ids``, ``return_token_ids`` (vLLM's: the prompt's and the
completion's token ids in the response). Anything malformed raises ``RequestError``
(HTTP 400 with an OpenAI-style error body).

``top_logprobs`` lists only the sampled token: the rollout pool returns the sampled token's
logprob, not alternatives.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from treadle.agents.api import Message
from treadle.agents.tools import ToolCall
from treadle.common.records import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A malformed request; ``code`` is OpenAI's error code, ``status`` the HTTP status."""

    def __init__(self, message: str, code: str = "invalid_request_error", status: int = 400) -> None:
        super().__init__(message)
        self.code, self.status = code, status


def error_body(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code, "param": None}}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    sampling: SamplingParams
    max_tokens: int | None
    logprobs: bool
    top_logprobs: int
    session_id: str | None
    return_token_ids: bool
    model: str


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise RequestError(f"{where}: only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string, null or a list of text parts")


def normalize_message(m: Any, i: int) -> Message:
    """A message with text content ("" for null), roles checked; developer becomes system."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(f"messages[{i}] must be an object with a role in {list(ROLES)}")
    out = {k: v for k, v in m.items() if v is not None}
    out["role"] = "system" if m["role"] == "developer" else m["role"]
    out["content"] = _text(m.get("content"), f"messages[{i}]") or ""
    if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
        raise RequestError(f"messages[{i}].tool_calls must be a list")
    return out


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    return kind(v)


def _sampling(body: dict[str, Any]) -> tuple[SamplingParams, int | None]:
    max_tokens = _number(body, "max_completion_tokens", int, None) or _number(body, "max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise RequestError("stop_token_ids must be a list of integers")
    try:
        sp = SamplingParams(temperature=_number(body, "temperature", float, 1.0), top_p=_number(body, "top_p", float, 1.0),
                            top_k=_number(body, "top_k", int, -1), seed=_number(body, "seed", int, None),
                            min_tokens=_number(body, "min_tokens", int, 0), stop_token_ids=stop_ids,
                            max_tokens=max(max_tokens or 1, _number(body, "min_tokens", int, 0), 1))
    except ValueError as e:
        raise RequestError(str(e)) from None
    return sp, max_tokens


def parse_chat(body: Any, header_session: str | None = None) -> ChatRequest:
    """A ``ChatRequest`` from a chat-completions JSON body; ``RequestError`` naming what is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by treadle-agents", code="unsupported_parameter")
    if body.get("stop"):
        raise RequestError("stop strings are not supported (the pool works on token ids): use stop_token_ids",
                           code="unsupported_parameter")
    if _number(body, "n", int, 1) != 1:
        raise RequestError("n must be 1: send one request per sample", code="unsupported_parameter")
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list")
    sampling, max_tokens = _sampling(body)
    session = body.get("session_id") or header_session
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= 256):
        raise RequestError("session_id must be a non-empty string of at most 256 characters")
    top = _number(body, "top_logprobs", int, 0)
    return ChatRequest(messages=[normalize_message(m, i) for i, m in enumerate(msgs)], tools=tools,
                       parse_tools=bool(tools) and body.get("tool_choice") != "none", sampling=sampling,
                       max_tokens=max_tokens, logprobs=bool(body.get("logprobs")), top_logprobs=top,
                       session_id=session, return_token_ids=bool(body.get("return_token_ids")),
                       model=str(body.get("model") or ""))


def assistant_message(content: str, calls: list[ToolCall]) -> Message:
    """The reply's message: content (None when only tool calls), tool_calls when any."""
    msg: Message = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
    return msg


def logprob_entries(tokens: list[str], logprobs: list[float], top: int) -> list[dict[str, Any]]:
    out = []
    for tok, lp in zip(tokens, logprobs, strict=True):
        entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
        entry["top_logprobs"] = [dict(entry)] if top > 0 else []
        out.append(entry)
    return out


def completion(*, model: str, message: Message, finish_reason: str, prompt_tokens: int, completion_tokens: int,
               logprobs: list[dict[str, Any]] | None, extra: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion object (one choice) plus treadle's top-level extras."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            **extra}
