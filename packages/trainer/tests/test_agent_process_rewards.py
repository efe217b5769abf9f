"""Process rewards end to end, short of the optimizer: an OpenRLHF agent file whose ``step`` gives
``token_rewards`` (treadle's extension) runs through the executor and generator the PPO trainer
builds (``ppo_build.executor``, ``rl.generation.Generator``, the seeded sampler) on a real rollout
daemon (hf backend, the tiny model); its trajectories carry the rewards at each turn's tokens,
and ``finalize`` turns them into the returns and advantages the formula gives
(r_t = p_t + [t last] R, ``rl.advantages``), which differ from those without them."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import numpy as np
import pytest
from treadle_testing import rollout_daemon

AGENT = '''
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn >= 2
        n = len(states["action_token_ids"])  # treadle's extension: the turn's tokens
        return {"rewards": torch.tensor(1.0 if done else 0.5), "scores": torch.tensor(1.0),
                "environment_feedback": "" if done else " again:", "done": done,
                "token_rewards": torch.full((n,), 0.1 * self.turn)}  # 0.1 per token of turn 1, 0.2 of turn 2


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def hf_daemon(model, helpers):
    return rollout_daemon(model, helpers.child_env(), "--backend", "hf")


def generate(cfg, endpoint, tokenizer):
    """Two groups of two episodes, as the trainer's rank 0 generates them."""
    from treadle.agents.chat import ChatFormat
    from treadle.agents.sampler import RolloutSampler
    from treadle.common.rpc import LoopThread
    from treadle.rollout.client import RolloutClient
    from treadle.trainer.rl.generation import Generator, Prompt, SeededSampler
    from treadle.trainer.trainers.ppo_build import executor, sampling_of

    lt = LoopThread(name="test-rollout")
    try:
        async def make() -> RolloutClient:
            return RolloutClient(endpoint)

        client = lt.run(make())
        sampler = SeededSampler(RolloutSampler(client), cfg.train.seed)
        ex = executor(cfg, sampler=sampler, chat=ChatFormat(tokenizer, cfg.data.tokenizer_chat_template),
                      sampling=sampling_of(cfg, temperature=1.0))
        gen = Generator(executor=ex, eval_executor=ex, n=cfg.rollout.n_samples_per_prompt, lt=lt)
        groups = gen.collect([(0, Prompt(prompt="numbers for apple:", label=None)),
                              (1, Prompt(prompt="numbers for fox golf:", label=None))])
        lt.run(client.close())
    finally:
        lt.stop()
    return [t for g in groups for t in g.trajectories]


def test_agent_process_rewards_reach_the_advantages(tiny, tokenizer, helpers, tmp_path):
    from treadle.trainer.config import parse_ppo
    from treadle.trainer.rl.experience import from_trajectory
    from treadle.trainer.rl.returns import ReturnsConfig, finalize

    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    cfg = parse_ppo(["--actor.model_name_or_path", str(tiny), "--data.prompt_dataset", str(tmp_path / "p.jsonl"),
                     "--data.input_key", "prompt", "--train.agent_func_path", str(agent),
                     "--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "2",
                     "--rollout.max_new_tokens", "6", "--data.prompt_max_len", "16", "--algo.kl.init_coef", "0",
                     "--rollout.batch_size", "2", "--train.batch_size", "4", "--train.micro_batch_size", "4",
                     "--rollout.micro_batch_size", "4", "--actor.num_gpus_per_node", "1",
                     "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.output_dir", str(tmp_path / "model")])
    with hf_daemon(tiny, helpers) as endpoint:
        trajs = generate(cfg, endpoint, tokenizer)
    assert len(trajs) == 4 and all(t.finish_reason != "error" for t in trajs), [t.info.get("error") for t in trajs]
    for t in trajs:  # 0.1 on turn 1's tokens, 0.2 on turn 2's (when it had room), 0 on the environment's
        want = np.zeros(t.response_token_ids.shape[0], np.float32)
        for k, (a, b) in enumerate(t.info["spans"]):
            want[a:b] = np.float32(0.1 * (k + 1))
        np.testing.assert_array_equal(t.token_rewards, want)
        assert t.reward == pytest.approx(1.5 if t.info["turns"] == 2 else 0.5)
    assert any(t.info["turns"] == 2 for t in trajs)

    rc = ReturnsConfig(estimator=cfg.algo.advantage.estimator, group_size=2, gamma=1.0, lambd=1.0, std_norm=True,
                       kl_coef=0.0, kl_estimator="k1", kl_in_reward=True, clip_range=(-10.0, 10.0), max_new_tokens=6,
                       overlong_buffer_len=None, overlong_penalty_factor=1.0, stop_properly_coef=None, is_level=None)

    def finalized(ts):
        exps = [from_trajectory(t) for t in ts]
        for e in exps:
            e.reward = float(e.traj.reward)
        return exps, finalize(exps, rc)

    exps, metrics = finalized(trajs)
    rows = []
    for t, e in zip(trajs, exps, strict=True):  # by hand: r = p at the action tokens, + R on the last one
        r = t.token_rewards[t.loss_mask.astype(bool)].astype(np.float64)
        r[-1] += t.reward
        g = np.cumsum(r[::-1])[::-1]  # gamma 1: the sum of what follows
        np.testing.assert_allclose(e.arrays["returns"], g, rtol=1e-6)
        rows.append(g)
    flat = np.concatenate(rows)
    want = (flat - flat.mean()) / np.sqrt(max(((flat - flat.mean()) ** 2).mean(), 1e-8))  # reinforce's whitening
    np.testing.assert_allclose(np.concatenate([e.arrays["advantages"] for e in exps]), want, rtol=1e-5, atol=1e-6)
    assert metrics["reward/process_mean"] == pytest.approx(np.mean([t.token_rewards.sum() for t in trajs]), rel=1e-6)

    plain, _ = finalized([msgspec.structs.replace(t, token_rewards=None) for t in trajs])
    assert not np.allclose(np.concatenate([e.arrays["advantages"] for e in plain]), want)
    with pytest.raises(ValueError, match="--algo.advantage.estimator group_norm cannot use"):
        finalize([from_trajectory(t) for t in trajs], dataclasses.replace(rc, estimator="group_norm"))
