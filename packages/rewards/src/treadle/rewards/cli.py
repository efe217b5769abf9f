"""``treadle-rewards``: the reward daemon's command line.

    treadle-rewards serve --functions math format --weights 1.0 0.1 --http.port 5000
    treadle-rewards serve --rm.path ./ckpt/rm --zmq.endpoint tcp://127.0.0.1:5555
    treadle-rewards serve --help

``main()`` parses the flags into a ``ServeConfig`` (``treadle.common.config.parse``), starts a
``RewardDaemon``, serves until SIGINT/SIGTERM, and closes it in ``finally``.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

from treadle.common.config import ConfigError, parse
from treadle.common.log import get_logger, setup_logging
from treadle.rewards.config import ServeConfig
from treadle.rewards.daemon import RewardDaemon

USAGE = "usage: treadle-rewards serve [--help] [FLAGS]   (the reward daemon; see `serve --help`)"


async def serve(cfg: ServeConfig) -> None:
    """Run the daemon until SIGINT or SIGTERM."""
    daemon = RewardDaemon(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        addrs = await daemon.start()
        print(f"treadle-rewards: serving zmq={addrs.zmq} http={addrs.http}", flush=True)
        await stop.wait()
    finally:
        await daemon.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if args else 2)
    if args[0] != "serve":
        print(f"treadle-rewards: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    setup_logging()
    try:
        cfg = parse(ServeConfig, args[1:], prog="treadle-rewards serve")
    except ConfigError as e:
        print(f"treadle-rewards serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        get_logger(__name__).error("treadle-rewards serve failed: %s", e, exc_info=e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
