"""treadle.rollout: Engine pool daemon (vLLM / HF backends) served over ZeroMQ, and its client."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("treadle-rollout")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"
