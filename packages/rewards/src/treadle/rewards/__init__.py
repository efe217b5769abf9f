"""treadle.rewards: Reward functions, reward-model server, sandboxed code execution."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("treadle-rewards")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"
