"""Advantage estimators: group baselines on episode rewards, per-token rewards, returns, GAE.

The trainer's pipeline for one rollout batch, each step a function here:

1. ``GROUP_BASELINES[estimator](rewards, n)``: scalar episode rewards ``[B]`` -> shaped ``[B]``
   (the group baseline of RLOO / GRPO / Dr. GRPO / REINFORCE++-baseline, FlashREINFORCE's batch
   mean; identity otherwise). The trainer then clips the result (``--reward.clip_range``), as
   OpenRLHF's ``compute_reward`` does: after the baseline.
2. ``token_rewards``: put the shaped reward on each row's last action token, subtract the
   per-token KL penalty, add process rewards -> ``[B, L]``.
3. ``compute_advantages(estimator, ...)``: returns and advantages ``[B, L]`` (GAE, or discounted
   returns), whitened over the batch for the estimators that want it.

Process rewards (per-token rewards an agent gave, ``Trajectory.token_rewards`` at the action
tokens) enter at step 2 only, like the KL penalty: r_t = p_t - kl_coef kl_t (+ the episode's
outcome reward R' on the last action token), where R' alone went through step 1's shaping,
baseline and clipping; p_t is neither baselined nor clipped. So only the estimators whose step 3
supplies a baseline for per-token rewards take them (``PROCESS_REWARD_ESTIMATORS``): ``gae`` (the
critic's values) and ``reinforce`` / ``reinforce_baseline`` (returns whitened over the batch).
The group estimators (``rloo``, ``group_norm``, ``dr_grpo``, ``flash_reinforce``) use the
returns as advantages unwhitened: a raw p_t would reach the advantage with no baseline and, for
GRPO, outside its std scale. They are refused there (``rl.returns``), not silently summed;
DeepSeekMath's process-supervised GRPO (sec. 4.1.3, step rewards normalised over the group) is
not implemented. OpenRLHF has no per-token rewards at all: its reward functions return one
number per sample and its ``MultiTurnAgentExecutor`` sums the step rewards into one.

Layout: ``[B, L]`` right-padded action arrays, ``mask`` bool with a True prefix per row; the
``n`` samples of one prompt are consecutive (``x.view(G, n)``). Every ``[B, L]`` output is 0 on
padding. Whitening uses the statistics of the tensor it is given: the trainer calls it on the
whole rollout batch, before splitting into micro-batches or ranks.

Multi-turn: action arrays hold only the policy's tokens; an environment's tokens between two
actions are not steps, so gamma and lambda apply once from one action token to the next
(``gaps`` None). ``gaps[b, t]``, the environment tokens after action t before the next action,
gives OpenRLHF's layout instead, where every response position is a step with reward 0 and value
0 on environment tokens (``--algo.advantage.discount_env_tokens``). With gamma = lambda = 1 the
two agree.

Not here: the KL estimate itself (``kl``), reward shaping and filtering (``shaping``), losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from treadle.trainer.config.algo import PROCESS_REWARD_ESTIMATORS as _PROCESS_REWARD_ESTIMATORS
from treadle.trainer.rl._masked import as_float, check_shapes, last_index, zero_pad

GROUP_NORM_EPS = 1e-9
"""eps of GRPO's (r - mean) / (std + eps): keeps all-equal groups (std 0) at advantage 0 (OpenRLHF's)."""
WHITEN_VAR_FLOOR = 1e-8
"""``whiten`` divides by sqrt(max(var, floor)) (OpenRLHF's advantage normalisation)."""


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


def batch_mean_baseline(rewards: Tensor, group_size: int) -> Tensor:
    """r_i - mean_j r_j over the whole batch ``[B] -> [B]``; ``group_size`` is ignored.

    FlashREINFORCE's baseline (OpenRLHF's ``flash_reinforce``): one sample per prompt has no
    group to compare with, so the rollout batch is the baseline; no whitening follows.
    """
    r = as_float(rewards)
    return r - r.mean()


def group_norm_baseline(rewards: Tensor, group_size: int) -> Tensor:
    """(r_i - mean_group) / (std_group + eps), std UNBIASED (divides by n - 1), eps = 1e-9.

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


PROCESS_REWARD_ESTIMATORS = _PROCESS_REWARD_ESTIMATORS
"""Estimators that take per-token (process) rewards in ``token_rewards(process=...)`` (module docstring;
defined in ``config.algo``, where the config refuses the others for a process reward model)."""


def _gap_powers(base: float, gaps: Tensor | None, like: Tensor, mask: Tensor) -> Tensor:
    """base^g ``[B, L]`` (g 0 on padding; all 1 when ``gaps`` is None): the discount across a gap."""
    if gaps is None:
        return torch.ones_like(like)
    return torch.full_like(like, base).pow(zero_pad(as_float(gaps).to(like.dtype), mask))


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float, gaps: Tensor | None = None) -> Tensor:
    """G_t = r_t + gamma^(1 + g_t) G_{t+1} over the row's action tokens; 0 on padding.

    g_t: environment tokens between action t and the next (``gaps``; None: 0, each action token a
    step). With g = 0, G_t = sum_{k >= t} gamma^(k - t) r_k (REINFORCE, Williams 1992); with the
    gaps it is OpenRLHF's ``get_cumulative_returns`` over every response position. ``[B, L]`` ->
    ``[B, L]``; padding rewards are treated as 0 so they never reach a real token.
    """
    m = check_shapes(mask, rewards=rewards, gaps=gaps)
    r = zero_pad(as_float(rewards), m)
    discount = gamma * _gap_powers(gamma, gaps, r, m)
    running, out = torch.zeros_like(r[:, 0]), []
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + discount[:, t] * running
        out.append(running)
    return zero_pad(torch.stack(out[::-1], dim=1) if out else r, m)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float,
        gaps: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16):

        delta_t = r_t + gamma V_{t+1} - V_t      (V after the last action token = 0)
        A_t     = delta_t + gamma lambd A_{t+1}       returns_t = A_t + V_t

    With ``gaps`` g_t (environment tokens between action t and the next, each a step of reward 0
    and value 0: OpenRLHF's ``get_advantages_and_returns`` over every response position), walking
    the g_t zero steps gives delta_t = r_t + gamma (gamma lambd)^g_t V_{t+1} - V_t and
    A_t = delta_t + (gamma lambd)^(g_t + 1) A_{t+1}. rewards, values, mask, gaps ``[B, L]`` ->
    (advantages, returns) ``[B, L]``, 0 on padding. Gradients flow through ``values`` if it has
    any; the trainer passes detached values.
    """
    m = check_shapes(mask, rewards=rewards, values=values, gaps=gaps)
    r, v = zero_pad(as_float(rewards), m), zero_pad(as_float(values), m)
    across = _gap_powers(gamma * lambd, gaps, r, m)
    running, next_v, out = torch.zeros_like(r[:, 0]), torch.zeros_like(r[:, 0]), []
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * across[:, t] * next_v - v[:, t]
        running = delta + gamma * lambd * across[:, t] * running
        out.append(running)
        next_v = v[:, t]
    adv = zero_pad(torch.stack(out[::-1], dim=1) if out else r, m)
    return adv, zero_pad(adv + v, m)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, std: bool = True,
           var_floor: float = WHITEN_VAR_FLOOR) -> Tensor:
    """y = (x - mu) / sqrt(max(var, var_floor)) over the masked entries of the whole tensor; 0 on padding.

    mu = masked mean; var = the BIASED masked variance sum m (x - mu)^2 / sum m (a population
    statistic of the batch), floored: OpenRLHF's advantage normalisation. ``std=False`` only
    centres; ``shift_mean=False`` adds mu back (scale only, TRL's ``whiten``). ``[B, L] -> [B, L]``.
    """
    m = check_shapes(mask, x=x)
    xs = zero_pad(as_float(x), m)
    count = m.sum().clamp(min=1)
    mu = xs.sum() / count
    y = zero_pad(xs - mu, m)
    if std:
        y = y * (y.square().sum() / count).clamp(min=var_floor).rsqrt()
    if not shift_mean:
        y = y + mu
    return zero_pad(y, m)


AdvantageFn = Callable[[Tensor, Tensor, Tensor | None, float, float, bool, Tensor | None], tuple[Tensor, Tensor]]


def _gae_whitened(r: Tensor, m: Tensor, values: Tensor | None, gamma: float, lambd: float,
                  std_norm: bool, gaps: Tensor | None) -> tuple[Tensor, Tensor]:
    if values is None:
        raise ValueError("the gae estimator needs values from a critic")
    adv, ret = gae(r, values, m, gamma, lambd, gaps)
    return whiten(adv, m, std=std_norm), ret


def _returns_whitened(r: Tensor, m: Tensor, values: Tensor | None, gamma: float, lambd: float,
                      std_norm: bool, gaps: Tensor | None) -> tuple[Tensor, Tensor]:
    ret = discounted_returns(r, m, gamma, gaps)
    return whiten(ret, m, std=std_norm), ret


def _returns_as_advantages(r: Tensor, m: Tensor, values: Tensor | None, gamma: float, lambd: float,
                           std_norm: bool, gaps: Tensor | None) -> tuple[Tensor, Tensor]:
    # The group baseline already centred (and for GRPO scaled) the reward; Dr. GRPO (Liu et al.
    # 2025) shows a further std division biases the update, so no global whitening here.
    ret = discounted_returns(r, m, gamma, gaps)
    return ret, ret


def compute_advantages(estimator: str, *, token_rewards: Tensor, mask: Tensor, values: Tensor | None = None,
                       gamma: float = 1.0, lambd: float = 1.0, std_norm: bool = True,
                       gaps: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(advantages, returns) ``[B, L]`` for ``estimator`` from per-token rewards ``[B, L]``:

    - ``gae``: ``gae`` then ``whiten(advantages, std=std_norm)``; needs ``values`` ``[B, L]``.
    - ``reinforce``, ``reinforce_baseline``: returns = ``discounted_returns``,
      advantages = ``whiten(returns, std=std_norm)`` (REINFORCE++'s global normalisation).
    - ``rloo``, ``group_norm``, ``dr_grpo``, ``flash_reinforce``: advantages = returns =
      ``discounted_returns``.

    gamma is honoured by every estimator (OpenRLHF forces 1 for all but gae and reinforce: pass
    1 for its behaviour). ``gaps`` ``[B, L]``: environment tokens after each action token
    (module docstring); None: none counted.
    """
    if estimator not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose from {sorted(ADVANTAGES)}")
    return ADVANTAGES[estimator](token_rewards, mask, values, gamma, lambd, std_norm, gaps)


GROUP_BASELINES: dict[str, Callable[[Tensor, int], Tensor]] = {
    "gae": no_baseline,
    "reinforce": no_baseline,
    "reinforce_baseline": mean_baseline,
    "rloo": rloo_baseline,
    "group_norm": group_norm_baseline,
    "dr_grpo": mean_baseline,
    "flash_reinforce": batch_mean_baseline,
}
"""``--algo.advantage.estimator`` -> episode-reward baseline ``(rewards [B], group_size) -> [B]``."""

ADVANTAGES: dict[str, AdvantageFn] = {
    "gae": _gae_whitened,
    "reinforce": _returns_whitened,
    "reinforce_baseline": _returns_whitened,
    "rloo": _returns_as_advantages,
    "group_norm": _returns_as_advantages,
    "dr_grpo": _returns_as_advantages,
    "flash_reinforce": _returns_as_advantages,
}
"""``--algo.advantage.estimator`` -> ``(token_rewards, mask, values, gamma, lambd, std_norm, gaps)`` ->
(advantages, returns); called through ``compute_advantages``."""
