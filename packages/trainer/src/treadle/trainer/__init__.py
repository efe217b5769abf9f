"""treadle.trainer: DeepSpeed strategy, models, losses, trainers (SFT/RM/DPO/KTO/PPO-family), ring attention, checkpoints, weight sender."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("treadle-trainer")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"
