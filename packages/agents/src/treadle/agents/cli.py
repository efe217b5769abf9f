"""``treadle-agents``: serve the OpenAI-compatible agent gateway.

    treadle-agents serve --model DIR --rollout tcp://127.0.0.1:5570 --port 8000
    treadle-agents serve --model DIR --host 0.0.0.0 --token_file /run/secrets/agents_token
    treadle-agents serve --help

``main()`` parses the flags into a ``GatewayConfig`` (``treadle.common.config.parse``), starts the
gateway, prints ``treadle-agents: serving <url>`` once it listens, serves until SIGINT /
SIGTERM, and closes it in ``finally``.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

from treadle.agents.gateway.config import GatewayConfig
from treadle.common.config import ConfigError, parse
from treadle.common.log import get_logger, setup_logging

USAGE = "usage: treadle-agents serve [--help] [FLAGS]   (the OpenAI-compatible agent gateway; see `serve --help`)"


async def serve(cfg: GatewayConfig) -> None:
    """Run the gateway until SIGINT or SIGTERM."""
    from treadle.agents.gateway.server import Gateway  # noqa: PLC0415  (loads the tokenizer)

    gateway = Gateway(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await gateway.start()
        print(f"treadle-agents: serving {url} (model {gateway.model_name}, rollout {cfg.rollout})", flush=True)
        await stop.wait()
    finally:
        await gateway.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if args else 2)
    if args[0] != "serve":
        print(f"treadle-agents: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    setup_logging()
    try:
        cfg = parse(GatewayConfig, args[1:], prog="treadle-agents serve")
        cfg.bearer_token()  # an unreadable token file fails here, before anything starts
    except ConfigError as e:
        print(f"treadle-agents serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        get_logger(__name__).error("treadle-agents serve failed: %s", e, exc_info=e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
