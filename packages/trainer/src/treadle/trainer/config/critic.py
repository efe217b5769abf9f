"""Config of ``treadle-train critic``: a PPO run's critic trained apart, served to its trainer.

The server's own flags say only where it listens; everything about the critic (its model,
optimizer, batching, DeepSpeed settings) comes from the trainer's resolved flags when the
trainer connects (``records.CriticSetup``), so one command line decides both.
"""

from __future__ import annotations

from treadle.common.config import ConfigError, configclass

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5590"


@configclass
class CriticServeConfig:
    """Serve a PPO run's critic on this group of ranks (one process, or torchrun's ranks): the
    trainer, given --critic.remote_url ENDPOINT, asks it for values and trains it on the returns."""

    endpoint: str = DEFAULT_ENDPOINT
    """Where rank 0 listens (tcp://HOST:PORT); a non-loopback address needs --curve_dir."""
    curve_dir: str = ""
    """CURVE server keys (``treadle-keys generate DIR``) for an endpoint off loopback."""
    ranks: int | None = None
    """Ranks to start on this host (one per GPU; gloo processes on CPU); None: torchrun's world when
    started by it, else 1. Under torchrun a number given must be its world. SIGTERM stops them all
    with status 0 (a server stopped on request)."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); torchrun uses LOCAL_RANK instead."""

    def __post_init__(self) -> None:
        from treadle.common.rpc.transport import is_loopback  # noqa: PLC0415

        if self.ranks is not None and self.ranks < 1:
            raise ConfigError(f"--ranks must be >= 1, got {self.ranks}")
        if not self.endpoint.startswith("tcp://") or ":" not in self.endpoint.removeprefix("tcp://"):
            raise ConfigError(f"--endpoint {self.endpoint}: the critic server's ZeroMQ address, tcp://HOST:PORT")
        host = self.endpoint.removeprefix("tcp://").rpartition(":")[0]
        if not is_loopback(host) and not self.curve_dir:
            raise ConfigError(f"refusing to bind {self.endpoint} without --curve_dir: anyone who can reach it could "
                              "drive the critic; make keys with treadle-keys generate DIR, or bind 127.0.0.1")
