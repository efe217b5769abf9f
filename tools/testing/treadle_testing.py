"""Helpers the test suites share (packages/*/tests, integration/tests, tools/tests).

On pytest's ``pythonpath`` (tools/testing, set in the root pyproject.toml), so any test or
conftest imports it: ``from treadle_testing import Loop, critic_server, free_port, load_by_path, load_tool,
rollout_daemon``.
With ``--import-mode=importlib`` a test cannot import its conftest, and tools/ is not a
package: before this module each suite carried its own copy of these.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def load_by_path(name: str, path: Path) -> ModuleType:
    """The module in file ``path``, registered as ``name`` and loaded once per process."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path} as a module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: dataclasses look their module up by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py (``tiny_model``, ...) as the module ``name``."""
    return load_by_path(name, TOOLS / f"{name}.py")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rollout_daemon(model: Path, env: dict[str, str], *flags: str) -> Iterator[str]:
    """A one-engine ``treadle-rollout serve`` of ``model`` with ``flags`` (``--backend hf``, ...)
    in its own session, ready; its endpoint. SIGTERM on exit, SIGKILL of its group after 30 s."""
    from treadle.rollout.client import SyncRolloutClient

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "treadle.rollout", "serve", "--model", str(model), "--engines", "1",
                             "--endpoint", endpoint, "--no_cpu_bind", *flags],
                            env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        with SyncRolloutClient(endpoint) as rc:
            rc.wait_ready(timeout=300)
        yield endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def critic_server(env: dict[str, str], cwd: Path, ranks: int = 1) -> Iterator[str]:
    """``treadle-train critic --ranks RANKS`` (gloo ranks on CPU) on a free loopback port in its own
    session; its endpoint (its clients wait for it to answer). On exit it must still be serving;
    then SIGTERM, which stops it with status 0 (SIGKILL of its group after 30 s)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "treadle.trainer.cli", "critic", "--endpoint", endpoint,
                             "--ranks", str(ranks)], env=env, cwd=cwd, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        yield endpoint
        assert proc.poll() is None, f"the critic server exited with {proc.returncode}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            assert proc.wait(30) == 0, f"the critic server stopped with {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Loop:
    """One event loop for a test session, run on the main thread, one coroutine at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def __call__(self, coro: Any, timeout: float = 120.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
