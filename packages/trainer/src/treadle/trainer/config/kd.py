"""``treadle-train kd``: offline knowledge distillation (``KDConfig``).

SFT's data, model and loop (``SFTConfig``'s groups), plus a frozen teacher whose next-token
distributions the student also learns (``losses.kd``): OpenRLHF's ``train_kd`` (``--teacher_model``,
``--teacher_offload``, ``--kd_coef``; those names are refused with their replacement, ``config.renamed``).
"""

from __future__ import annotations

from treadle.common.config import ConfigError, configclass
from treadle.trainer.config.ckpt import CheckpointConfig
from treadle.trainer.config.commands import _check_supervised
from treadle.trainer.config.data import SFTDataConfig
from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.config.eval import EvalConfig
from treadle.trainer.config.logger import LoggerConfig, WandbConfig
from treadle.trainer.config.model import ModelConfig
from treadle.trainer.config.optim import AdamConfig, OptimizerConfig
from treadle.trainer.config.teacher import TeacherModelConfig
from treadle.trainer.config.train import TrainConfig


@configclass
class TeacherConfig(TeacherModelConfig):
    """The frozen teacher of ``treadle-train kd`` (required) and the loss mix."""

    kd_coef: float = 0.4
    """c in L = (1 - c) * NLL + c * KD (OpenRLHF's --kd_coef and default); 1: the teacher's distributions alone."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.kd_coef <= 1.0:
            raise ConfigError(f"--teacher.kd_coef must be in [0, 1], got {self.kd_coef}")


@configclass
class KDConfig(OptimizerConfig):
    """Knowledge distillation: SFT's next-token loss mixed with the cross-entropy to a teacher's token distributions."""

    adam: AdamConfig = AdamConfig(lr=5e-6)
    """AdamW settings."""
    actor: ModelConfig = ModelConfig()
    """The student being trained."""
    teacher: TeacherConfig = TeacherConfig()
    """The frozen teacher and the loss mix."""
    data: SFTDataConfig = SFTDataConfig()
    """Training data (SFT's rows)."""
    train: TrainConfig = TrainConfig(micro_batch_size=8, max_epochs=2)
    """Loop shape."""
    ds: DeepSpeedConfig = DeepSpeedConfig()
    """DeepSpeed, precision, packing, LoRA (of the student)."""
    ckpt: CheckpointConfig = CheckpointConfig(path="./ckpt/checkpoints_kd")
    """Checkpoints."""
    logger: LoggerConfig = LoggerConfig(wandb=WandbConfig(project="treadle_kd"))
    """Metric logging."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); torchrun uses LOCAL_RANK instead."""

    def __post_init__(self) -> None:
        _check_supervised(self)
        if not self.teacher.model_name_or_path:
            raise ConfigError("--teacher.model_name_or_path is required")
        if self.data.output_key is None and not self.data.apply_chat_template:
            raise ConfigError("nothing to distil: set --data.output_key or --data.apply_chat_template (conversations)")
        if self.ds.ring_attn_size > 1:
            raise ConfigError(f"--ds.ring_attn_size {self.ds.ring_attn_size}: treadle-train kd needs every row's "
                              "full-vocabulary logits on one rank (no ring attention)")
        if self.ds.tensor_parallel_size > 1:
            raise ConfigError(f"--ds.tensor_parallel_size {self.ds.tensor_parallel_size}: treadle-train kd does not run AutoTP")
