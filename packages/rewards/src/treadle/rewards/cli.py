"""``treadle-rewards``: the reward daemon's command line.

    treadle-rewards serve --functions math format --weights 1.0 0.1 --http.port 5000
    treadle-rewards serve --rm.path ./ckpt/rm --zmq.endpoint tcp://127.0.0.1:5555
    treadle-rewards serve --help
    treadle-rewards serve --reward.model_name_or_path ./rm --port 5000 --ds.param_dtype bf16 \
        --ds.attn_implementation sdpa --reward.normalize_enable --data.max_len 8192 --batch_size 16

(the last one in OpenRLHF's ``serve_rm`` spelling). ``main()`` refuses the ``serve_rm`` flags
treadle does not implement, parses the rest into a ``ServeConfig``, starts a ``RewardDaemon``,
serves until SIGINT / SIGTERM, and closes it (``treadle.common.serve_cli``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from treadle.common.config import ConfigError
from treadle.common.serve_cli import serve_main, until_signal
from treadle.rewards.config import ServeConfig, refuse_openrlhf_flags
from treadle.rewards.daemon import RewardDaemon


async def serve(cfg: ServeConfig) -> None:
    """Run the daemon until SIGINT or SIGTERM."""
    daemon = RewardDaemon(cfg)

    async def start() -> str:
        addrs = await daemon.start()
        return f"treadle-rewards: serving zmq={addrs.zmq} http={addrs.http}"

    await until_signal(start, daemon.close)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        refuse_openrlhf_flags(args)
    except ConfigError as e:
        print(f"treadle-rewards serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    serve_main(args, tool="treadle-rewards", what="the reward daemon", config=ServeConfig, serve=serve)


if __name__ == "__main__":
    main()
