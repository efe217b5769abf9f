"""The front end's handle on one engine process: spawn, wait until it answers, call it, kill it.

An ``EngineHandle`` owns one ``python -m treadle.rollout.worker`` process and one ``RpcClient``
to it. A ``Starter`` makes the process: ``LocalStarter`` a child of the daemon in its own process
group (so killing it takes vLLM's children too), ``ray_engines.RayStarter`` one under a Ray actor
on any node of a cluster. Calls race the
process's exit: a call or stream to a process that dies raises ``EngineDead`` at once instead
of waiting for a reply that will never come. The pool drives the state machine::

    starting -> catching_up -> ready <-> quarantined, behind (holds an older weight version)
                                 |  -> draining -> stopped      (scale down)
        any -> dead -> starting (restart)  or  -> stopped (too many restarts / pool closed)

What this module does not do: decide anything (routing, restarts, weights: ``pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol

from treadle.common.errors import EngineDead, RequestTimeout, TreadleError
from treadle.common.log import get_logger
from treadle.common.rpc import ClientCurve, RpcClient
from treadle.rollout.worker import WorkerSpec

log = get_logger(__name__)
State = Literal["starting", "catching_up", "ready", "behind", "quarantined", "draining", "dead", "stopped"]


class EngineProcess(Protocol):
    """A running worker, wherever it runs (``LocalProcess`` here, ``ray_engines.RayProcess``)."""

    pid: int
    node: str  # where it runs: "local" or the Ray node's id
    error: str  # why it died, beyond its exit status ("" when nothing more is known)

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int:
        """Its exit status, once it has exited."""

    def kill(self) -> None:
        """SIGKILL it and everything it started (also after it exited)."""


class Starter(Protocol):
    """Starts one engine slot's worker; ``EngineHandle.spawn`` calls it at every (re)start."""

    async def start(self, engine_id: str) -> tuple[EngineProcess, str, ClientCurve | None]:
        """A fresh worker: (its process, the endpoint it serves, the CURVE keys to call it with)."""

    async def close(self) -> None:
        """Release what the starter holds (placement groups); the worker is already stopped."""


class LocalProcess:
    """A worker process of this machine, in its own process group."""

    node = "local"
    error = ""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self.pid = proc.pid
        self._swept = False  # the process group was killed after the worker exited

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (vLLM's children included).

        Also after the worker itself died: its group outlives it while a child (vLLM's engine
        core) is still running, and such an orphan would hold memory and a core.
        """
        if self._swept:
            return
        # One sweep after the leader exited, right away: later its pid could name someone else.
        self._swept = self._proc.returncode is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


class LocalStarter:
    """``python -m treadle.rollout.worker`` as a child process, serving on ``spec.endpoint``."""

    def __init__(self, spec: WorkerSpec, env: dict[str, str]) -> None:
        self.spec = spec
        self._env = env

    async def start(self, engine_id: str) -> tuple[EngineProcess, str, ClientCurve | None]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "treadle.rollout.worker", self.spec.to_json(),
            env=self._env, stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        return LocalProcess(proc), self.spec.endpoint, None

    async def close(self) -> None:
        return None


class EngineHandle:
    """One engine worker as the front end sees it."""

    def __init__(self, *, slot: int, engine_id: str, starter: Starter, cpus: tuple[int, ...] = ()) -> None:
        self.slot = slot
        self.cpus = cpus  # the cores the engine computes on (local placement)
        self.engine_id = engine_id
        self.starter = starter
        self.state: State = "starting"
        self.reason = ""  # why quarantined / dead / stopped
        self.version = 0  # weight version the engine holds
        self.load = 0  # samples the front end sent and the engine has not returned
        self.restarts = 0
        self.base_rank = 0  # first weight-group rank of this engine's workers (0: not a member)
        self.stats: dict[str, Any] = {}  # the engine's last ``stats`` answer
        self.proc: EngineProcess | None = None
        self.client: RpcClient | None = None
        self.dead = asyncio.Event()
        self.parts: set[Any] = set()  # in-flight generate parts (``dispatch.Part``) on this engine
        self.started_at = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self.dead.is_set()

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {"engine_id": self.engine_id, "slot": self.slot, "state": self.state, "reason": self.reason,
                "pid": self.pid, "node": self.proc.node if self.proc is not None else "",
                "version": self.version, "load": self.load, "restarts": self.restarts,
                "cpus": list(self.cpus), "running": s.get("running", 0), "waiting": s.get("waiting", 0),
                "gated": s.get("gated", 0), "tokens_per_s": s.get("tokens_per_s", 0.0),
                "tokens_generated": s.get("tokens_generated", 0), "sleeping": s.get("sleeping", False)}

    # ------------------------------------------------------------------ process

    async def spawn(self) -> None:
        """Start a fresh worker (a restart reuses the handle)."""
        self.dead = asyncio.Event()
        # ``load`` is not reset: the parts of a dead incarnation give theirs back as they end.
        self.state, self.reason, self.version, self.base_rank = "starting", "", 0, 0
        self.stats = {}
        self.proc = None
        self.proc, endpoint, curve = await self.starter.start(self.engine_id)
        # The process's exit, not the socket's, says the engine died: failing calls on a dropped
        # connection (before the pool has seen the exit) would fail them over onto this same engine.
        self.client = RpcClient(endpoint, name=f"engine:{self.engine_id}", curve=curve, timeout_s=math.inf,
                                fail_on_disconnect=False)
        self.started_at = time.monotonic()
        log.info("engine %s: started process %d on %s (cores %s)", self.engine_id, self.proc.pid,
                 self.proc.node, list(self.cpus))

    async def wait_exit(self) -> int:
        """The process's exit status, once it has exited; marks the handle dead."""
        assert self.proc is not None
        code = await self.proc.wait()
        self.dead.set()
        return code

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the worker answers (its engine is loaded); raise if it exits or times out.

        One call: ZeroMQ queues it until the worker binds, and ``call`` fails it if the process exits.
        """
        try:
            reply = await self.call("stats", timeout=timeout_s)
        except EngineDead:
            raise EngineDead(f"engine {self.engine_id} exited with status {self.proc.returncode} while "
                             f"starting{self._why()} (its log is above)") from None
        except RequestTimeout:
            raise RequestTimeout(f"engine {self.engine_id} did not answer within {timeout_s:g} s of "
                                 "starting (raise --start_timeout_s)") from None
        self.stats = dict(reply.args)

    def kill(self) -> None:
        """SIGKILL the worker and everything it started (vLLM's children included)."""
        if self.proc is not None:
            self.proc.kill()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask the worker to close, wait ``grace_s``, then kill it; closes the RPC client."""
        if self.alive:
            with contextlib.suppress(TreadleError, asyncio.TimeoutError):
                await self.call("close", timeout=max(grace_s, 0.1))
            if self.proc is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(self.proc.wait()), grace_s)
                except asyncio.TimeoutError:
                    self.kill()
        self.kill()
        if self.proc is not None:
            await self.proc.wait()
        self.dead.set()
        if self.client is not None:
            await self.client.close()

    def _why(self) -> str:
        return f": {self.proc.error}" if self.proc is not None and self.proc.error else ""

    # ------------------------------------------------------------------ calls

    def _gone(self) -> EngineDead:
        code = self.proc.returncode if self.proc is not None else None
        return EngineDead(f"engine {self.engine_id} (pid {self.pid}) died (exit status {code}{self._why()})")

    async def call(self, method: str, msg: Any = None, *, timeout: float | None = None) -> Any:
        """One RPC to the worker; ``EngineDead`` as soon as the process is gone."""
        if self.dead.is_set() or self.client is None:
            raise self._gone()
        call = asyncio.ensure_future(self.client.call(method, msg, timeout=timeout or math.inf))
        call.add_done_callback(_retrieve)  # abandoned when the process dies: its error is moot
        died = asyncio.ensure_future(self.dead.wait())
        try:
            await asyncio.wait({call, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
            if not call.done():
                call.cancel()
        if call.cancelled() or not call.done():
            raise self._gone()
        return call.result()

    def stream(self, method: str, msg: Any) -> AsyncIterator[Any]:
        """A streamed RPC; the caller's task is cancelled by the pool if the process dies."""
        if self.dead.is_set() or self.client is None:
            raise self._gone()
        return self.client.stream(method, msg, timeout=math.inf)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark an abandoned call's outcome as seen (asyncio logs unseen task errors)."""
    if not task.cancelled():
        task.exception()
