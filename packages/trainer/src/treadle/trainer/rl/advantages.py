"""Advantage estimators: group baselines on episode rewards, per-token rewards, returns, GAE.

The trainer's pipeline for one rollout batch, each step a function here:

1. ``GROUP_BASELINES[estimator](rewards, n)``: scalar episode rewards ``[B]`` -> shaped ``[B]``
   (the group baseline of RLOO / GRPO / Dr. GRPO / REINFORCE++-baseline; identity otherwise).
2. ``token_rewards``: put the shaped reward on each row's last action token, subtract the
   per-token KL penalty, add process rewards -> ``[B, L]``.
3. ``compute_advantages(estimator, ...)``: returns and advantages ``[B, L]`` (GAE, or discounted
   returns), whitened over the batch for the estimators that want it.

Layout: ``[B, L]`` right-padded action arrays, ``mask`` bool with a True prefix per row; the
``n`` samples of one prompt are consecutive (``x.view(G, n)``). Every ``[B, L]`` output is 0 on
padding. Whitening uses the statistics of the tensor it is given: the trainer calls it on the
whole rollout batch, before splitting into micro-batches or ranks.

Not here: the KL estimate itself (``kl``), reward shaping and filtering (``shaping``), losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from treadle.trainer.rl._masked import as_float, check_shapes, last_index, zero_pad

GROUP_NORM_EPS = 1e-6
"""eps of GRPO's (r - mean) / (std + eps): keeps all-equal groups (std 0) at advantage 0."""


def _groups(rewards: Tensor, group_size: int, min_size: int = 1) -> Tensor:
    """rewards ``[B]`` -> ``[G, n]`` view, with named errors for a bad B or n."""
    b = rewards.shape[0]
    if group_size < min_size:
        raise ValueError(f"this baseline needs group_size >= {min_size}, got {group_size}")
    if b % group_size:
        raise ValueError(f"batch size {b} is not a multiple of group_size {group_size}")
    return as_float(rewards).view(b // group_size, group_size)


def no_baseline(rewards: Tensor, group_size: int) -> Tensor:
    """r_i unchanged (``gae``, ``reinforce``: the critic or the global whitening is the baseline).

    ``[B] -> [B]``; ``group_size`` is ignored.
    """
    return as_float(rewards)


def mean_baseline(rewards: Tensor, group_size: int) -> Tensor:
    """r_i - mean_{j in group(i)} r_j  ``[B] -> [B]``.

    REINFORCE++-baseline (Hu 2025, "REINFORCE++") and Dr. GRPO (Liu et al. 2025, "Understanding
    R1-Zero-like training", eq. 3), which drops GRPO's division by the group std on purpose.
    """
    g = _groups(rewards, group_size)
    return (g - g.mean(dim=1, keepdim=True)).reshape(-1)


def rloo_baseline(rewards: Tensor, group_size: int) -> Tensor:
    """r_i - (sum_{j in group(i)} r_j - r_i) / (n - 1): leave-one-out mean of the others.

    RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to basics"). ``[B] -> [B]``, n >= 2.
    """
    g = _groups(rewards, group_size, min_size=2)
    return (g - (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)).reshape(-1)


def group_norm_baseline(rewards: Tensor, group_size: int) -> Tensor:
    """(r_i - mean_group) / (std_group + eps), std UNBIASED (divides by n - 1), eps = 1e-6.

    GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2); the unbiased std is torch's default
    and OpenRLHF's. ``[B] -> [B]``, n >= 2 (the unbiased std of one sample is undefined).
    """
    g = _groups(rewards, group_size, min_size=2)
    centred = g - g.mean(dim=1, keepdim=True)
    return (centred / (g.std(dim=1, keepdim=True) + GROUP_NORM_EPS)).reshape(-1)


def token_rewards(final: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float,
                  process: Tensor | None = None) -> Tensor:
    """r_t = -kl_coef * kl_t + process_t  (+ final on each row's last action token), 0 on padding.

    OpenRLHF's ``compute_reward`` (the KL penalty in the reward, Ziegler et al. 2019).
    final ``[B]`` episode rewards (after ``GROUP_BASELINES``), mask ``[B, L]``, kl ``[B, L]`` or
    None (no penalty), process ``[B, L]`` per-token rewards or None. Returns ``[B, L]``; a row
    without action tokens gets all zeros (its final reward has nowhere to go).
    """
    m = check_shapes(mask, kl=kl, process=process)
    r = torch.zeros(m.shape, dtype=as_float(final).dtype, device=final.device)
    if kl is not None:
        r = r - kl_coef * zero_pad(as_float(kl), m)
    if process is not None:
        r = r + zero_pad(as_float(process), m)
    last, nonempty = last_index(m)
    on_last = torch.where(nonempty, as_float(final), 0.0)
    return r.scatter_add(1, last[:, None], on_last[:, None].to(r.dtype))


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k over the row's action tokens; 0 on padding.

    Computed backwards, G_t = r_t + gamma G_{t+1} (REINFORCE, Williams 1992). ``[B, L]`` ->
    ``[B, L]``; padding rewards are treated as 0 so they never reach a real token.
    """
    m = check_shapes(mask, rewards=rewards)
    r = zero_pad(as_float(rewards), m)
    running, out = torch.zeros_like(r[:, 0]), []
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        out.append(running)
    return zero_pad(torch.stack(out[::-1], dim=1) if out else r, m)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16):

        delta_t = r_t + gamma V_{t+1} - V_t      (V after the last action token = 0)
        A_t     = sum_k (gamma lambd)^k delta_{t+k}      returns_t = A_t + V_t

    rewards, values, mask ``[B, L]`` -> (advantages, returns) ``[B, L]``, 0 on padding. Gradients
    flow through ``values`` if it has any; the trainer passes detached values.
    """
    m = check_shapes(mask, rewards=rewards, values=values)
    r, v = zero_pad(as_float(rewards), m), zero_pad(as_float(values), m)
    running, next_v, out = torch.zeros_like(r[:, 0]), torch.zeros_like(r[:, 0]), []
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = delta + gamma * lambd * running
        out.append(running)
        next_v = v[:, t]
    adv = zero_pad(torch.stack(out[::-1], dim=1) if out else r, m)
    return adv, zero_pad(adv + v, m)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, std: bool = True, eps: float = 1e-8) -> Tensor:
    """y = (x - mu) / (sigma + eps) over the masked entries of the whole tensor; 0 on padding.

    mu = masked mean; sigma = the BIASED masked std sqrt(sum m (x - mu)^2 / sum m) (a population
    statistic of the batch, as OpenRLHF's advantage normalisation). ``std=False`` only centres;
    ``shift_mean=False`` adds mu back (scale only, TRL's ``whiten``). ``[B, L] -> [B, L]``.
    """
    m = check_shapes(mask, x=x)
    xs = zero_pad(as_float(x), m)
    count = m.sum().clamp(min=1)
    mu = xs.sum() / count
    y = zero_pad(xs - mu, m)
    if std:
        y = y / ((y.square().sum() / count).sqrt() + eps)
    if not shift_mean:
        y = y + mu
    return zero_pad(y, m)


AdvantageFn = Callable[[Tensor, Tensor, Tensor | None, float, float, bool], tuple[Tensor, Tensor]]


def _gae_whitened(r: Tensor, m: Tensor, values: Tensor | None, gamma: float, lambd: float,
                  std_norm: bool) -> tuple[Tensor, Tensor]:
    if values is None:
        raise ValueError("the gae estimator needs values from a critic")
    adv, ret = gae(r, values, m, gamma, lambd)
    return whiten(adv, m, std=std_norm), ret


def _returns_whitened(r: Tensor, m: Tensor, values: Tensor | None, gamma: float, lambd: float,
                      std_norm: bool) -> tuple[Tensor, Tensor]:
    ret = discounted_returns(r, m, gamma)
    return whiten(ret, m, std=std_norm), ret


def _returns_as_advantages(r: Tensor, m: Tensor, values: Tensor | None, gamma: float, lambd: float,
                           std_norm: bool) -> tuple[Tensor, Tensor]:
    # The group baseline already centred (and for GRPO scaled) the reward; Dr. GRPO (Liu et al.
    # 2025) shows a further std division biases the update, so no global whitening here.
    ret = discounted_returns(r, m, gamma)
    return ret, ret


def compute_advantages(estimator: str, *, token_rewards: Tensor, mask: Tensor, values: Tensor | None = None,
                       gamma: float = 1.0, lambd: float = 1.0, std_norm: bool = True) -> tuple[Tensor, Tensor]:
    """(advantages, returns) ``[B, L]`` for ``estimator`` from per-token rewards ``[B, L]``:

    - ``gae``: ``gae`` then ``whiten(advantages, std=std_norm)``; needs ``values`` ``[B, L]``.
    - ``reinforce``, ``reinforce_baseline``: returns = ``discounted_returns``,
      advantages = ``whiten(returns, std=std_norm)`` (REINFORCE++'s global normalisation).
    - ``rloo``, ``group_norm``, ``dr_grpo``: advantages = returns = ``discounted_returns``.
    """
    if estimator not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose from {sorted(ADVANTAGES)}")
    return ADVANTAGES[estimator](token_rewards, mask, values, gamma, lambd, std_norm)


GROUP_BASELINES: dict[str, Callable[[Tensor, int], Tensor]] = {
    "gae": no_baseline,
    "reinforce": no_baseline,
    "reinforce_baseline": mean_baseline,
    "rloo": rloo_baseline,
    "group_norm": group_norm_baseline,
    "dr_grpo": mean_baseline,
}
"""``--algo.advantage.estimator`` -> episode-reward baseline ``(rewards [B], group_size) -> [B]``."""

ADVANTAGES: dict[str, AdvantageFn] = {
    "gae": _gae_whitened,
    "reinforce": _returns_whitened,
    "reinforce_baseline": _returns_whitened,
    "rloo": _returns_as_advantages,
    "group_norm": _returns_as_advantages,
    "dr_grpo": _returns_as_advantages,
}
"""``--algo.advantage.estimator`` -> ``(token_rewards, mask, values, gamma, lambd, std_norm)`` ->
(advantages, returns); called through ``compute_advantages``."""
