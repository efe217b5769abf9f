"""Fixtures of the agents tests: a warm-started tiny model, one real rollout daemon, a gateway.

- ``model_dir``: tools/tiny_model.py's "tiny" model (seed 0), warm-started (``warm.py``) to
  answer the arithmetic environment's "Compute 2 + 3." with a calculator call and then
  ``<answer>5</answer>`` (greedy); any other prompt gets noise, as from a random model.
- ``daemon``: one ``python -m treadle.rollout serve --backend hf --engines 1`` subprocess on that
  model for the whole session (SIGTERM, then SIGKILL of its process group, at the end);
  ``start_daemon`` starts others (the slow vLLM test).
- ``aio``: one event loop for the session on the main thread; ``sampler`` is a
  ``RolloutSampler`` bound to it.
- ``gateway``: a ``Gateway`` (chatml_tools template) on its own loop thread, so blocking clients
  (the official ``openai`` client) can drive it from the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from treadle_testing import Loop, free_port, load_by_path, load_tool

ROOT = Path(__file__).resolve().parents[3]
SRC = [str(ROOT / "packages" / p / "src") for p in ("common", "rollout", "rewards", "agents")]
HERE = Path(__file__).resolve().parent


def _builder() -> Any:
    return load_tool("tiny_model")


@pytest.fixture(scope="session")
def warm() -> Any:
    """tests/warm.py: the warm start and the transcript the model learned."""
    return load_by_path("treadle_agents_tests_warm", HERE / "warm.py")


def child_env() -> dict[str, str]:
    """This process's environment with the treadle sources importable (editable install or not)."""
    from treadle.common.env import child_env as base

    env = base({"OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join([*SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture(scope="session")
def start_daemon() -> Any:
    """``with start_daemon(aio, model_dir, *flags) as endpoint:`` another rollout daemon."""
    return rollout_daemon


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for child processes that import treadle."""
    return child_env()


@pytest.fixture(scope="session")
def aio() -> Loop:
    loop = Loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, warm: Any) -> Path:
    from treadle.agents.chat import ChatFormat

    out = _builder().build("tiny", tmp_path_factory.mktemp("agents_model") / "tiny", seed=0).out
    loss = warm.warm_start(out, ChatFormat.load(out, "chatml_tools"))
    assert loss < 0.05, f"warm start did not converge (loss {loss})"
    return out


@pytest.fixture(scope="session")
def chat(model_dir: Path) -> Any:
    from treadle.agents.chat import ChatFormat

    return ChatFormat.load(model_dir, "chatml_tools")


@contextlib.contextmanager
def rollout_daemon(aio: Loop, model_dir: Path, *flags: str) -> Any:
    """A ``python -m treadle.rollout serve`` subprocess on ``model_dir``; yields its endpoint once ready."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "treadle.rollout", "serve", "--endpoint", endpoint,
                             "--model", str(model_dir), "--engines", "1", "--route_timeout_s", "60",
                             "--health_interval_s", "1", *flags],
                            start_new_session=True, stdin=subprocess.DEVNULL, env=child_env())

    async def ready() -> None:
        from treadle.rollout.client import RolloutClient

        async with RolloutClient(endpoint) as rc:
            await rc.wait_ready(240)

    try:
        aio(ready(), timeout=250)
        yield endpoint
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def daemon(aio: Loop, model_dir: Path) -> str:
    """Endpoint of a running one-engine hf rollout daemon on ``model_dir``."""
    # unpinned, one OpenMP thread (OMP_NUM_THREADS=1 in child_env): two pinned threads stall for
    # seconds whenever a neighbour takes one of the machine's two cores
    with rollout_daemon(aio, model_dir, "--backend", "hf", "--no_cpu_bind") as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def rollout(aio: Loop, daemon: str) -> Any:
    from treadle.rollout.client import RolloutClient

    rc = RolloutClient(daemon)
    yield rc
    aio(rc.close())


@pytest.fixture(scope="session")
def sampler(rollout: Any) -> Any:
    from treadle.agents.sampler import RolloutSampler

    return RolloutSampler(rollout)


class GatewayThread:
    """A started Gateway on a loop thread; ``run(coro)`` runs on that loop."""

    def __init__(self, cfg: Any) -> None:
        from treadle.agents.gateway.server import Gateway
        from treadle.common.rpc import LoopThread

        self.gateway = Gateway(cfg)
        self.lt = LoopThread(name="agents-gateway")
        self.url = self.lt.run(self.gateway.start(), timeout=60)

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return self.lt.run(coro, timeout=timeout)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.lt.run(self.gateway.close(), timeout=30)
        self.lt.stop()


@pytest.fixture(scope="session")
def start_gateway(daemon: str, model_dir: Path) -> Any:
    """start_gateway(**GatewayConfig fields) -> a running GatewayThread (stopped at session end)."""
    from treadle.agents.gateway.config import GatewayConfig

    started: list[GatewayThread] = []

    def start(**fields: Any) -> GatewayThread:
        fields = {"model": str(model_dir), "rollout": daemon, "port": 0, "chat_template": "chatml_tools", **fields}
        g = GatewayThread(GatewayConfig(**fields))
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()


@pytest.fixture(scope="session")
def gateway(start_gateway: Any) -> GatewayThread:
    return start_gateway()
