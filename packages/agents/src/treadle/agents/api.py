"""The native, typed agent API: what an episode starts from, what an environment sees and answers.

An environment is any object with two coroutines (and an optional third)::

    class MyEnv:
        async def reset(self, episode: Episode) -> Observation: ...   # the first observation
        async def step(self, action: Action) -> StepResult: ...       # feedback on one turn
        async def close(self) -> None: ...                            # optional, always called

One instance serves one episode (executors build a fresh one per episode from a factory), so
it may keep per-episode state in attributes. An ``Observation`` is either raw text, tokenized
as is and appended after the policy's tokens (OpenRLHF's ``environment_feedback``: the text
brings its own turn markup), or a list of chat messages, rendered through the tokenizer's chat
template as the continuation of the conversation (``treadle.agents.chat.ChatFormat``).

OpenRLHF's dict-based ``AgentInstanceBase`` runs on top of this API (``treadle.agents.openrlhf``).
Not here: running episodes (``executor``), tokens (``builder``), sampling (``sampler``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from treadle.common.records import SamplingParams, check_native

Message = dict[str, Any]
"""One chat message, OpenAI style: {"role": ..., "content": ..., "tool_calls"?: [...], ...}."""

Observation = str | list[Message]
"""Text appended verbatim (tokenized on its own), or messages rendered by the chat template."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Episode:
    """One prompt to run: what ``Environment.reset`` receives."""

    prompt: Observation
    """The dataset's prompt: text (already templated) or chat messages."""
    label: Any = None
    """Reference answer / environment seed from the dataset (msgpack-native)."""
    uid: str = ""
    """Id of the resulting Trajectory; empty: the executor draws one."""
    group_id: str = ""
    """Shared by the samples of one prompt (GRPO / RLOO groups)."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI tool schemas passed to the chat template when ``prompt`` is messages."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form, msgpack-native; copied into the Trajectory's info."""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, (str, list)):
            raise TypeError(f"Episode.prompt must be text or a list of messages, got {type(self.prompt).__name__}")
        check_native(self.label, "Episode.label")
        check_native(self.info, "Episode.info")


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """What the policy produced in one turn."""

    text: str
    """The turn decoded without special tokens (what vLLM calls the output's text)."""
    token_ids: np.ndarray
    """int32 [A]: the sampled tokens, stop token included when one ended the turn."""
    finish_reason: str
    """"stop" (a stop token), "length" (max_tokens or the episode's budget), ..."""
    turn: int
    """0-based index of this turn in the episode."""
    stopped: bool
    """True when the turn ended with a stop token (the chat turn is closed)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """The environment's answer to one action (OpenRLHF's step dict, typed)."""

    observation: Observation = ""
    """Feedback appended after the action (masked out of the loss); "" or [] for none."""
    reward: float = 0.0
    """Reward of this step; the episode's reward is the sum over steps."""
    score: float | None = None
    """Verifier score; the episode's score is the last step's (None: the summed reward)."""
    done: bool = False
    """True ends the episode after this step."""
    extra_logs: Mapping[str, float] = field(default_factory=dict)
    """Scalar metrics; the episode keeps the last step's."""
    sampling: SamplingParams | None = None
    """Sampling for the next turn; None keeps the current one."""
    token_rewards: Sequence[float] | None = None
    """Per-token (process) rewards of the action this step answers, one per action token
    (``Action.token_ids``): the Trajectory's ``token_rewards`` at those tokens (0 elsewhere), which
    the trainer adds to the per-token rewards of the estimators that take them (``gae``,
    ``reinforce``, ``reinforce_baseline``; the others refuse them). ``reward`` still counts towards
    the episode reward, put on the last action token. None: none. A treadle extension: OpenRLHF
    has no per-token rewards (an OpenRLHF agent file may return them under ``"token_rewards"``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.observation, (str, list)):
            raise TypeError(f"StepResult.observation must be text or messages, got {type(self.observation).__name__}")
        if not math.isfinite(self.reward):
            raise ValueError(f"StepResult.reward must be finite, got {self.reward}")
        if self.token_rewards is not None and not np.isfinite(np.asarray(self.token_rewards, np.float64)).all():
            raise ValueError("StepResult.token_rewards must be finite numbers")


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (see the module docstring)."""

    async def reset(self, episode: Episode) -> Observation: ...

    async def step(self, action: Action) -> StepResult: ...


async def close_env(env: Any) -> None:
    """Call ``env.close()`` when it has one (sync or async)."""
    close = getattr(env, "close", None)
    if close is None:
        return
    out = close()
    if hasattr(out, "__await__"):
        await out
