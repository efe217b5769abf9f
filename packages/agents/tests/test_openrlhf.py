"""OpenRLHF agent files (``--train.agent_func_path``) run unchanged on treadle's executors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treadle.agents.api import Episode
from treadle.agents.executor import ExecutorConfig
from treadle.agents.openrlhf.loader import AgentFileExecutor, load_agent_module
from treadle.agents.openrlhf.vllm_types import VllmSamplingParams, to_treadle
from treadle.common.records import SamplingParams

FILES = Path(__file__).resolve().parent / "agent_files"
PROMPT = "Human: what is 6 * 7?\n\nAssistant: "
CORRECT = "\n\nHuman: [CORRECT]\n</s>"
INCORRECT = "\n\nHuman: [INCORRECT]\nPlease analyze the issues and try again.\n</s>\n\nAssistant: "


def executor(name: str, sampler: Any, chat: Any, **kw: Any) -> AgentFileExecutor:
    return AgentFileExecutor(FILES / name, sampler=sampler, chat=chat, sampling=SamplingParams(max_tokens=6, seed=11),
                             config=ExecutorConfig(max_length=512, max_turn_tokens=6, **kw))


def test_openrlhf_file_runs_natively_token_by_token(aio, sampler, chat) -> None:
    ex = executor("agent_func.py", sampler, chat)
    assert ex.native
    t = aio(ex.run(Episode(prompt=PROMPT, label="42")))
    assert t.finish_reason != "error", t.info
    # OpenRLHF tokenizes the prompt and each feedback on its own, without special tokens
    assert t.prompt_token_ids.tolist() == chat.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    resp, spans = t.response_token_ids, t.info["spans"]
    assert len(spans) == 3 and spans[0][0] == 0
    feedback = [INCORRECT, INCORRECT, CORRECT]
    for (a, b), nxt, text in zip(spans, [s[0] for s in spans[1:]] + [resp.shape[0]], feedback, strict=True):
        assert resp[b:nxt].tolist() == chat.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert t.loss_mask[a:b].all() and not t.loss_mask[b:nxt].any()
        assert np.all(t.rollout_logprobs[a:b] < 0) and np.all(t.rollout_logprobs[b:nxt] == 0)
    assert t.reward == 0.0 and t.score == 0.0 and not t.truncated
    # extra_logs: the last step's, tensors turned into floats; obs_len proves observation_text grew
    obs_len_last = len(PROMPT) + sum(len(chat.decode(resp[a:b])) for a, b in spans[:2]) + 2 * len(INCORRECT)
    assert t.extra_logs == {"step_idx": 3.0, "obs_len": float(obs_len_last)}


def test_a_chat_prompt_reaches_the_file_as_templated_text(aio, sampler, chat) -> None:
    """With --data.apply_chat_template the dataset's prompt is messages; OpenRLHF's agent files get
    it templated (text), as its PromptDataset gives it: OpenRLHF's own agent_func.py returns
    states["observation"] from reset, which must be the str treadle's reset requires."""
    messages = [{"role": "user", "content": "what is 6 * 7?"}]
    text = chat.render(messages)
    for name in ("agent_func.py", "agent_func_override.py"):  # native and overridden execute
        t = aio(executor(name, sampler, chat).run(Episode(prompt=messages, label="42")))
        assert t.finish_reason != "error", (name, t.info)
        assert t.prompt_token_ids.tolist() == chat.tokenizer(text, add_special_tokens=False)["input_ids"], name


def test_overridden_execute_matches_the_native_run(aio, sampler, chat) -> None:
    ep = Episode(prompt=PROMPT, label="42")
    native = aio(executor("agent_func.py", sampler, chat).run(ep))
    ex = executor("agent_func_override.py", sampler, chat)
    assert not ex.native
    t = aio(ex.run(ep))
    assert t.finish_reason != "error", t.info
    for name in ("prompt_token_ids", "response_token_ids", "loss_mask", "rollout_logprobs"):
        assert getattr(t, name).tolist() == getattr(native, name).tolist(), name
    assert t.info["spans"] == native.info["spans"] and t.info["action_mismatch"] == 0
    assert t.extra_logs == {**native.extra_logs, "custom": 1.0} and t.reward == native.reward


def test_fully_custom_executor_output_becomes_a_trajectory(aio, sampler, chat, rollout) -> None:
    t = aio(executor("agent_func_raw.py", sampler, chat).run(Episode(prompt=PROMPT, label="x")))
    assert t.finish_reason != "error", t.info
    assert t.prompt_token_ids.tolist() == chat.encode(PROMPT).tolist()
    assert t.response_token_ids.shape == (5,) and t.loss_mask.tolist() == [1] * 5
    assert (t.reward, t.score, t.extra_logs) == (0.5, 0.25, {"action_len": 5.0})
    # rollout_log_probs was None in the file's output: the engine's logprobs are used
    plp = aio(rollout.prompt_logprobs(np.concatenate([t.prompt_token_ids, t.response_token_ids])))
    np.testing.assert_allclose(t.rollout_logprobs, plp[-5:], atol=1e-4)


def test_async_init_and_bad_files(aio, sampler, chat, tmp_path) -> None:
    src = (FILES / "agent_func.py").read_text().replace("    def __init__(self, *args, **kwargs):\n        self.step_idx",
                                                        "    async def __init__(self, *args, **kwargs):\n        self.step_idx")
    assert "async def __init__" in src
    (tmp_path / "async_init.py").write_text(src)
    ex = AgentFileExecutor(tmp_path / "async_init.py", sampler=sampler, chat=chat,
                           sampling=SamplingParams(max_tokens=4, seed=1),
                           config=ExecutorConfig(max_length=256, max_turn_tokens=4))
    t = aio(ex.run(Episode(prompt=PROMPT, label="42")))
    assert t.finish_reason != "error" and t.info["turns"] == 3
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="no AgentExecutor"):
        AgentFileExecutor(tmp_path / "none.py", sampler=sampler, chat=chat, sampling=SamplingParams())
    (tmp_path / "args.py").write_text("from openrlhf.utils.agent import AgentExecutorBase\n"
                                      "class AgentExecutor(AgentExecutorBase):\n"
                                      "    def __init__(self, max_steps, max_length):\n        pass\n")
    with pytest.raises(ValueError, match="no arguments"):
        AgentFileExecutor(tmp_path / "args.py", sampler=sampler, chat=chat, sampling=SamplingParams())
    with pytest.raises(ValueError, match=r"\.py file"):
        load_agent_module(tmp_path / "missing.py")


def test_vllm_shaped_sampling_params_round_trip() -> None:
    sp = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=20, max_tokens=33, min_tokens=2, stop_token_ids=[5],
                        seed=4, logprobs=True)
    v = VllmSamplingParams.from_treadle(sp)
    v2 = v.clone()
    v2.max_tokens = 7
    assert v.max_tokens == 33 and to_treadle(v) == sp and to_treadle(v2).max_tokens == 7
    v2.logprobs, v2.top_k = None, 0
    assert to_treadle(v2).logprobs is False and to_treadle(v2).top_k == -1
