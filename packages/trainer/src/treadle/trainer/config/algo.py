"""RL algorithm choices (the ``algo`` group): advantage estimator, off-policy importance-sampling
correction, KL control and dynamic filtering.

The estimator names are OpenRLHF's: ``gae`` (PPO with a critic), ``reinforce`` (REINFORCE++),
``reinforce_baseline`` (REINFORCE++-baseline), ``rloo``, ``group_norm`` (GRPO) and ``dr_grpo``
(Dr. GRPO). The math is in ``treadle.trainer``'s advantage / loss modules, keyed by these names.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from treadle.common.config import ConfigError, configclass, switch_only

AdvantageEstimator = Literal["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = typing.get_args(AdvantageEstimator)
GROUP_ESTIMATORS = frozenset({"reinforce_baseline", "rloo", "group_norm", "dr_grpo"})
"""Estimators whose baseline comes from the other samples of the same prompt (need n > 1)."""
ISCorrection = Literal["tis", "icepop", "seq-mask-tis"]
KLEstimator = Literal["k1", "k2", "k3"]


@configclass
class AdvantageConfig:
    """Advantage estimation, plus the importance-sampling correction for rollout/train mismatch."""

    estimator: AdvantageEstimator = "gae"
    """gae | reinforce | reinforce_baseline | rloo | group_norm | dr_grpo."""
    gamma: float = 1.0
    """Discount factor."""
    lambd: float = 1.0
    """GAE lambda (bias/variance trade-off); gae only."""
    no_std_norm: Annotated[bool, switch_only()] = False
    """Only centre advantages, do not divide by their std."""
    is_correction_enable: bool = False
    """Re-weight by pi_train / pi_rollout to correct the rollout engine's off-policy drift."""
    is_correction_type: ISCorrection = "tis"
    """tis: clamp token ratios; icepop: drop tokens outside the band; seq-mask-tis: mask sequences by geometric-mean ratio."""
    is_correction_threshold: tuple[float, float] = (0.5, 5.0)
    """Ratio band [low, high] of the correction."""

    def __post_init__(self) -> None:
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"--gamma must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lambd <= 1:
            raise ConfigError(f"--lambd must be in [0, 1], got {self.lambd}")
        low, high = self.is_correction_threshold
        if not 0 <= low < high:
            raise ConfigError(f"--is_correction_threshold must be 0 <= low < high, got {low} {high}")


@configclass
class KLConfig:
    """KL regularisation towards the reference policy."""

    init_coef: float = 0.01
    """KL coefficient (initial one when adaptive); 0: no reference model at all."""
    target: float | None = None
    """Target KL of the adaptive controller; None: fixed coefficient."""
    horizon: int = 10000
    """Horizon of the adaptive controller (samples)."""
    estimator: KLEstimator = "k1"
    """k1: log-ratio; k2: squared log-ratio / 2; k3: unbiased low-variance (ratio - 1 - log ratio)."""
    use_loss: bool = False
    """Put the KL in the loss (GRPO-style) instead of subtracting it from the reward."""

    def __post_init__(self) -> None:
        if not self.init_coef >= 0:
            raise ConfigError(f"--init_coef must be >= 0, got {self.init_coef}")
        if self.target is not None and not self.target > 0:
            raise ConfigError(f"--target must be > 0 (or None), got {self.target}")
        if self.horizon < 1:
            raise ConfigError(f"--horizon must be >= 1, got {self.horizon}")
        if self.use_loss and self.init_coef == 0:
            raise ConfigError("--use_loss with --init_coef 0 adds nothing: set a coefficient or drop --use_loss")


@configclass
class AlgoConfig:
    """The RL algorithm."""

    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimation and IS correction."""
    kl: KLConfig = KLConfig()
    """KL control."""
    dynamic_filtering_enable: bool = False
    """DAPO dynamic sampling: drop prompts whose mean score falls outside dynamic_filtering_range."""
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)
    """Keep prompts whose mean score is strictly inside (low, high)."""

    def __post_init__(self) -> None:
        low, high = self.dynamic_filtering_range
        if not low < high:
            raise ConfigError(f"--dynamic_filtering_range must be low < high, got {low} {high}")
