"""Optimizer, learning-rate schedule and gradient clipping settings (OpenRLHF's vocabulary).

``OptimizerConfig`` holds the fields; SFT/RM configs inherit them at the top level
(``--adam.lr``, ``--lr_scheduler``, ``--max_norm``), PPO's actor and critic inherit them under
their own prefix (``--actor.adam.lr``, ``--critic.lr_warmup_ratio``). ``check_muon`` refuses
the DeepSpeed settings Muon cannot run with, at parse time. Building the optimizer and scheduler
is the trainer's job (``strategy.deepspeed``, ``strategy.muon``), not this module's.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from treadle.common.config import ConfigError, configclass
from treadle.trainer.config.deepspeed import DeepSpeedConfig

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
    """Muon hyper-parameters for hidden weight matrices (read when optim is muon).

    DeepSpeed 0.19's Muon (the implementation treadle uses) always runs 5 Newton-Schulz steps on
    Nesterov momentum: ``ns_steps`` and ``nesterov`` are OpenRLHF's flags and only those values
    are accepted (OpenRLHF warns and goes on; treadle refuses, so a flag never goes unread).
    """

    lr: float = 0.02
    """Learning rate of the Muon (matrix) parameter group (OpenRLHF's default; its README uses 1e-4 to fine-tune)."""
    momentum: float = 0.95
    """Momentum coefficient."""
    ns_steps: int = 5
    """Newton-Schulz orthogonalisation iterations: 5, the number DeepSpeed runs (other values are refused)."""
    nesterov: bool = True
    """Nesterov momentum, which DeepSpeed always uses (--muon.no_nesterov is refused)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.ns_steps != 5:
            raise ConfigError(f"--ns_steps {self.ns_steps}: DeepSpeed's Muon always runs 5 Newton-Schulz steps; "
                              "leave it at 5")
        if not self.nesterov:
            raise ConfigError("--nesterov False: DeepSpeed's Muon always uses Nesterov momentum; drop the flag")


_MUON_DEFAULTS = MuonConfig()


@configclass
class OptimizerConfig:
    """Optimizer + schedule + clipping of one trained model."""

    optim: Literal["adam", "muon"] = "adam"
    """Optimizer: adam (AdamW), or muon (DeepSpeed's Muon for hidden weight matrices, AdamW for
    embeddings, the LM / value head, norms and biases; ``check_muon`` lists what it cannot run with)."""
    adam: AdamConfig = AdamConfig()
    """AdamW settings (with muon: its AdamW group's; weight_decay is also the Muon group's)."""
    muon: MuonConfig = MuonConfig()
    """Muon settings: read with optim muon, refused when changed otherwise."""
    lr_scheduler: LRScheduler = "cosine_with_min_lr"
    """Learning-rate schedule (HF transformers.get_scheduler names)."""
    lr_warmup_ratio: float = 0.03
    """Share of the total optimizer steps spent warming up linearly from 0."""
    min_lr_ratio: float = 0.1
    """Floor of decaying schedules, as a fraction of the peak learning rate."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (muon under ZeRO needs 0: ``check_muon``)."""

    def __post_init__(self) -> None:
        changed = [f"--muon.{f.name}" for f in dataclasses.fields(MuonConfig)
                   if getattr(self.muon, f.name) != getattr(_MUON_DEFAULTS, f.name)]
        if changed and self.optim != "muon":
            raise ConfigError(f"{', '.join(changed)}: Muon's settings, read only with --optim muon "
                              f"(this run's --optim is {self.optim})")
        if not 0 <= self.lr_warmup_ratio <= 1:
            raise ConfigError(f"--lr_warmup_ratio must be in [0, 1], got {self.lr_warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.max_norm >= 0:
            raise ConfigError(f"--max_norm must be >= 0 (0 disables clipping), got {self.max_norm}")


def check_muon(optim: OptimizerConfig, ds: DeepSpeedConfig, prefix: str = "") -> None:
    """ConfigError for the DeepSpeed settings (the shared ``--ds.*``) DeepSpeed 0.19's Muon cannot
    train with; ``prefix`` qualifies the optimizer's flags (``actor.``). Nothing for AdamW.

    Runs (tried on CPU with the tiny model: SFT, RM, LoRA): ZeRO stages 0-3 in fp32; ZeRO-2 with
    ``--ds.adam_offload``, ZeRO-3 with it and ``--ds.param_offload``; bf16 at stages 0 and 2, and
    stage 1 with ``--ds.grad_accum_dtype fp32`` (DeepSpeed's BF16 optimizer). fp16, ring attention
    and MoE models are untried (DeepSpeed's code handles fp16's loss scale for Muon). Refused:

    - ``--max_norm`` > 0 with ZeRO stage 1-3: DeepSpeed takes the gradient norm after Newton-Schulz
      has replaced each matrix's gradient by its (orthogonal) update, so clipping scales the Muon
      updates by 1 / the summed norm of orthogonal matrices (about sqrt of the summed matrix ranks,
      hundreds for a 1B model), i.e. turns Muon off; OpenRLHF warns about this and goes on. Stage 0
      clips the raw gradients before the optimizer step, which Newton-Schulz is blind to.
    - ``--ds.tensor_parallel_size`` > 1: each rank would orthogonalize its shard of a matrix, not
      the matrix: another optimizer than Muon (and untried here).
    - ``--ds.deepcompile``: deepcompile's own ZeRO passes reduce the gradients and never run
      Newton-Schulz, so the step would be plain SGD on the matrices.
    - ``--ds.enable_sleep``: ZeRO-3's ``offload_states`` moves only DeepSpeed's FusedAdam.
    """
    if optim.optim != "muon":
        return
    head = f"--{prefix}optim muon"
    if optim.max_norm > 0 and ds.zero_stage > 0:
        raise ConfigError(f"{head} with --{prefix}max_norm {optim.max_norm} under --ds.zero_stage {ds.zero_stage}: "
                          "DeepSpeed clips after Newton-Schulz, so clipping would shrink Muon's updates, not the "
                          f"gradients; pass --{prefix}max_norm 0 (or --ds.zero_stage 0, which clips before)")
    if ds.tensor_parallel_size > 1:
        raise ConfigError(f"{head} with --ds.tensor_parallel_size {ds.tensor_parallel_size}: each rank would "
                          "orthogonalize only its shard of a matrix; use ZeRO (--ds.tensor_parallel_size 1)")
    if ds.deepcompile:
        raise ConfigError(f"{head} with --ds.deepcompile: deepcompile's ZeRO passes skip Muon's Newton-Schulz "
                          "step; drop --ds.deepcompile")
    if ds.enable_sleep:
        raise ConfigError(f"{head} with --ds.enable_sleep: ZeRO-3's offload_states moves only FusedAdam's states; "
                          "drop --ds.enable_sleep or use --optim adam")
