"""One chat session's exact tokens: recorded turn by turn, never re-tokenized, stitched at the end.

A session holds one or more *segments*; each is an ``EpisodeBuilder`` (prompt, then per request
the new messages' tokens with loss mask 0 and the sampled completion with mask 1), so a segment
becomes one Trajectory with one trainable span per assistant turn.

For each request (``prepare``), the messages are compared with the conversation the segment has
recorded (canonical forms: role, content, tool calls with their arguments as sorted JSON; the
assistant's content compared stripped):

- they extend it: the prompt is the recorded tokens plus the new messages' continuation
  (``ChatFormat.continuation``: closing text after the last turn's stop token, then the
  template's rendering of the new messages and the generation prompt). The recorded tokens are
  also checked against a fresh rendering of the whole conversation; when they are not its
  prefix (the model's tokens are not what the template + tokenizer would produce, or the
  template renders the returned message differently) a ``render`` drift event is recorded. The
  recorded tokens are used regardless: they are what the policy saw.
- they do not (the agent edited or truncated the history, or re-sent it): a ``history`` drift
  event is recorded and a new segment starts from the rendered messages.

Not here: HTTP (``server``), request parsing (``openai_api``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.agents.api import Message
from treadle.agents.builder import EpisodeBuilder
from treadle.agents.chat import ChatFormat
from treadle.agents.sampler import Turn
from treadle.common.records import SamplingParams, Trajectory


def _args(a: Any) -> str:
    if isinstance(a, str):
        try:
            a = json.loads(a)
        except ValueError:
            return a
    return json.dumps(a, sort_keys=True, ensure_ascii=False)


def canonical(m: Message) -> tuple[Any, ...]:
    """What must be equal for two messages to be the same turn of a conversation."""
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function", tc) if isinstance(tc, dict) else {}
        calls.append((fn.get("name"), _args(fn.get("arguments", {}))))
    content = m.get("content") or ""
    if m.get("role") == "assistant":
        content = content.strip()
    return (m.get("role"), content, tuple(calls))


def first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.shape[0] else n


@dataclass(frozen=True, slots=True)
class Prepared:
    """What one request will append to the session (committed only if generation succeeds)."""

    prompt: np.ndarray
    observation: np.ndarray | None  # None: a new segment starts with ``prompt``
    canon: list[tuple[Any, ...]]
    drift: dict[str, Any] | None


class Session:
    """Recorded tokens of one conversation (see the module docstring)."""

    def __init__(self, session_id: str) -> None:
        self.id = session_id
        self.lock = asyncio.Lock()
        self.last_used = time.monotonic()
        self.segments: list[EpisodeBuilder] = []
        self.finish: list[str] = []
        self.drift: list[dict[str, Any]] = []
        self.history: list[tuple[Any, ...]] = []
        self.last: Turn | None = None
        self.turns = 0
        self.forced: SamplingParams | None = None  # the owner's sampling for every request (``open_session``)

    def prepare(self, messages: list[Message], tools: list[dict[str, Any]] | None, chat: ChatFormat) -> Prepared:
        canon = [canonical(m) for m in messages]
        k = len(self.history)
        if not (self.segments and k and len(canon) > k and canon[:k] == self.history):
            drift = None
            if self.segments:
                same = [a == b for a, b in zip(canon, self.history, strict=False)]
                drift = {"kind": "history", "turn": self.turns, "segment": len(self.segments),
                         "at_message": same.index(False) if False in same else len(same)}
            return Prepared(prompt=chat.prompt_ids(messages, tools=tools), observation=None, canon=canon, drift=drift)
        recorded = self.segments[-1].tokens()
        last = self.last
        assert last is not None
        obs = chat.observation_ids(messages[k:], last_token=int(last.token_ids[-1]) if last.token_ids.shape[0] else None,
                                   stopped=last.stopped, tools=tools)
        rendered = chat.prompt_ids(messages, tools=tools)
        at = first_mismatch(recorded, rendered)
        drift = None
        if at < recorded.shape[0]:
            drift = {"kind": "render", "turn": self.turns, "segment": len(self.segments) - 1, "at_token": at,
                     "recorded": int(recorded.shape[0]), "rendered": int(rendered.shape[0])}
        return Prepared(prompt=np.concatenate([recorded, obs]), observation=obs, canon=canon, drift=drift)

    def prepare_tokens(self, prompt: np.ndarray) -> Prepared:
        """A completions request's prompt ids: they extend the last segment when its recorded tokens
        are their prefix (the tokens past it become an observation), else a new segment starts."""
        if self.segments:
            recorded = self.segments[-1].tokens()
            if prompt.shape[0] >= recorded.shape[0] and first_mismatch(recorded, prompt) == recorded.shape[0]:
                return Prepared(prompt=prompt, observation=prompt[recorded.shape[0]:], canon=[], drift=None)
        drift = None if not self.segments else {"kind": "tokens", "turn": self.turns, "segment": len(self.segments),
                                                "at_token": first_mismatch(self.segments[-1].tokens(), prompt)}
        return Prepared(prompt=prompt, observation=None, canon=[], drift=drift)

    def fork(self, session_id: str) -> Session:
        """A copy of this session's recorded state under another id (one per choice of an n > 1 request)."""
        s = Session(session_id)
        s.segments, s.finish = copy.deepcopy(self.segments), list(self.finish)
        s.drift, s.history, s.last, s.turns, s.forced = list(self.drift), list(self.history), self.last, self.turns, self.forced
        return s

    def commit(self, p: Prepared, turn: Turn, reply: Message | None) -> None:
        """Record the request's tokens and the sampled reply (None: a completions request, no messages)."""
        if p.observation is None:
            self.segments.append(EpisodeBuilder(p.prompt))
            self.finish.append("stop")
        else:
            self.segments[-1].add_observation(p.observation)
        self.segments[-1].add_turn(turn.token_ids, turn.logprobs, turn.versions)
        self.finish[-1] = turn.finish_reason
        if p.drift is not None:
            self.drift.append(p.drift)
        self.history = [*p.canon, canonical(reply)] if reply is not None else []
        self.last = turn
        self.turns += 1
        self.last_used = time.monotonic()

    def trajectories(self, *, reward: float | None = None, score: float | None = None,
                     extra_logs: dict[str, float] | None = None, group_id: str = "",
                     info: dict[str, Any] | None = None) -> list[Trajectory]:
        """One Trajectory per segment (usually one), with the reward the agent reported."""
        out = []
        for i, (b, finish) in enumerate(zip(self.segments, self.finish, strict=True)):
            drift = [d for d in self.drift if d["segment"] == i]
            out.append(b.build(reward=reward, score=reward if score is None else score,
                               truncated=finish == "length",
                               finish_reason=finish if finish in ("stop", "length", "abort") else "stop",
                               uid=self.id if i == 0 else f"{self.id}.{i}", group_id=group_id,
                               extra_logs=extra_logs,
                               info={**(info or {}), "session_id": self.id, "segment": i, "drift": drift}))
        return out

    def summary(self) -> dict[str, Any]:
        return {"session_id": self.id, "turns": self.turns, "segments": len(self.segments),
                "drift": len(self.drift), "idle_s": round(time.monotonic() - self.last_used, 3)}
