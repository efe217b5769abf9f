"""``treadle-agents``: serve the OpenAI-compatible agent gateway.

    treadle-agents serve --model DIR --rollout tcp://127.0.0.1:5570 --port 8000
    treadle-agents serve --model DIR --host 0.0.0.0 --token_file /run/secrets/agents_token
    treadle-agents serve --help

``main()`` parses the flags into a ``GatewayConfig``, starts the gateway, prints
``treadle-agents: serving <url>`` once it listens, serves until SIGINT / SIGTERM, and closes it
(``treadle.common.serve_cli``).
"""

from __future__ import annotations

from collections.abc import Sequence

from treadle.agents.gateway.config import GatewayConfig
from treadle.common.serve_cli import serve_main, until_signal


async def serve(cfg: GatewayConfig) -> None:
    """Run the gateway until SIGINT or SIGTERM."""
    from treadle.agents.gateway.server import Gateway  # noqa: PLC0415  (loads the tokenizer)

    gateway = Gateway(cfg)

    async def start() -> str:
        url = await gateway.start()
        return f"treadle-agents: serving {url} (model {gateway.model_name}, rollout {cfg.rollout})"

    await until_signal(start, gateway.close)


def main(argv: Sequence[str] | None = None) -> None:
    # an unreadable token file fails at parse time, before anything starts
    serve_main(argv, tool="treadle-agents", what="the OpenAI-compatible agent gateway", config=GatewayConfig,
               serve=serve, check=GatewayConfig.bearer_token)


if __name__ == "__main__":
    main()
