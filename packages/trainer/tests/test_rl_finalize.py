"""``rl.returns.finalize`` on small batches worked out by hand: clipping after the group baseline
(OpenRLHF's order), float64 arithmetic for large rewards, the multi-turn layouts, and the PPO
trainer's views of the config (GSPO's correction computes no IS weights)."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch

from treadle.common.records import Trajectory
from treadle.trainer.config import parse_ppo
from treadle.trainer.rl.advantages import compute_advantages, token_rewards
from treadle.trainer.rl.experience import env_gaps, from_trajectory
from treadle.trainer.rl.returns import ReturnsConfig, finalize
from treadle.trainer.trainers.ppo import PPOTrainer

CFG = ReturnsConfig(estimator="rloo", group_size=2, gamma=1.0, lambd=1.0, std_norm=True, kl_coef=0.0,
                    kl_estimator="k1", kl_in_reward=True, clip_range=(-10.0, 10.0), max_new_tokens=16,
                    overlong_buffer_len=None, overlong_penalty_factor=1.0, stop_properly_coef=None, is_level=None)


def exps_of(rewards, loss_masks):
    out = []
    for r, lm in zip(rewards, loss_masks, strict=True):
        n = len(lm)
        traj = Trajectory(prompt_token_ids=np.array([1, 2], dtype=np.int32), response_token_ids=np.arange(3, 3 + n, dtype=np.int32),
                          rollout_logprobs=np.full(n, -0.5, dtype=np.float32), loss_mask=np.array(lm, dtype=np.uint8),
                          reward=float(r))
        e = from_trajectory(traj)
        e.reward = float(r)
        out.append(e)
    return out


def test_extra_logs_of_reward_files_reach_the_step_metrics():
    """OpenRLHF logs the reward / agent files' extra_logs; the step's metrics carry their means,
    under the names given (over the samples that report one), and never overwrite treadle's own."""
    exps = exps_of([1.0, 0.0, 1.0, 0.0], [[1]] * 4)
    for e, logs in zip(exps, [{"dummy_scores": 1.0, "reward/mean": 7.0}, {"dummy_scores": 0.5}, {"acc": 1.0}, {}],
                       strict=True):
        e.traj = msgspec.structs.replace(e.traj, extra_logs=logs)
    metrics = finalize(exps, CFG)
    assert metrics["dummy_scores"] == 0.75 and metrics["acc"] == 1.0
    assert metrics["reward/mean"] == 0.5 and metrics["extra/reward/mean"] == 7.0


def test_rewards_are_clipped_after_the_group_baseline():
    # rewards [30, 0]: RLOO baseline -> [30 - 0, 0 - 30] = [30, -30], then clipped to [-10, 10]
    exps = exps_of([30.0, 0.0], [[1], [1]])
    finalize(exps, CFG)
    assert [float(e.arrays["advantages"][0]) for e in exps] == [10.0, -10.0]
    # clipping first (the old order) would have given [10 - 0, 0 - 10] as well; [30, 5] tells them apart:
    # baseline [25, -25] -> [10, -10]; clip first [10, 5] -> baseline [5, -5]
    exps = exps_of([30.0, 5.0], [[1], [1]])
    finalize(exps, CFG)
    assert [float(e.arrays["advantages"][0]) for e in exps] == [10.0, -10.0]


def test_group_norm_eps_is_openrlhfs():
    # [1, 1 + 2e-6]: unbiased std sqrt(2) * 1e-6; (r - mean) / (std + 1e-9) = +-1e-6 / (1.41421e-6 + 1e-9) = +-0.706607
    exps = exps_of([1.0, 1.0 + 2e-6], [[1], [1]])
    finalize(exps, dataclasses.replace(CFG, estimator="group_norm"))
    assert float(exps[1].arrays["advantages"][0]) == pytest.approx(1 / (2**0.5 + 1e-3), rel=1e-5)


def test_returns_and_advantages_are_computed_in_float64():
    # rewards of 1e4 with small differences: reinforce whitens the returns over the batch
    rewards = [1e4 + 0.001 * k for k in range(8)]
    exps = exps_of(rewards, [[1, 1, 1]] * 8)
    cfg = dataclasses.replace(CFG, estimator="reinforce", clip_range=(-2e4, 2e4), gamma=0.9)
    finalize(exps, cfg)
    mask = torch.ones(8, 3, dtype=torch.bool)
    exact = compute_advantages("reinforce", token_rewards=token_rewards(torch.tensor(rewards, dtype=torch.float64), mask,
                                                                          None, 0.0), mask=mask, gamma=0.9)
    for name, want in zip(("advantages", "returns"), exact, strict=True):
        got = np.stack([e.arrays[name] for e in exps])
        # stored as float32: exactly the float64 result rounded once
        np.testing.assert_array_equal(got, want.float().numpy(), err_msg=name)


def test_environment_tokens_count_as_steps_only_when_asked():
    # response: action, 2 environment tokens, action; reward 1 on the last action, gamma 0.5
    exps = exps_of([1.0, 3.0], [[1, 0, 0, 1], [1, 0, 0, 1]])
    assert env_gaps(exps).tolist() == [[2.0, 0.0], [2.0, 0.0]]
    cfg = dataclasses.replace(CFG, estimator="dr_grpo", gamma=0.5)
    finalize(exps, cfg)
    # dr_grpo baseline: [1 - 2, 3 - 2] = [-1, 1]; policy-token steps: G = [0.5 * r, r]
    assert exps[0].arrays["returns"].tolist() == [-0.5, -1.0]
    finalize(exps, dataclasses.replace(cfg, discount_env_tokens=True))
    # every position a step: G_0 = 0.5^3 r
    assert exps[0].arrays["returns"].tolist() == [-0.125, -1.0]


def _trainer_views(*extra: str) -> PPOTrainer:
    cfg = parse_ppo(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d", "--reward.remote_url", "r.py",
                     "--rollout.max_new_tokens", "8", "--actor.num_gpus_per_node", "1", "--algo.advantage.estimator",
                     "group_norm", "--rollout.n_samples_per_prompt", "2", *extra])
    trainer = object.__new__(PPOTrainer)  # the config views only: no models
    trainer.cfg, trainer.p = cfg, type("Parts", (), {"reference": None})()
    trainer.kl = type("KL", (), {"coef": 0.0})()
    return trainer


def test_gspo_with_the_correction_takes_no_is_weights():
    t = _trainer_views("--actor.policy_loss_type", "gspo", "--algo.advantage.is_correction_level", "token")
    assert t.returns_config().is_level is None and t.policy_loss().ratio_to_rollout
    assert t.policy_loss().aggregation == "seq-mean-token-mean"
    t = _trainer_views("--actor.policy_loss_type", "gspo_token", "--algo.advantage.is_correction_level", "token",
                       "--algo.advantage.is_correction_mode", "clip")
    rc = t.returns_config()
    assert (rc.is_level, rc.is_mode, rc.is_gating) == ("token", "clip", "ratio") and not t.policy_loss().ratio_to_rollout
    t = _trainer_views("--actor.policy_loss_type", "gspo", "--actor.dual_clip", "3")
    assert t.policy_loss().dual_clip == 3.0  # no longer dropped for GSPO


def test_the_engines_logprobs_are_asked_for_only_when_something_reads_them():
    """OpenRLHF asks vLLM for logprobs only with the IS correction (they cost about half of vLLM
    0.26's generation speed); ``--rollout.logprobs`` asks for the gap metrics alone. Without them
    the trajectories carry zeros, and no gap metric is made up from those."""
    from treadle.trainer.trainers.ppo_build import sampling_of

    plain = _trainer_views()
    assert not sampling_of(plain.cfg, temperature=1.0).logprobs
    assert not plain.returns_config().rollout_logprobs and not plain.policy_loss().rollout_logprobs
    for extra in (("--rollout.logprobs",), ("--algo.advantage.is_correction_enable",)):
        t = _trainer_views(*extra)
        assert sampling_of(t.cfg, temperature=1.0).logprobs and t.returns_config().rollout_logprobs, extra
    exps = exps_of([1.0, 0.0], [[1, 1], [1, 1]])
    for e in exps:
        e.arrays["old_logp"] = np.full(2, -0.7, dtype=np.float32)
    assert "logprob_gap/mean" in finalize(exps, CFG)
    exps = exps_of([1.0, 0.0], [[1, 1], [1, 1]])
    for e in exps:
        e.arrays["old_logp"] = np.full(2, -0.7, dtype=np.float32)
    assert "logprob_gap/mean" not in finalize(exps, dataclasses.replace(CFG, rollout_logprobs=False))
