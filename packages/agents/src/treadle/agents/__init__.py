"""treadle.agents: Single- and multi-turn agent executors, environments, OpenAI-compatible gateway."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("treadle-agents")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"
