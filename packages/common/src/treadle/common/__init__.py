"""treadle.common: Wire protocol (msgpack + out-of-band buffers), ZeroMQ RPC, typed config and CLI base, env knobs, metrics."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("treadle-common")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"
