"""Optimizer, learning-rate schedule and gradient clipping settings (OpenRLHF's vocabulary).

``OptimizerConfig`` holds the fields; SFT/RM configs inherit them at the top level
(``--adam.lr``, ``--lr_scheduler``, ``--max_norm``), PPO's actor and critic inherit them under
their own prefix (``--actor.adam.lr``, ``--critic.lr_warmup_ratio``). Building the optimizer
and scheduler is the trainer's job, not this module's.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from treadle.common.config import ConfigError, configclass

LRScheduler = Literal[
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr",
    "cosine_warmup_with_min_lr", "polynomial", "inverse_sqrt", "warmup_stable_decay",
]


@configclass
class AdamConfig:
    """AdamW hyper-parameters (also Muon's auxiliary AdamW group for non-matrix weights)."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """(beta1, beta2): decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """Denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"--betas must both be in [0, 1), got {list(self.betas)}")
        if not self.eps > 0:
            raise ConfigError(f"--eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"--weight_decay must be >= 0, got {self.weight_decay}")


@configclass
class MuonConfig:
    """Muon hyper-parameters for 2-D weight matrices (used when optim is muon)."""

    lr: float = 0.02
    """Learning rate of the Muon (matrix) parameter group."""
    momentum: float = 0.95
    """Momentum coefficient."""
    ns_steps: int = 5
    """Newton-Schulz orthogonalisation iterations."""
    nesterov: bool = True
    """Use Nesterov momentum (--muon.no_nesterov turns it off)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.ns_steps < 1:
            raise ConfigError(f"--ns_steps must be >= 1, got {self.ns_steps}")


_MUON_DEFAULTS = MuonConfig()


@configclass
class OptimizerConfig:
    """Optimizer + schedule + clipping of one trained model."""

    optim: Literal["adam", "muon"] = "adam"
    """Optimizer: AdamW. muon (Muon for matrices, AdamW for the rest) is not implemented yet and
    is refused here, before anything loads."""
    adam: AdamConfig = AdamConfig()
    """AdamW settings."""
    muon: MuonConfig = MuonConfig()
    """Muon settings: refused when changed from the defaults while Muon is not implemented."""
    lr_scheduler: LRScheduler = "cosine_with_min_lr"
    """Learning-rate schedule (HF transformers.get_scheduler names)."""
    lr_warmup_ratio: float = 0.03
    """Share of the total optimizer steps spent warming up linearly from 0."""
    min_lr_ratio: float = 0.1
    """Floor of decaying schedules, as a fraction of the peak learning rate."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def __post_init__(self) -> None:
        if self.optim == "muon":
            raise ConfigError("--optim muon is not implemented yet: use --optim adam (AdamW)")
        changed = [f"--muon.{f.name}" for f in dataclasses.fields(MuonConfig)
                   if getattr(self.muon, f.name) != getattr(_MUON_DEFAULTS, f.name)]
        if changed:
            raise ConfigError(f"{', '.join(changed)}: Muon's settings, and --optim muon is not implemented yet")
        if not 0 <= self.lr_warmup_ratio <= 1:
            raise ConfigError(f"--lr_warmup_ratio must be in [0, 1], got {self.lr_warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.max_norm >= 0:
            raise ConfigError(f"--max_norm must be >= 0 (0 disables clipping), got {self.max_norm}")
