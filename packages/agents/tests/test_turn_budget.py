"""Multi-turn token budget (issue 34 item 7): every turn may sample what is left of the episode's
``max_length``, as OpenRLHF's MultiTurnAgentExecutor sets ``sampling_params.max_tokens =
max_length - len(current_obs_tokens)`` before each turn; ``sampling.max_tokens`` only sets the
room an over-long prompt leaves. Against the real rollout daemon, requests recorded as sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treadle.agents.api import Episode
from treadle.agents.envs import GuessingEnv, games
from treadle.agents.executor import ExecutorConfig, MultiTurnExecutor, prompt_keep, turn_max_tokens
from treadle.agents.openrlhf.loader import AgentFileExecutor
from treadle.common.config import ConfigError
from treadle.common.records import SamplingParams

FILES = Path(__file__).resolve().parent / "agent_files"
PROMPT = "Human: what is 6 * 7?\n\nAssistant: "


class Recording:
    """A Sampler that records (prompt length, max_tokens) of every request it forwards."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests = inner, []

    async def sample(self, prompt_ids: np.ndarray, sampling: SamplingParams, *, key: str) -> Any:
        self.requests.append((int(prompt_ids.shape[0]), sampling.max_tokens))
        return await self.inner.sample(prompt_ids, sampling, key=key)


def test_turn_budget_and_prompt_room_by_hand() -> None:
    assert turn_max_tokens(100, 30, None) == 70  # 100 - 30: the rest of the episode
    assert turn_max_tokens(100, 30, 6) == 6 and turn_max_tokens(100, 97, 6) == 3  # min(cap, rest)
    assert turn_max_tokens(100, 100, None) == 0 and turn_max_tokens(100, 104, 6) == -4  # nothing left
    assert prompt_keep(100, 30) == 70  # OpenRLHF: max_length - max_tokens
    assert prompt_keep(100, 100) == 1 and prompt_keep(100, 500) == 1  # at least one token
    with pytest.raises(ConfigError, match="--max_turn_tokens must be >= 1"):
        ExecutorConfig(max_turn_tokens=0)
    assert ExecutorConfig().max_length == 2048 and ExecutorConfig().max_turn_tokens is None


def test_every_turn_asks_for_the_rest_of_the_episode(aio, sampler, chat) -> None:
    ep = games(1, seed=1)[0]
    p = chat.prompt_ids(ep.prompt).shape[0]
    rec = Recording(sampler)
    ex = MultiTurnExecutor(env_factory=lambda: GuessingEnv(max_turns=50), sampler=rec, chat=chat,
                           sampling=SamplingParams(max_tokens=6, seed=5), config=ExecutorConfig(max_length=p + 40))
    t = aio(ex.run(ep))
    assert t.finish_reason != "error", t.info
    assert rec.requests[0] == (p, 40)  # not sampling.max_tokens (6): the whole budget after the prompt
    assert all(n == p + 40 - length for length, n in rec.requests), rec.requests
    assert len(rec.requests) == t.info["turns"] == len(t.info["spans"])
    if t.info["end"] == "budget":
        assert p + t.response_token_ids.shape[0] == p + 40
    # with a cap, each turn asks for min(cap, rest)
    rec.requests.clear()
    capped = MultiTurnExecutor(env_factory=lambda: GuessingEnv(max_turns=50), sampler=rec, chat=chat,
                               sampling=SamplingParams(max_tokens=6, seed=5),
                               config=ExecutorConfig(max_length=p + 40, max_turn_tokens=6))
    t = aio(capped.run(ep))
    assert rec.requests[0] == (p, 6) and all(n == min(6, p + 40 - length) for length, n in rec.requests)


def test_a_long_prompt_keeps_max_length_minus_max_tokens(aio, sampler, chat) -> None:
    ep = Episode(prompt="numbers " * 40, label=7)
    p = chat.prompt_ids([{"role": "user", "content": ep.prompt}]).shape[0]
    rec = Recording(sampler)
    ex = MultiTurnExecutor(env_factory=lambda: GuessingEnv(max_turns=50), sampler=rec, chat=chat,
                           sampling=SamplingParams(max_tokens=8, seed=2), config=ExecutorConfig(max_length=24))
    t = aio(ex.run(ep))
    assert p > 24 and t.info["prompt_truncated"] == p
    assert t.prompt_token_ids.shape[0] == 16 and rec.requests[0] == (16, 8)  # 24 - 8 kept, 8 to generate


@pytest.mark.parametrize("name", ["agent_func.py", "agent_func_override.py"])
def test_openrlhf_agent_files_get_openrlhfs_budget(aio, sampler, chat, name) -> None:
    """Natively and through a file's own ``execute`` (``super().execute``): each turn asks for the rest."""
    p = len(chat.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    rec = Recording(sampler)
    ex = AgentFileExecutor(FILES / name, sampler=rec, chat=chat, sampling=SamplingParams(max_tokens=6, seed=11),
                           config=ExecutorConfig(max_length=p + 48))
    t = aio(ex.run(Episode(prompt=PROMPT, label="42")))
    assert t.finish_reason != "error", t.info
    assert rec.requests[0] == (p, 48)
    assert all(n == p + 48 - length for length, n in rec.requests), rec.requests
