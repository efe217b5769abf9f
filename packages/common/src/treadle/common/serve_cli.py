"""The ``TOOL serve [FLAGS]`` command line shared by the daemons whose only command is ``serve``.

``serve_main`` parses the flags into the daemon's typed config (``treadle.common.config.parse``:
a bad flag exits 2 naming it, before anything starts), runs ``serve(cfg)`` under asyncio, and
maps its end to an exit code: 0 on SIGINT / SIGTERM (``until_signal``), 1 with the error logged
when serving failed. ``until_signal`` starts a service, prints its banner, waits for SIGINT or
SIGTERM, and closes it in ``finally``.

Not here: each daemon's config and service (``treadle-rewards``, ``treadle-agents``); the
rollout daemon, whose command line has several commands (``treadle.rollout.cli``).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from treadle.common.config import ConfigError, parse
from treadle.common.log import get_logger, setup_logging

T = TypeVar("T")


async def until_signal(start: Callable[[], Awaitable[str]], close: Callable[[], Awaitable[None]]) -> None:
    """``await start()`` (its result, a banner line, is printed), then wait for SIGINT or SIGTERM,
    then ``await close()`` whatever happened."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(await start(), flush=True)
        await stop.wait()
    finally:
        await close()


def serve_main(argv: Sequence[str] | None, *, tool: str, what: str, config: type[T],
               serve: Callable[[T], Awaitable[None]], check: Callable[[T], object] | None = None) -> None:
    """``TOOL serve FLAGS``: parse ``config`` (``check(cfg)`` may raise ConfigError too), run
    ``serve(cfg)``; exits 2 on a usage or config error, 1 when serving failed."""
    usage = f"usage: {tool} serve [--help] [FLAGS]   ({what}; see `serve --help`)"
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        raise SystemExit(0 if args else 2)
    if args[0] != "serve":
        print(f"{tool}: unknown command {args[0]!r}\n{usage}", file=sys.stderr)
        raise SystemExit(2)
    setup_logging()
    try:
        cfg = parse(config, args[1:], prog=f"{tool} serve")
        if check is not None:
            check(cfg)
    except ConfigError as e:
        print(f"{tool} serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        get_logger(tool).error("%s serve failed: %s", tool, e, exc_info=e)
        raise SystemExit(1) from None
