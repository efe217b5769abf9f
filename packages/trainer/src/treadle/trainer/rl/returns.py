"""From scored experiences to advantages: reward shaping, IS correction, KL penalty, baselines.

``finalize`` runs, on the whole rollout batch (every rank holds it, so every rank computes the
same numbers), the steps OpenRLHF's experience maker runs after the forward passes:

1. episode reward: the trajectory's reward (or the reward model's score), then DAPO's overlong
   penalty and the stop-properly penalty (``rl.shaping``);
2. the importance-sampling correction weights of rollout/trainer mismatch (``rl.correction``), or 1;
3. the per-token KL to the reference, subtracted from the reward unless it is a loss term (``rl.kl``);
4. the group baseline of the estimator, then clipping to ``--reward.clip_range`` (after the
   baseline, as OpenRLHF's ``compute_reward``), then returns and advantages (``rl.advantages``).
   The episode reward goes on each row's last action token; an agent's per-token (process)
   rewards, the ``process_rewards`` action arrays, are added where they fall, unshaped and
   unclipped: r_t = p_t - kl_coef kl_t + [t last] R'. Only ``PROCESS_REWARD_ESTIMATORS`` take
   them; with any other estimator a batch carrying them is refused (``process_rewards``);
5. on-policy distillation (``teacher_logp`` arrays, ``--teacher.model_name_or_path``): the
   teacher's per-token reverse-KL advantage is added to the estimator's advantages, unnormalised
   (``rl.distill``), so every estimator takes it; the returns (the critic's targets) do not.

These per-token scalars are computed in float64 (rewards of 1e4 lose digits in float32 sums and
whitening) and stored as the float32 action arrays ``advantages``, ``returns`` and
``is_weights``; it returns the step's metrics. Group order: experiences come group by group,
``n`` consecutive samples per prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treadle.trainer.rl.advantages import (
    GROUP_BASELINES,
    PROCESS_REWARD_ESTIMATORS,
    compute_advantages,
    token_rewards,
)
from treadle.trainer.rl.correction import is_correction, logprob_gap
from treadle.trainer.rl.distill import distill_advantages, reverse_kl
from treadle.trainer.rl.experience import Experience, env_gaps, stack, unstack
from treadle.trainer.rl.kl import KL_ESTIMATORS
from treadle.trainer.rl.shaping import clip_rewards, overlong_penalty, stop_properly


@dataclass(frozen=True, slots=True, kw_only=True)
class ReturnsConfig:
    """What ``finalize`` needs from ``--algo.*``, ``--reward.*`` and ``--rollout.*``."""

    estimator: str
    group_size: int
    gamma: float
    lambd: float
    std_norm: bool
    kl_coef: float
    """Current KL coefficient (0: no reference)."""
    kl_estimator: str
    kl_in_reward: bool
    """Subtract the KL from the reward (False: the actor's loss has it)."""
    clip_range: tuple[float, float]
    max_new_tokens: int
    overlong_buffer_len: float | None
    overlong_penalty_factor: float
    stop_properly_coef: float | None
    is_level: str | None
    """IS correction level ("token" or "seq"); None: off (weights 1)."""
    is_mode: str = "mask"
    """IS correction mode ("mask" or "clip")."""
    is_gating: str = "ratio"
    """Statistic the IS gate reads ("ratio", "binary_kl", "tv")."""
    is_band: tuple[float, float] = (0.5, 5.0)
    """[low, high] band of the gated statistic."""
    rollout_logprobs: bool = True
    """The experiences carry the engines' logprobs (False: zeros, so no gap metrics)."""
    discount_env_tokens: bool = False
    """gamma and lambda also apply at environment tokens of multi-turn trajectories (OpenRLHF's layout)."""
    distill_coef: float = 0.0
    """beta_T of on-policy distillation (``rl.distill``), used when the experiences carry ``teacher_logp``."""


def episode_rewards(exps: Sequence[Experience], cfg: ReturnsConfig) -> torch.Tensor:
    """[B] float64 shaped episode rewards, before the baseline and clipping (step 1 of the module docstring)."""
    r = torch.tensor([e.reward for e in exps], dtype=torch.float64)
    if cfg.overlong_buffer_len is not None:
        lengths = torch.tensor([e.response_length for e in exps], dtype=torch.float64)
        r = r + overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer_len, cfg.overlong_penalty_factor).double()
    if cfg.stop_properly_coef is not None:
        stopped = torch.tensor([not e.traj.truncated for e in exps])
        r = stop_properly(r, stopped, cfg.stop_properly_coef).double()
    return r


def process_rewards(exps: Sequence[Experience], estimator: str) -> torch.Tensor | None:
    """[B, L] float64 process rewards of the batch (0 for experiences without), or None when no
    experience has any. Raises ``ValueError`` naming ``--algo.advantage.estimator`` when the
    estimator cannot use them (``rl.advantages``' module docstring says why)."""
    given = [e for e in exps if "process_rewards" in e.arrays]
    if not given:
        return None
    if estimator not in PROCESS_REWARD_ESTIMATORS:
        raise ValueError(
            f"trajectory {given[0].traj.uid!r} (and {len(given) - 1} more in this batch) carries per-token "
            f"rewards (Trajectory.token_rewards: an agent step's \"token_rewards\"), which "
            f"--algo.advantage.estimator {estimator} cannot use: its advantages are the returns with the group "
            f"baseline taken on the episode reward only, so per-token rewards would reach them with no baseline. "
            f"Use one of {sorted(PROCESS_REWARD_ESTIMATORS)}, or fold them into the step's reward")
    width = max(1, max(e.num_actions for e in exps))
    out = torch.zeros(len(exps), width, dtype=torch.float64)
    for k, e in enumerate(exps):
        if "process_rewards" in e.arrays:
            out[k, : e.num_actions] = torch.from_numpy(e.arrays["process_rewards"]).double()
    return out


def finalize(exps: Sequence[Experience], cfg: ReturnsConfig) -> dict[str, float]:
    """Fill ``is_weights``, ``advantages`` and ``returns`` of ``exps``; the step's metrics.

    Without ``old_logp`` arrays (not scored: strictly on-policy, no KL penalty in the reward, no IS
    correction) the gap between engine and trainer is measured in the actor's step instead."""
    process = process_rewards(exps, cfg.estimator)  # refused before any of the math below
    rollout, mask = stack(exps, "rollout_logp")
    rollout = rollout.double()
    metrics: dict[str, float] = {}
    if "old_logp" in exps[0].arrays:
        old = stack(exps, "old_logp")[0].double()
        if cfg.rollout_logprobs:
            metrics["logprob_gap/mean"], metrics["logprob_gap/max"] = logprob_gap(old, rollout, mask)
    elif cfg.is_level is not None or (cfg.kl_coef > 0 and cfg.kl_in_reward) or "teacher_logp" in exps[0].arrays:
        raise ValueError("finalize needs old_logp for the IS correction, the KL penalty and distillation")
    if cfg.is_level is None:
        weights = mask.double()
    else:
        weights, keep = is_correction(old, rollout, mask, level=cfg.is_level, mode=cfg.is_mode, gating=cfg.is_gating,
                                      low=cfg.is_band[0], high=cfg.is_band[1])
        metrics["is/kept_frac"] = float(keep.sum() / mask.sum().clamp(min=1))
    unstack(exps, "is_weights", weights)

    shaped = episode_rewards(exps, cfg)
    kl = None
    if "ref_logp" in exps[0].arrays and "old_logp" in exps[0].arrays:
        ref = stack(exps, "ref_logp")[0].double()
        kl = KL_ESTIMATORS[cfg.kl_estimator](old, ref) * mask
        per_seq = kl.sum(1) / mask.sum(1).clamp(min=1)
        metrics["kl"] = float(per_seq.mean())
    final = clip_rewards(GROUP_BASELINES[cfg.estimator](shaped, cfg.group_size), *cfg.clip_range)
    rewards = token_rewards(final, mask, kl if cfg.kl_in_reward else None, cfg.kl_coef, process)
    values = stack(exps, "values")[0].double() if cfg.estimator == "gae" else None
    gaps = env_gaps(exps) if cfg.discount_env_tokens else None
    adv, ret = compute_advantages(cfg.estimator, token_rewards=rewards, mask=mask, values=values, gamma=cfg.gamma,
                                  lambd=cfg.lambd, std_norm=cfg.std_norm, gaps=gaps)
    if "teacher_logp" in exps[0].arrays:
        teacher = stack(exps, "teacher_logp")[0].double()
        adv = adv + distill_advantages(old, teacher, mask, cfg.distill_coef)
        metrics["distill/reverse_kl"] = reverse_kl(old, teacher, mask)
    unstack(exps, "advantages", adv)
    unstack(exps, "returns", ret)
    raw = np.array([e.reward for e in exps], dtype=np.float64)
    lengths = np.array([e.response_length for e in exps], dtype=np.float64)
    metrics.update({
        "reward/mean": float(raw.mean()), "reward/std": float(raw.std()),
        "reward/shaped_mean": float(shaped.mean()), "advantages/mean": float(adv[mask].mean()),
        "advantages/abs_mean": float(adv[mask].abs().mean()), "returns/mean": float(ret[mask].mean()),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "truncated_frac": float(np.mean([e.traj.truncated for e in exps])),
    })
    if process is not None:
        metrics["reward/process_mean"] = float(process.sum(1).mean())  # per sample, summed over its tokens
    metrics.update(extra_log_means([e.traj.extra_logs for e in exps], taken=metrics.keys()))
    return metrics


def extra_log_means(logs: Sequence[Mapping[str, float]], taken: Iterable[str] = ()) -> dict[str, float]:
    """The step's mean of each ``extra_logs`` name the reward or agent files gave (over the
    samples that report it), under that name, as OpenRLHF logs them; a name that one of
    treadle's own metrics already uses (``taken``) goes under ``extra/NAME`` instead."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for log in logs:
        for k, v in log.items():
            sums[k] = sums.get(k, 0.0) + float(v)
            counts[k] = counts.get(k, 0) + 1
    reserved = set(taken)
    return {(f"extra/{k}" if k in reserved else k): sums[k] / counts[k] for k in sorted(sums)}
