"""Metric logging (the ``logger`` group): step interval, Weights & Biases, TensorBoard.

The API key is a secret field: ``dump_yaml`` writes it as null. The loggers themselves live in
``treadle.common``'s metrics helpers.
"""

from __future__ import annotations

from treadle.common.config import ConfigError, configclass, secret


@configclass
class WandbConfig:
    """Weights & Biases; logging is on when key is set."""

    key: str | None = secret()
    """API key; None: W&B off."""
    org: str | None = None
    """Entity (team) to log under."""
    group: str | None = None
    """Run group."""
    project: str = "treadle"
    """Project name."""
    run_name: str | None = None
    """Run name; None: <recipe>_<MMDDTHH:MM> at start."""


@configclass
class LoggerConfig:
    """Where and how often metrics go."""

    logging_steps: int = 1
    """Log every this many steps."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases."""
    tensorboard_dir: str | None = None
    """TensorBoard log folder; None: off."""

    def __post_init__(self) -> None:
        if self.logging_steps < 1:
            raise ConfigError(f"--logging_steps must be >= 1, got {self.logging_steps}")
