"""RL algorithm choices (the ``algo`` group): advantage estimator, off-policy importance-sampling
correction, KL control and dynamic filtering.

The estimator names are OpenRLHF's: ``gae`` (PPO with a critic), ``reinforce`` (REINFORCE++),
``reinforce_baseline`` (REINFORCE++-baseline), ``rloo``, ``group_norm`` (GRPO), ``dr_grpo``
(Dr. GRPO) and ``flash_reinforce`` (FlashREINFORCE). The math is in ``treadle.trainer``'s
advantage / loss modules, keyed by these names; so are the IS correction's level, mode and
gating (OpenRLHF 0.11.2's flags).
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from treadle.common.config import ConfigError, configclass, switch_only

AdvantageEstimator = Literal["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo",
                             "flash_reinforce"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = typing.get_args(AdvantageEstimator)
GROUP_ESTIMATORS = frozenset({"reinforce_baseline", "rloo", "group_norm", "dr_grpo"})
"""Estimators whose baseline comes from the other samples of the same prompt (need n > 1)."""
PROCESS_REWARD_ESTIMATORS = frozenset({"gae", "reinforce", "reinforce_baseline"})
"""Estimators that take per-token (process) rewards (``rl.advantages``' module docstring says why)."""
ISLevel = Literal["off", "token", "seq"]
ISMode = Literal["mask", "clip"]
ISGating = Literal["ratio", "binary_kl", "tv"]
ISType = Literal["tis", "icepop", "seq-mask-tis"]
IS_TYPES: dict[str, tuple[str, str]] = {"tis": ("token", "clip"), "icepop": ("token", "mask"),
                                        "seq-mask-tis": ("seq", "mask")}
"""OpenRLHF's ``--algo.advantage.is_correction_type`` -> (level, mode), gating ratio."""
KLEstimator = Literal["k1", "k2", "k3"]


@configclass
class AdvantageConfig:
    """Advantage estimation, plus the importance-sampling correction for rollout/train mismatch."""

    estimator: AdvantageEstimator = "gae"
    """gae | reinforce | reinforce_baseline | rloo | group_norm | dr_grpo | flash_reinforce (reward minus
    the rollout batch's mean: no group, no whitening; for one sample per prompt)."""
    gamma: float = 1.0
    """Discount factor, honoured by every estimator (OpenRLHF forces 1 for all but gae and reinforce)."""
    lambd: float = 1.0
    """GAE lambda (bias/variance trade-off); gae only."""
    no_std_norm: Annotated[bool, switch_only()] = False
    """Only centre advantages, do not divide by their std."""
    discount_env_tokens: bool = False
    """Multi-turn: gamma and lambda also apply once per environment token, each a step of reward 0 and
    value 0 (OpenRLHF's layout); default: once per policy token (no difference when both are 1)."""
    is_correction_level: ISLevel = "off"
    """Re-weight by pi_train / pi_rollout against the rollout engine's drift: off | token (gate each token) |
    seq (gate each sequence by its mean statistic: a rejection filter, mask only). With gspo: its
    sequence ratio is taken against the rollout's logprobs instead (token only)."""
    is_correction_mode: ISMode = "mask"
    """mask: drop units outside the band (the others keep their token ratio; IcePop, seq-mask-tis); clip:
    clamp the token ratio into the band (TIS; token level and ratio gating only)."""
    is_correction_gating: ISGating = "ratio"
    """What the band bounds: ratio (pi_train / pi_rollout) or the sampled token's binary_kl / tv divergence
    between the two policies (a trust region: give one upper bound)."""
    is_correction_threshold: tuple[float, ...] = (0.5, 5.0)
    """Band LOW HIGH of the gated statistic, or one HIGH (low 0: an upper bound, for binary_kl / tv)."""
    is_correction_enable: bool = False
    """OpenRLHF's switch (its train_ppo_ray, 0.11): the correction of --is_correction_type on, i.e.
    --is_correction_level / --is_correction_mode set from the type (give one spelling or the other)."""
    is_correction_type: ISType | None = None
    """OpenRLHF's scheme, with --is_correction_enable: tis (token, clip; its default) | icepop (token,
    mask) | seq-mask-tis (seq, mask), gating ratio."""

    def __post_init__(self) -> None:
        if self.is_correction_type is not None and not self.is_correction_enable:
            raise ConfigError(f"--is_correction_type {self.is_correction_type} does nothing without "
                              "--is_correction_enable (OpenRLHF's pair); add it, or use --is_correction_level / --is_correction_mode")
        if self.is_correction_enable:
            if self.is_correction_level != "off":
                raise ConfigError(f"--is_correction_enable with --is_correction_level {self.is_correction_level}: "
                                  "two spellings of one setting; give --is_correction_type or --is_correction_level / mode")
            level, mode = IS_TYPES[self.is_correction_type or "tis"]
            object.__setattr__(self, "is_correction_level", level)
            object.__setattr__(self, "is_correction_mode", mode)
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"--gamma must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lambd <= 1:
            raise ConfigError(f"--lambd must be in [0, 1], got {self.lambd}")
        if len(self.is_correction_threshold) not in (1, 2):
            raise ConfigError(f"--is_correction_threshold takes HIGH or LOW HIGH, got {list(self.is_correction_threshold)}")
        low, high = self.is_band
        if not 0 <= low < high:
            raise ConfigError(f"--is_correction_threshold must be 0 <= low < high, got {low} {high}")
        if self.is_correction_mode == "clip" and (self.is_correction_level == "seq" or self.is_correction_gating != "ratio"):
            raise ConfigError("--is_correction_mode clip clamps token ratios: it needs --is_correction_level token and "
                              f"--is_correction_gating ratio, got {self.is_correction_level} and {self.is_correction_gating}")
        if self.is_correction_gating != "ratio" and self.is_correction_level != "off" and low > 0:
            raise ConfigError(f"--is_correction_gating {self.is_correction_gating} bounds a divergence from above: give "
                              f"--is_correction_threshold one HIGH value (a trust-region delta), got {low} {high}")

    @property
    def is_band(self) -> tuple[float, float]:
        """(low, high) of the correction's band: a single threshold is (0, high)."""
        t = self.is_correction_threshold
        return (0.0, t[0]) if len(t) == 1 else (t[0], t[-1])

    @property
    def is_correction_on(self) -> bool:
        """Whether the IS correction is active (``--is_correction_level`` other than off)."""
        return self.is_correction_level != "off"


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
    unbiased_gradient: bool = False
    """With use_loss: keep the estimator's value but back-propagate the reverse KL's gradient, importance-
    weighted by pi / pi_old (capped at 10) for the off-policy epochs; k1/k2/k3 then share one gradient."""

    def __post_init__(self) -> None:
        if not self.init_coef >= 0:
            raise ConfigError(f"--init_coef must be >= 0, got {self.init_coef}")
        if self.target is not None and not self.target > 0:
            raise ConfigError(f"--target must be > 0 (or None), got {self.target}")
        if self.horizon < 1:
            raise ConfigError(f"--horizon must be >= 1, got {self.horizon}")
        if self.use_loss and self.init_coef == 0:
            raise ConfigError("--use_loss with --init_coef 0 adds nothing: set a coefficient or drop --use_loss")
        if self.unbiased_gradient and not self.use_loss:
            raise ConfigError("--unbiased_gradient shapes the KL loss's gradient: it needs --use_loss (a KL in the "
                              "reward carries no gradient)")


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
