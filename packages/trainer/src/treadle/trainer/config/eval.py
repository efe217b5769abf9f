"""Evaluation during training (the ``eval`` group): how often, on what, and for RL how sampled.

Running evaluations is the trainers' job.
"""

from __future__ import annotations

from treadle.common.config import ConfigError, configclass


@configclass
class EvalConfig:
    """Held-out evaluation."""

    steps: int = -1
    """Evaluate every this many steps; -1: once per epoch when dataset is set."""
    dataset: str | None = None
    """Evaluation dataset(s), comma-separated; None: no evaluation."""
    split: str = "train"
    """Split of the evaluation dataset."""

    def __post_init__(self) -> None:
        if self.steps != -1 and self.steps < 1:
            raise ConfigError(f"--steps must be -1 (per epoch) or >= 1, got {self.steps}")


@configclass
class RLEvalConfig(EvalConfig):
    """Held-out evaluation of a policy by sampling (pass@k and mean reward)."""

    temperature: float = 0.6
    """Sampling temperature of evaluation rollouts."""
    n_samples_per_prompt: int = 4
    """Samples per evaluation prompt (k of pass@k)."""

    def __post_init__(self) -> None:
        EvalConfig.__post_init__(self)
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.n_samples_per_prompt < 1:
            raise ConfigError(f"--n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
