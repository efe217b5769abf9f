"""Executors against the real rollout daemon: tokens, masks, spans and logprobs position by position."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from treadle.agents.api import Action, Episode, StepResult
from treadle.agents.envs import ArithmeticEnv, GuessingEnv, games
from treadle.agents.envs.arithmetic import CALCULATOR_TOOL, question
from treadle.agents.executor import ExecutorConfig, MultiTurnExecutor, SingleTurnExecutor
from treadle.agents.tools import format_tool_call
from treadle.common.records import SamplingParams

STOPS = {0, 2}  # <|endoftext|>, <|im_end|>: the tiny model's eos ids


def multi(sampler: Any, chat: Any, env_factory: Any, *, max_tokens: int = 6, seed: int | None = 7,
          temperature: float = 1.0, **config: Any) -> MultiTurnExecutor:
    return MultiTurnExecutor(env_factory=env_factory, sampler=sampler, chat=chat,
                             sampling=SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature),
                             config=ExecutorConfig(**{"max_length": 1024, "max_turn_tokens": max_tokens, **config}))


def replay(aio: Any, chat: Any, env: Any, ep: Episode, t: Any) -> None:
    """Re-derive every observation from the sampled spans and check the layout token by token."""
    obs = aio(env.reset(ep))
    assert t.prompt_token_ids.tolist() == chat.prompt_ids(obs, tools=ep.tools).tolist()
    resp, pos = t.response_token_ids, 0
    for i, (a, b) in enumerate(t.info["spans"]):
        assert a == pos, f"turn {i} starts at {a}, the previous observation ended at {pos}"
        ids = resp[a:b]
        stopped = int(ids[-1]) in STOPS
        res = aio(env.step(Action(text=chat.decode(ids), token_ids=ids, finish_reason="stop" if stopped else "length",
                                  turn=i, stopped=stopped)))
        o = chat.observation_ids(res.observation, last_token=int(ids[-1]), stopped=stopped, tools=ep.tools)
        assert resp[b:b + o.shape[0]].tolist() == o.tolist(), f"observation after turn {i}"
        pos = b + o.shape[0]
    assert pos == resp.shape[0]
    mask = np.zeros(resp.shape[0], np.uint8)
    for a, b in t.info["spans"]:
        mask[a:b] = 1
    assert t.loss_mask.tolist() == mask.tolist()
    assert np.all(t.rollout_logprobs[mask == 0] == 0)


def test_multi_turn_tokens_masks_and_logprobs(aio, sampler, chat, rollout) -> None:
    ep = games(1, seed=0)[0]
    t = aio(multi(sampler, chat, lambda: GuessingEnv(max_turns=3)).run(ep))
    assert t.finish_reason != "error", t.info
    assert t.info["turns"] == 3 and t.info["end"] == "done" and not t.truncated
    assert t.info["label"] == ep.label and t.uid
    replay(aio, chat, GuessingEnv(max_turns=3), ep, t)
    # the recorded logprobs are the engine's: score the whole episode again and compare on the spans
    full = np.concatenate([t.prompt_token_ids, t.response_token_ids])
    plp = aio(rollout.prompt_logprobs(full))
    p = t.prompt_token_ids.shape[0]
    on = t.loss_mask == 1
    np.testing.assert_allclose(t.rollout_logprobs[on], plp[p - 1:][on], atol=1e-4)
    assert np.all(t.rollout_logprobs[on] < 0)
    assert t.reward == 0.0 and t.score == 0.0 and t.extra_logs["guesses"] == 3.0


def test_warm_model_solves_arithmetic_with_a_tool_call(aio, sampler, chat, warm) -> None:
    ep = Episode(prompt=[{"role": "user", "content": question(warm.ARITH_EXPR)}], label=warm.ARITH_VALUE,
                 tools=[CALCULATOR_TOOL])
    t = aio(multi(sampler, chat, ArithmeticEnv, max_tokens=64, temperature=0.0, seed=None).run(ep))
    assert t.finish_reason == "stop" and t.info["end"] == "done", t.info
    (a0, b0), (a1, b1) = t.info["spans"]
    resp = t.response_token_ids
    assert chat.decode(resp[a0:b0]) == format_tool_call("calculator", {"expression": warm.ARITH_EXPR})
    assert chat.decode(resp[b0:a1], skip_special_tokens=False) == (
        f"\n<|im_start|>user\n<tool_response>\n{warm.ARITH_VALUE}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert chat.decode(resp[a1:b1], skip_special_tokens=False) == f"<answer>{warm.ARITH_VALUE}</answer><|im_end|>"
    assert b1 == resp.shape[0] and t.reward == 1.0 and t.score == 1.0
    assert t.extra_logs == {"tool_calls": 1.0, "tool_errors": 0.0, "turns": 2.0, "correct": 1.0}
    replay(aio, chat, ArithmeticEnv(), ep, t)


def test_budget_and_max_turns_truncate(aio, sampler, chat) -> None:
    ep = games(1, seed=1)[0]
    p = chat.prompt_ids(ep.prompt).shape[0]
    t = aio(multi(sampler, chat, lambda: GuessingEnv(max_turns=50), max_length=p + 10).run(ep))
    assert t.truncated and t.info["end"] == "budget"
    assert p + t.response_token_ids.shape[0] == p + 10  # the observation was cut to fit exactly
    assert t.info["spans"][0] == [0, 6] and t.loss_mask[6:].tolist() == [0, 0, 0, 0]
    t = aio(multi(sampler, chat, lambda: GuessingEnv(max_turns=50), max_turns=2).run(ep))
    assert t.truncated and t.info["end"] == "max_turns" and t.info["turns"] == 2


class FailingEnv:
    """Raises in reset, raises in the second step, or hangs in reset, depending on the episode's label."""

    async def reset(self, ep: Episode) -> str:
        self.mode = ep.label
        if self.mode == "reset":
            raise RuntimeError("no such task")
        if self.mode == "hang":
            await asyncio.sleep(60)
        return "Question: ping?\nAnswer:"

    async def step(self, action: Action) -> StepResult:
        if self.mode == "step" and action.turn == 1:
            raise KeyError("tool server gone")
        return StepResult(observation="\nTry again:", reward=0.5, done=action.turn == 2)


def test_failures_are_recorded_not_raised(aio, sampler, chat) -> None:
    ex = multi(sampler, chat, FailingEnv, episode_timeout_s=0)
    out = aio(ex.run_many([Episode(prompt="-", label=x) for x in ["ok", "reset", "step", "ok"]]), timeout=120)
    assert [t.finish_reason == "error" for t in out] == [False, True, True, False]
    assert [t.info.get("failed_stage") for t in out] == [None, "reset", "step", None]
    assert "RuntimeError: no such task" in out[1].info["error"] and out[1].response_token_ids.shape == (0,)
    # the turns played before the failure are kept (the second turn's step raised)
    assert "KeyError" in out[2].info["error"] and out[2].info["spans"] == [[0, 6], [14, 20]]
    assert out[2].loss_mask.tolist() == [1] * 6 + [0] * 8 + [1] * 6 and out[2].reward is None
    assert out[0].reward == 1.5 and out[0].info["turns"] == 3 and out[0].info["end"] == "done"
    assert (ex.stats.started, ex.stats.finished, ex.stats.failed, ex.stats.timed_out) == (4, 2, 2, 0)
    assert ex.stats.failures_by_stage == {"reset": 1, "step": 1}


def test_episode_timeout(aio, sampler, chat) -> None:
    ex = multi(sampler, chat, FailingEnv, episode_timeout_s=0.5)
    t = aio(ex.run(Episode(prompt="-", label="hang")))
    assert t.finish_reason == "error" and t.info["failed_stage"] == "reset"
    assert "timed out after 0.5 s" in t.info["error"] and ex.stats.timed_out == 1


class OneStepEnv:
    """Counts how many episodes are between reset and step at once."""

    live = peak = 0

    async def reset(self, ep: Episode) -> str:
        OneStepEnv.live += 1
        OneStepEnv.peak = max(OneStepEnv.peak, OneStepEnv.live)
        return "Count:"

    async def step(self, action: Action) -> StepResult:
        OneStepEnv.live -= 1
        return StepResult(reward=float(action.token_ids.shape[0]), done=True)


def test_thousands_of_episodes_in_flight(aio, sampler, chat) -> None:
    n = 2000
    ex = multi(sampler, chat, OneStepEnv, max_tokens=2, seed=None, max_in_flight=n)
    out = aio(ex.run_many([Episode(prompt="", label=i) for i in range(n)]), timeout=300)
    assert OneStepEnv.peak == n  # every episode was waiting on the pool at once
    assert all(t.finish_reason != "error" for t in out) and ex.stats.finished == n
    assert [t.info["label"] for t in out] == list(range(n)) and len({t.uid for t in out}) == n
    assert all(t.reward == t.loss_mask.sum() == t.response_token_ids.shape[0] for t in out)


def test_as_completed_bounds_the_number_in_flight(aio, sampler, chat) -> None:
    OneStepEnv.live = OneStepEnv.peak = 0
    ex = multi(sampler, chat, OneStepEnv, max_tokens=1, max_in_flight=4)

    async def collect() -> list[Any]:
        return [t async for t in ex.as_completed(Episode(prompt="", label=i) for i in range(12))]

    out = aio(collect())
    assert sorted(t.info["label"] for t in out) == list(range(12)) and OneStepEnv.peak <= 4


REWARD_FILE = '''
import torch

def reward_func(queries, prompts, labels):
    rewards = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
    return {"rewards": rewards, "scores": rewards / 100, "extra_logs": {"has_label": torch.tensor([float(l == "L") for l in labels])}}
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("rewards") / "reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def single(sampler: Any, chat: Any, reward: Any) -> SingleTurnExecutor:
    return SingleTurnExecutor(reward=reward, sampler=sampler, chat=chat, sampling=SamplingParams(max_tokens=8, seed=3),
                              config=ExecutorConfig(max_length=256))


def test_single_turn_with_every_reward_source(aio, sampler, chat, reward_file) -> None:
    from treadle.agents.rewards import DaemonReward, FunctionReward, HttpReward
    from treadle.rewards.config import HttpConfig, ServeConfig, ZmqConfig
    from treadle.rewards.daemon import DaemonThread

    ep = Episode(prompt="Question: 1 + 1?\nAnswer:", label="L")
    t = aio(single(sampler, chat, FunctionReward(reward_file)).run(ep))
    assert t.info["spans"] == [[0, t.response_token_ids.shape[0]]] and t.loss_mask.all()
    query = chat.decode(np.concatenate([t.prompt_token_ids, t.response_token_ids]), skip_special_tokens=False)
    assert t.reward == float(len(query) - len(ep.prompt)) and t.score == pytest.approx(t.reward / 100)
    assert t.extra_logs == {"has_label": 1.0} and t.truncated == (t.finish_reason == "length")
    d = DaemonThread(ServeConfig(functions=(reward_file,), http=HttpConfig(port=0),
                                 zmq=ZmqConfig(endpoint="tcp://127.0.0.1:0")))
    addrs = d.start()
    try:
        for source in (DaemonReward(addrs.zmq), HttpReward(addrs.http + "/get_reward")):
            other = aio(single(sampler, chat, source).run(ep))  # same seed: the same sample
            aio(source.close())
            assert other.response_token_ids.tolist() == t.response_token_ids.tolist()
            assert (other.reward, other.score) == (t.reward, pytest.approx(t.score)), type(source).__name__
    finally:
        d.stop()


def test_single_turn_reward_failure_and_group_rules(aio, sampler, chat, tmp_path) -> None:
    from treadle.agents.rewards import FunctionReward, reward_source

    bad = tmp_path / "bad.py"
    bad.write_text("def reward_func(queries, prompts, labels):\n    raise ValueError('judge down')\n")
    t = aio(single(sampler, chat, FunctionReward(str(bad))).run(Episode(prompt="x", group_id="g")))
    assert t.finish_reason == "error" and t.info["failed_stage"] == "reward" and "judge down" in t.info["error"]
    assert t.group_id == "g" and t.info["spans"] == [[0, 8]]
    with pytest.raises(ValueError, match="one continuation per episode"):
        SingleTurnExecutor(sampler=sampler, chat=chat, sampling=SamplingParams(n=2))
    assert type(reward_source("http://h:1/get_reward")).__name__ == "HttpReward"
    assert type(reward_source("tcp://127.0.0.1:1")).__name__ == "DaemonReward"
