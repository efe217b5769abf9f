"""``treadle-rewards``: the reward daemon's command line.

    treadle-rewards serve --functions math format --weights 1.0 0.1 --http.port 5000
    treadle-rewards serve --rm.path ./ckpt/rm --zmq.endpoint tcp://127.0.0.1:5555
    treadle-rewards serve --help

``main()`` parses the flags into a ``ServeConfig``, starts a ``RewardDaemon``, serves until
SIGINT / SIGTERM, and closes it (``treadle.common.serve_cli``).
"""

from __future__ import annotations

from collections.abc import Sequence

from treadle.common.serve_cli import serve_main, until_signal
from treadle.rewards.config import ServeConfig
from treadle.rewards.daemon import RewardDaemon


async def serve(cfg: ServeConfig) -> None:
    """Run the daemon until SIGINT or SIGTERM."""
    daemon = RewardDaemon(cfg)

    async def start() -> str:
        addrs = await daemon.start()
        return f"treadle-rewards: serving zmq={addrs.zmq} http={addrs.http}"

    await until_signal(start, daemon.close)


def main(argv: Sequence[str] | None = None) -> None:
    serve_main(argv, tool="treadle-rewards", what="the reward daemon", config=ServeConfig, serve=serve)


if __name__ == "__main__":
    main()
