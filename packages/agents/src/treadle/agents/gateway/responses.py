"""OpenAI response bodies and server-sent-event chunks for the gateway (pure: values in, dicts out).

A ``Choice`` is one finished sample as the client sees it: its text (cut before a stop string),
its token ids (up to and including the token that completed the stop string: what the policy
sampled and the session records), their logprobs, each token's alternatives when the request
asked for ``top_logprobs`` (the pool's top k of the distribution the token was drawn from, decoded
as the sampled tokens are; ``-inf`` sent as -9999.0, as OpenAI and vLLM do: JSON has no
infinity), tool calls, and OpenAI's finish reason.

Streaming (``chat_chunks``, ``text_chunks``) follows OpenAI's order: per choice, a first chunk
with the role, then one chunk per sampled token (its text delta and, when asked, its logprob
entry), then one with the finish reason; then, with ``stream_options.include_usage``, a chunk
with empty ``choices`` and the usage; the caller ends the stream with ``data: [DONE]``. The
text of a token that ends inside a multi-byte character is held back until the character is
complete, so the deltas concatenate to the choice's text. A reply with tool calls streams its
content and its ``tool_calls`` as one delta each.

Not here: parsing (``openai_api``), HTTP and sessions (``server``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.agents.api import Message
from treadle.agents.chat import ChatFormat
from treadle.agents.sampler import Turn
from treadle.agents.tools import ToolCall, parse_tool_calls

LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM send for a logprob of -inf (a token top-k / top-p cut away)
Alternatives = list[tuple[str, float]]
"""One token's most likely tokens: (text, logprob) pairs, most likely first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    text: str
    """The reply's text: the decoded tokens, cut before the first stop string."""
    token_ids: list[int]
    """The sampled tokens the session records (up to the one completing a stop string)."""
    logprobs: list[float]
    token_texts: list[str]
    """Each token's own text (``ChatFormat.token_text``), for logprob entries."""
    alternatives: list[Alternatives]
    """Per token, its ``top_logprobs`` alternatives (``Alternatives``); empty when none were asked for."""
    pieces: list[str]
    """Each token's text delta; ``"".join(pieces) == text`` (``text_pieces``)."""
    calls: list[ToolCall]
    finish_reason: str
    """OpenAI's: "stop", "length" or "tool_calls"."""


def token_deltas(decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> list[str]:
    """One text delta per token in linear time: each token's text is read against a short window of
    the tokens before it (TGI's and vLLM's incremental detokenizer), since a token's own decoding
    can differ from what it adds to its prefix (leading spaces, bytes of a split character). A
    delta ending in U+FFFD (a character not yet complete) is held back until a later token
    completes it, so ``"".join(token_deltas(d, ids))`` is ``d(ids)`` less an incomplete last character."""
    out, prefix_at, read_at = [], 0, 0
    for k in range(1, len(ids) + 1):
        prefix, new = decode(ids[prefix_at:read_at]), decode(ids[prefix_at:k])
        if len(new) > len(prefix) and not new.endswith("\ufffd") and new.startswith(prefix):
            out.append(new[len(prefix):])
            prefix_at, read_at = read_at, k
        else:
            out.append("")
    return out


def cut_at_stop(decode: Callable[[Sequence[int]], str], ids: Sequence[int], stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop string ends a sample: ``(k, text)`` or None when none occurs.

    ``text`` is the decoded sample up to (not including) the earliest occurrence of any string in
    ``stops``; ``k`` is the fewest leading tokens whose text covers that occurrence entirely, so
    ``ids[:k]`` is what an engine that checks stop strings after each token would have sampled.
    """
    full = decode(ids)
    hits = [(full.find(s), s) for s in stops if s in full]
    if not hits:
        return None
    pos, stop = min(hits)
    end, acc = pos + len(stop), ""
    for k, d in enumerate(token_deltas(decode, ids), start=1):
        acc += d
        if len(acc) >= end and acc[pos:end] == stop:
            return k, full[:pos]
    return len(ids), full[:pos]  # deltas that do not add up to the whole: keep every token


def text_pieces(decode: Callable[[Sequence[int]], str], ids: Sequence[int], text: str) -> list[str]:
    """One text delta per token (``token_deltas``) clipped to ``text``, a prefix of ``decode(ids)``;
    they concatenate to ``text`` (the last token gets what is left; deltas that are not the text's
    prefix, e.g. tool-call markup parsed out, put all of it on the last token)."""
    if not ids:
        return []
    out, done = [], 0
    for d in token_deltas(decode, ids):
        take = d[:max(0, len(text) - done)]
        if text[done:done + len(take)] != take:
            return [""] * (len(ids) - 1) + [text]
        out.append(take)
        done += len(take)
    out[-1] += text[done:]
    return out


def make_choice(chat: ChatFormat, turn: Turn, stops: Sequence[str], parse_tools: bool,
                pieces: bool) -> tuple[Choice, Turn]:
    """What the client sees of ``turn`` and the turn the session records (cut at a stop string,
    finish reason "stop_string": no stop token ended it, so the next turn closes it whole).
    ``pieces``: compute the per-token text deltas (streaming, completions logprobs)."""
    ids = turn.token_ids.tolist()
    cut = cut_at_stop(chat.decode, ids, stops) if stops else None
    if cut is None:
        text = chat.decode(ids)
    else:  # the pool sampled past the stop string; an engine checking stop strings would not have
        k, text = cut
        ids = ids[:k]
        turn = Turn(token_ids=np.asarray(turn.token_ids[:k]), logprobs=np.asarray(turn.logprobs[:k]),
                    versions=turn.versions, finish_reason="stop_string",
                    top_token_ids=None if turn.top_token_ids is None else np.asarray(turn.top_token_ids[:k]),
                    top_logprobs=None if turn.top_logprobs is None else np.asarray(turn.top_logprobs[:k]))
    content, calls = parse_tool_calls(text) if parse_tools else (text, [])
    finish = "tool_calls" if calls else ("length" if turn.finish_reason == "length" else "stop")
    texts: dict[int, str] = {}  # alternatives recur from token to token: each id decoded once

    def text_of(t: int) -> str:
        if t not in texts:
            texts[t] = chat.token_text(t)
        return texts[t]

    alts: list[Alternatives] = [[] for _ in ids]
    if turn.top_token_ids is not None and turn.top_logprobs is not None:
        alts = [[(text_of(t), max(lp, LOGPROB_FLOOR)) for t, lp in zip(row_ids, row_lps, strict=True)]
                for row_ids, row_lps in zip(turn.top_token_ids.tolist(), turn.top_logprobs.tolist(), strict=True)]
    return Choice(text=content, token_ids=ids, logprobs=turn.logprobs.tolist(),
                  token_texts=[text_of(t) for t in ids], alternatives=alts,
                  pieces=text_pieces(chat.decode, ids, content) if pieces else [],
                  calls=calls, finish_reason=finish), turn


def _entry(tok: str, lp: float) -> dict[str, Any]:
    return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}


def logprob_entry(tok: str, lp: float, alts: Alternatives, top: int) -> dict[str, Any]:
    """A chat ``logprobs.content`` entry: the sampled token and its ``top`` most likely alternatives."""
    return {**_entry(tok, lp), "top_logprobs": [_entry(t, a) for t, a in alts[:top]]}


def logprob_entries(c: Choice, top: int) -> list[dict[str, Any]]:
    return [logprob_entry(t, lp, alts, top) for t, lp, alts in zip(c.token_texts, c.logprobs, c.alternatives,
                                                                   strict=True)]


def top_map(tok: str, lp: float, alts: Alternatives) -> dict[str, float]:
    """A legacy completions ``top_logprobs`` entry: the sampled token, then its alternatives, by text
    (vLLM's: up to k + 1 entries; tokens of the same text keep the first, the sampled one's)."""
    out = {tok: lp}
    for t, a in alts:
        out.setdefault(t, a)
    return out


def assistant_message(content: str, calls: list[ToolCall]) -> Message:
    """The reply's message: content (None when only tool calls), tool_calls when any."""
    msg: Message = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
    return msg


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_completion(*, model: str, choices: list[Choice], logprobs: bool, top: int, prompt_tokens: int,
                    token_ids: bool, extra: list[dict[str, Any]], top_extra: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion object; ``extra[i]`` is merged into choice i, ``top_extra`` at the top level."""
    out = []
    for i, c in enumerate(choices):
        lps = {"content": logprob_entries(c, top), "refusal": None} if logprobs else None
        ch = {"index": i, "message": assistant_message(c.text, c.calls), "finish_reason": c.finish_reason,
              "logprobs": lps, **extra[i]}
        if token_ids:
            ch["token_ids"] = c.token_ids
        out.append(ch)
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)), **top_extra}


def _text_logprobs(c: Choice, offset: int) -> dict[str, Any]:
    offsets, at = [], offset
    for p in c.pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": c.token_texts, "token_logprobs": c.logprobs,
            "top_logprobs": [top_map(t, lp, alts) for t, lp, alts in zip(c.token_texts, c.logprobs, c.alternatives,
                                                                          strict=True)],
            "text_offset": offsets}


def text_completion(*, model: str, choices: list[Choice], logprobs: bool, prompt_tokens: int, token_ids: bool,
                    extra: list[dict[str, Any]], top_extra: dict[str, Any]) -> dict[str, Any]:
    """A text_completion object (``/v1/completions``)."""
    out = []
    for i, c in enumerate(choices):
        ch = {"index": i, "text": c.text, "finish_reason": c.finish_reason,
              "logprobs": _text_logprobs(c, 0) if logprobs else None, **extra[i]}
        if token_ids:
            ch["token_ids"] = c.token_ids
        out.append(ch)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)), **top_extra}


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``) and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def chat_chunks(*, model: str, choices: list[Choice], logprobs: bool, top: int, prompt_tokens: int,
                include_usage: bool, token_ids: bool, extra: list[dict[str, Any]],
                top_extra: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """chat.completion.chunk objects for ``choices`` (see the module docstring)."""
    head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None, **more: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish, **more}],
                **top_extra}

    for i, c in enumerate(choices):
        yield chunk(i, {"role": "assistant", "content": ""})
        if c.calls:
            msg = assistant_message(c.text, c.calls)
            lp = {"content": logprob_entries(c, top), "refusal": None} if logprobs else None
            more = {"token_ids": c.token_ids} if token_ids else {}
            yield chunk(i, {"content": msg["content"], "tool_calls": [{"index": j, **tc} for j, tc
                                                                        in enumerate(msg["tool_calls"])]},
                        logprobs=lp, **more)
        else:
            for tok, lp, alts, piece, tid in zip(c.token_texts, c.logprobs, c.alternatives, c.pieces, c.token_ids,
                                                 strict=True):
                ch = chunk(i, {"content": piece})
                if logprobs:
                    ch["choices"][0]["logprobs"] = {"content": [logprob_entry(tok, lp, alts, top)], "refusal": None}
                if token_ids:
                    ch["choices"][0]["token_ids"] = [tid]
                yield ch
        yield chunk(i, {}, c.finish_reason, **extra[i])
    if include_usage:
        yield {**head, "choices": [], "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
               **top_extra}


def text_chunks(*, model: str, choices: list[Choice], logprobs: bool, prompt_tokens: int, include_usage: bool,
                token_ids: bool, extra: list[dict[str, Any]], top_extra: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """text_completion chunks for ``choices``: one per token, then the finish reason, then usage."""
    head = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model}
    for i, c in enumerate(choices):
        at = 0
        for tok, lp, alts, piece, tid in zip(c.token_texts, c.logprobs, c.alternatives, c.pieces, c.token_ids,
                                             strict=True):
            ch = {"index": i, "text": piece, "finish_reason": None,
                  "logprobs": {"tokens": [tok], "token_logprobs": [lp], "top_logprobs": [top_map(tok, lp, alts)],
                               "text_offset": [at]} if logprobs else None}
            if token_ids:
                ch["token_ids"] = [tid]
            at += len(piece)
            yield {**head, "choices": [ch], **top_extra}
        yield {**head, "choices": [{"index": i, "text": "", "finish_reason": c.finish_reason, "logprobs": None,
                                    **extra[i]}], **top_extra}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
               **top_extra}
