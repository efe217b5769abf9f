"""``treadle-rollout``: serve the engine pool, scale it, or print its status.

    treadle-rollout serve --model DIR --engines 2 --backend vllm --tensor_parallel_size 1
    treadle-rollout scale --endpoint tcp://127.0.0.1:5570 --engines 4
    treadle-rollout status --endpoint tcp://127.0.0.1:5570 [--json]
    treadle-rollout serve --help

``main()`` parses the flags into the typed configs of ``treadle.rollout.config`` (dashes and
underscores both work: ``--tensor-parallel-size``), runs, and cleans up in ``finally``; ``serve``
runs until SIGINT / SIGTERM and prints ``treadle-rollout: serving <endpoint>`` once every
engine is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from treadle.common.config import ConfigError, parse
from treadle.common.log import get_logger, setup_logging
from treadle.rollout.config import ScaleConfig, ServeConfig, StatusConfig

USAGE = ("usage: treadle-rollout {serve,scale,status} [--help] [FLAGS]\n"
         "  serve   N engines behind one ZeroMQ front end\n"
         "  scale   add or remove engines of a running daemon\n"
         "  status  print a running daemon's health and per-engine stats")
COMMANDS: dict[str, type] = {"serve": ServeConfig, "scale": ScaleConfig, "status": StatusConfig}


async def serve(cfg: ServeConfig) -> None:
    """Run the daemon until SIGINT or SIGTERM."""
    from treadle.rollout.server import RolloutServer

    server = RolloutServer(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_watch_pid(cfg.exit_with_pid, stop)) if cfg.exit_with_pid else None
    try:
        endpoint = await server.start()
        metrics = f" metrics=http://{server.metrics_address[0]}:{server.metrics_address[1]}/metrics" \
            if server.metrics_address else ""
        print(f"treadle-rollout: serving {endpoint} ({cfg.engines} {cfg.backend} engines){metrics}", flush=True)
        await stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
        await server.close()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux's /proc state; elsewhere existence only)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"
    return True


async def _watch_pid(pid: int, stop: asyncio.Event, poll_s: float = 1.0) -> None:
    """Set ``stop`` once process ``pid`` no longer exists (``--exit_with_pid``)."""
    while not stop.is_set():
        if not pid_alive(pid):
            print(f"treadle-rollout: process {pid} (--exit_with_pid) is gone; shutting down", flush=True)
            stop.set()
            return
        await asyncio.sleep(poll_s)


def _client(endpoint: str, curve_dir: str, timeout_s: float) -> Any:
    from treadle.common.rpc import load_client_keys
    from treadle.rollout.client import RolloutClient

    curve = load_client_keys(curve_dir) if curve_dir else None
    return RolloutClient(endpoint, curve=curve, timeout_s=timeout_s)


async def scale(cfg: ScaleConfig) -> dict[str, Any]:
    async with _client(cfg.endpoint, cfg.curve_dir, cfg.timeout_s) as rc:
        return await rc.scale(cfg.engines, timeout=cfg.timeout_s)


async def status(cfg: StatusConfig) -> dict[str, Any]:
    async with _client(cfg.endpoint, cfg.curve_dir, cfg.timeout_s) as rc:
        return {"health": await rc.health(), "stats": await rc.stats()}


def format_status(s: dict[str, Any]) -> str:
    """A human-readable table of ``status``'s answer."""
    h, st = s["health"], s["stats"]
    lines = [f"status {h['status']}  weight version {st['version']}  engines ready {st['engines_ready']}/"
             f"{len(st['engines'])}  in flight {st['in_flight']}  queue {st['queue_depth']}  "
             f"tokens/s {st['tokens_per_s']:.1f}  failovers {st['failovers']}  restarts {st['restarts']}",
             f"{'engine':<8}{'state':<13}{'pid':>8}{'version':>9}{'load':>7}{'running':>9}{'tok/s':>9}"
             f"{'  node':<15}  reason"]
    for e in st["engines"]:
        node = e.get("node", "")  # "local", or the Ray node id (--engine_placement ray), cut to 12
        lines.append(f"{e['engine_id']:<8}{e['state']:<13}{e['pid']:>8}{e['version']:>9}{e['load']:>7}"
                     f"{e['running']:>9}{e['tokens_per_s']:>9.1f}  {node[:12]:<13}  {e['reason']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if args else 2)
    command = args[0]
    if command not in COMMANDS:
        print(f"treadle-rollout: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    setup_logging()
    try:
        cfg = parse(COMMANDS[command], args[1:], prog=f"treadle-rollout {command}")
    except ConfigError as e:
        print(f"treadle-rollout {command}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        if command == "serve":
            asyncio.run(serve(cfg))
        elif command == "scale":
            print(json.dumps(asyncio.run(scale(cfg))))
        else:
            out = asyncio.run(status(cfg))
            print(json.dumps(out, indent=1) if cfg.json else format_status(out))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        get_logger(__name__).error("treadle-rollout %s failed: %s", command, e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
