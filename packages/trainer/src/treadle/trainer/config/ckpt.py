"""Checkpointing (the ``ckpt`` group): where final models and resumable checkpoints go, and when.

Writing and reading checkpoints is the trainer's checkpoint module's job.
"""

from __future__ import annotations

from treadle.common.config import ConfigError, configclass


@configclass
class CheckpointConfig:
    """Final model output and resumable training checkpoints."""

    output_dir: str = "./ckpt"
    """Where the final model (HF format) is saved."""
    path: str = "./ckpt/checkpoints"
    """Folder of resumable checkpoints."""
    save_steps: int = -1
    """Save a checkpoint every this many steps; -1: only at the end."""
    save_hf: bool = False
    """Also save HF-format weights with each checkpoint."""
    disable_ds: bool = False
    """Skip the DeepSpeed (optimizer) state in checkpoints."""
    max_num: int = 3
    """Keep at most this many checkpoints (oldest deleted first)."""
    max_mem: float = float("inf")
    """Keep checkpoints under this many GB in total."""
    load_enable: bool = False
    """Resume from the newest checkpoint in path when there is one."""
    best_metric_key: str = ""
    """Eval metric that picks the best checkpoint; empty: the first pass@1 / loss metric; 'none': off.
    PPO: eval/pass@1, eval/pass@N (N = --eval.n_samples_per_prompt), eval/reward_mean, or
    OpenRLHF's eval_default_pass1 / eval_default_passN; any other is refused."""

    def __post_init__(self) -> None:
        if self.save_steps != -1 and self.save_steps < 1:
            raise ConfigError(f"--save_steps must be -1 (end only) or >= 1, got {self.save_steps}")
        if self.max_num < 1:
            raise ConfigError(f"--max_num must be >= 1, got {self.max_num}")
        if not self.max_mem > 0:
            raise ConfigError(f"--max_mem must be > 0 GB, got {self.max_mem}")
        if not self.output_dir or not self.path:
            raise ConfigError("--output_dir and --path must not be empty")
