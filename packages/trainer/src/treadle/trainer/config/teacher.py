"""The frozen teacher of the distillation recipes (the ``teacher`` group).

``TeacherModelConfig`` is what every teacher has: its weights and where they wait between uses.
Each recipe adds the weight of its distillation signal:

- ``treadle-train kd`` (``config.kd.TeacherConfig``): ``--teacher.kd_coef``, the mix of NLL and KD;
- ``treadle-train ppo`` (``OnPolicyTeacherConfig``): ``--teacher.kl_coef``, the weight of the
  per-token reverse KL to the teacher in the advantages (on-policy distillation, ``rl.distill``).

The teacher is placed like the reference (``trainers.build.reference``): sharded by ZeRO-3 under
``--ds.zero_stage 3``, else a replica on every trainer rank.
"""

from __future__ import annotations

import math

from treadle.common.config import ConfigError, configclass


@configclass
class TeacherModelConfig:
    """A frozen teacher model."""

    model_name_or_path: str | None = None
    """Teacher weights, HF name or local path; its token ids must mean the student's (checked before weights load)."""
    offload: bool = False
    """Keep the teacher in CPU memory: its ZeRO-3 parameter shards under --ds.zero_stage 3, else the whole replica between uses."""


@configclass
class OnPolicyTeacherConfig(TeacherModelConfig):
    """On-policy distillation in PPO: the teacher scores the student's sampled tokens (None: off)."""

    kl_coef: float = 1.0
    """beta_T: each sampled token's advantage gets -beta_T (log pi_student - log pi_teacher) added, after the
    estimator (Thinking Machines' kl_penalty_coef, verl's distillation_loss_coef; both default 1)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ConfigError(f"--kl_coef must be >= 0, got {self.kl_coef}")
        if self.model_name_or_path is None:
            if self.offload:
                raise ConfigError("--offload keeps a teacher in CPU memory: it needs --model_name_or_path")
            return
        if not self.model_name_or_path:
            raise ConfigError("--model_name_or_path is empty: give the teacher's weights (HF name or local path)")
        if self.kl_coef == 0:
            raise ConfigError("--kl_coef 0 with --model_name_or_path adds nothing: the teacher's log-probs "
                              "would be computed and ignored; set a coefficient or drop the teacher")
