"""Per-token (process) rewards: ``Trajectory.token_rewards`` reach the advantage estimators.

r_t = p_t - kl_coef kl_t + [t = last action token] R' (``rl.advantages``' module docstring): the
outcome reward R' alone is shaped, baselined and clipped; p_t is added where it falls. Worked by
hand here on ``finalize``; the estimators without a baseline for p_t refuse a batch carrying them,
and rewards on environment tokens are refused where the trajectory becomes an experience. The
end-to-end path (an agent file's steps giving them, through the executor the trainer builds, on a
real rollout daemon) is ``test_agent_process_rewards_reach_the_advantages``.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from treadle.common.records import Trajectory
from treadle.trainer.rl.experience import from_trajectory
from treadle.trainer.rl.returns import ReturnsConfig, finalize

CFG = ReturnsConfig(estimator="reinforce", group_size=1, gamma=1.0, lambd=1.0, std_norm=True, kl_coef=0.0,
                    kl_estimator="k1", kl_in_reward=True, clip_range=(-10.0, 10.0), max_new_tokens=16,
                    overlong_buffer_len=None, overlong_penalty_factor=1.0, stop_properly_coef=None, is_level=None)


def traj(reward, loss_mask, token_rewards=None, uid="u"):
    n = len(loss_mask)
    return Trajectory(prompt_token_ids=np.array([1, 2], np.int32), response_token_ids=np.arange(3, 3 + n, dtype=np.int32),
                      rollout_logprobs=np.full(n, -0.5, np.float32), loss_mask=np.array(loss_mask, np.uint8),
                      reward=reward, uid=uid,
                      token_rewards=None if token_rewards is None else np.array(token_rewards, np.float32))


def exps_of(trajs):
    out = [from_trajectory(t) for t in trajs]
    for e in out:
        e.reward = float(e.traj.reward)
    return out


def test_process_rewards_add_to_the_outcome_reward_by_hand():
    # sample 0: 3 action tokens around an environment token, p = [0.5, (env), 0, -0.25], R = 1
    # sample 1: 2 action tokens, p = [1, 0], R = 0
    trajs = [traj(1.0, [1, 0, 1, 1], [0.5, 0.0, 0.0, -0.25]), traj(0.0, [1, 1], [1.0, 0.0])]
    exps = exps_of(trajs)
    assert exps[0].arrays["process_rewards"].tolist() == [0.5, 0.0, -0.25]  # at the action tokens
    metrics = finalize(exps, CFG)
    # r = [[0.5, 0, -0.25 + 1], [1, 0]]; G_t = sum_{k >= t} r_k (gamma 1) = [[1.25, 0.75, 0.75], [1, 0]]
    assert exps[0].arrays["returns"].tolist() == [1.25, 0.75, 0.75]
    assert exps[1].arrays["returns"].tolist() == [1.0, 0.0]
    # reinforce whitens the returns over the batch: mean 3.75 / 5 = 0.75, biased var 0.875 / 5 = 0.175
    want = np.array([0.5, 0.0, 0.0, 0.25, -0.75]) / np.sqrt(0.175)
    got = np.concatenate([e.arrays["advantages"] for e in exps])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert metrics["reward/process_mean"] == pytest.approx((0.25 + 1.0) / 2)  # per sample, summed
    # without them: r = [[0, 0, 1], [0, 0]] -> G = [[1, 1, 1], [0, 0]]: the advantages differ
    plain = exps_of([msgspec.structs.replace(t, token_rewards=None) for t in trajs])
    plain_metrics = finalize(plain, CFG)
    assert plain[0].arrays["returns"].tolist() == [1.0, 1.0, 1.0] and "reward/process_mean" not in plain_metrics
    assert not np.allclose(np.concatenate([e.arrays["advantages"] for e in plain]), got)


def test_gae_credits_a_process_reward_to_the_tokens_before_it():
    # gae, values 0, gamma 0.5, lambda 1, no whitening of the scale: A_t = sum_k 0.5^(k-t) r_k, centred
    exps = exps_of([traj(0.0, [1, 1, 1], [0.0, 2.0, 0.0]), traj(0.0, [1, 1, 1])])
    for e in exps:
        e.arrays["values"] = np.zeros(3, np.float32)
    finalize(exps, dataclasses.replace(CFG, estimator="gae", gamma=0.5, std_norm=False))
    # row 0: r = [0, 2, 0] -> A = [1, 2, 0]; row 1: all 0; centred over the 6 tokens (mean 0.5)
    assert exps[0].arrays["returns"].tolist() == [1.0, 2.0, 0.0]
    np.testing.assert_allclose(np.concatenate([e.arrays["advantages"] for e in exps]),
                               [0.5, 1.5, -0.5, -0.5, -0.5, -0.5], rtol=1e-6)


@pytest.mark.parametrize("estimator", ["rloo", "group_norm", "dr_grpo", "flash_reinforce"])
def test_group_estimators_refuse_process_rewards(estimator):
    exps = exps_of([traj(1.0, [1, 1], [0.5, 0.0], uid="3.0"), traj(0.0, [1, 1], uid="3.1")])
    with pytest.raises(ValueError, match=rf"trajectory '3.0' .*--algo.advantage.estimator {estimator} cannot use"):
        finalize(exps, dataclasses.replace(CFG, estimator=estimator, group_size=2))
    finalize(exps_of([traj(1.0, [1, 1], uid="3.0"), traj(0.0, [1, 1], uid="3.1")]),
             dataclasses.replace(CFG, estimator=estimator, group_size=2))  # without them: fine


def test_rewards_on_environment_tokens_and_non_finite_ones_are_refused():
    with pytest.raises(ValueError, match=r"trajectory 'e': token_rewards\[1\] = 0.5 lies on an environment token"):
        from_trajectory(traj(0.0, [1, 0, 1], [0.0, 0.5, 0.0], uid="e"))
    with pytest.raises(ValueError, match=r"token_rewards\[0\] = nan is not finite"):
        from_trajectory(traj(0.0, [1], [float("nan")]))
    assert from_trajectory(traj(0.0, [1, 0, 1], [0.0, 0.0, 3.0])).arrays["process_rewards"].tolist() == [0.0, 3.0]
