"""A pool of worker processes running one reward function, with per-call timeouts (asyncio).

``FunctionPool(spec, size=N, timeout_s=T)``: ``await start()`` spawns N ``worker_main``
processes (each in its own session) and waits until each has loaded the function;
``await score(batch)`` runs the batch on an idle worker and returns a ``RewardOutput``. It
never raises for the function's misbehaviour:

- the function raises: the worker fails those samples (per sample when isolating);
- the call takes longer than ``timeout_s``, or the worker dies (a segfault, the memory limit):
  the worker's process group is killed, every sample of the batch is failed with the reason,
  and a fresh worker is started in the background.

A pool whose replacement workers keep failing to start (the file broke on disk, say) fails
calls at once with the start error rather than queueing them forever.

Not here: batching requests together (``batching``), the worker side (``worker_main``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import struct
import sys
from pathlib import Path
from typing import Any

import msgspec

from treadle.common import env
from treadle.common.log import get_logger
from treadle.rewards.api import RewardBatch, RewardOutput
from treadle.rewards.loader import FunctionSpec

log = get_logger(__name__)
_LEN = struct.Struct(">I")
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class WorkerDied(RuntimeError):
    """The worker process ended or broke the protocol."""


def _source_roots() -> list[str]:
    """Folders that make treadle importable in a child (src layouts; editable or not)."""
    import treadle.common  # noqa: PLC0415
    import treadle.rewards  # noqa: PLC0415

    roots = []
    for mod in (treadle.common, treadle.rewards):
        for p in mod.__path__ if hasattr(mod, "__path__") else [os.path.dirname(mod.__file__)]:
            roots.append(str(Path(p).resolve().parents[1]))
    return sorted(set(roots))


class WorkerProcess:
    """One ``worker_main`` child; one call at a time."""

    def __init__(self, spec: FunctionSpec, *, memory_mb: int, isolate: bool) -> None:
        self.spec = spec
        self._cfg = json.dumps({"spec": spec.to_json(), "memory_mb": memory_mb, "isolate": isolate})
        self.proc: asyncio.subprocess.Process | None = None
        self.provenance: dict[str, Any] = {}

    async def start(self, timeout_s: float) -> None:
        path = os.pathsep.join([*_source_roots(), *filter(None, [os.environ.get("PYTHONPATH", "")])])
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "treadle.rewards.worker_main", self._cfg,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None,
            start_new_session=True, env=env.child_env({"PYTHONPATH": path}))
        try:
            hello = await asyncio.wait_for(self._read(), timeout_s)
        except (asyncio.TimeoutError, WorkerDied) as e:
            await self.kill()
            raise WorkerDied(f"worker for {self.spec.source} did not start within {timeout_s} s: {e}") from None
        if not hello.get("ready"):
            await self.kill()
            raise WorkerDied(str(hello.get("error", "worker failed to start")))
        self.provenance = hello["provenance"]

    async def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            head = await self.proc.stdout.readexactly(_LEN.size)
            body = await self.proc.stdout.readexactly(_LEN.unpack(head)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            code = await self.proc.wait()
            raise WorkerDied(f"worker exited with status {code}") from None
        return _dec.decode(body)

    async def call(self, batch: RewardBatch) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        body = _enc.encode({"queries": batch.queries, "prompts": batch.prompts, "labels": batch.labels})
        try:
            self.proc.stdin.write(_LEN.pack(len(body)) + body)
            await self.proc.stdin.drain()
        except (ConnectionError, BrokenPipeError):
            raise WorkerDied(f"worker exited with status {await self.proc.wait()}") from None
        return await self._read()

    async def kill(self) -> None:
        """SIGKILL the worker's whole process group (a reward file's own children too), and first
        the sessions of the sandboxes it is running (``sandbox``: each run is a session of its
        own, which dies with its worker through parent-death signals; killing it here as well
        does not depend on them)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        for group in own_sessions(self.proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        """Close stdin (the worker exits by itself), kill it if it does not within 2 s."""
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(Exception):
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            await asyncio.wait_for(self.proc.wait(), 2.0)
        except asyncio.TimeoutError:
            await self.kill()


def own_sessions(parent: int) -> list[int]:
    """Children of ``parent`` that lead a process group of their own (Linux ``/proc``; [] where
    there is none): the sandbox runs a worker started."""
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)", which may hold spaces
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == parent and int(fields[2]) == int(entry.name):  # ppid, pgrp
                out.append(int(entry.name))
    return out


def _output(reply: dict[str, Any], n: int) -> RewardOutput:
    if not reply.get("ok"):
        return RewardOutput.failure(n, str(reply.get("error", "worker error")))
    return RewardOutput(rewards=reply["rewards"], scores=reply["scores"], extra_logs=reply["extra_logs"],
                        failed=reply["failed"], errors=reply["errors"])


class FunctionPool:
    """N workers for one function; ``score`` is safe to call from many tasks of one loop."""

    def __init__(self, spec: FunctionSpec, *, size: int = 2, timeout_s: float = 60.0, memory_mb: int = 0,
                 isolate: bool = True, start_timeout_s: float = 120.0, on_event: Any = None) -> None:
        if size < 1 or not timeout_s > 0:
            raise ValueError(f"size must be >= 1 and timeout_s > 0, got {size}, {timeout_s}")
        self.spec = spec
        self.size = size
        self.timeout_s = timeout_s
        self._memory_mb, self._isolate, self._start_timeout = memory_mb, isolate, start_timeout_s
        self._idle: asyncio.Queue[WorkerProcess] = asyncio.Queue()
        self._all: set[WorkerProcess] = set()
        self._restarts: set[asyncio.Task[None]] = set()
        self._broken: str | None = None
        self._broken_reason = ""
        self._closed = False
        self._on_event = on_event or (lambda kind: None)  # metrics hook: "timeout", "died", "restart"
        self.provenance: dict[str, Any] = {}

    async def start(self) -> None:
        """Start every worker; raises ``WorkerDied`` with the first start error."""
        workers = [self._new() for _ in range(self.size)]
        results = await asyncio.gather(*(w.start(self._start_timeout) for w in workers), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(w.kill() for w in workers))
            raise WorkerDied(f"{self.spec.name}: {errors[0]}") from errors[0]
        self.provenance = {**workers[0].provenance, "timeout_s": self.timeout_s, "workers": self.size,
                           "memory_mb": self._memory_mb}
        for w in workers:
            self._idle.put_nowait(w)

    def _new(self) -> WorkerProcess:
        w = WorkerProcess(self.spec, memory_mb=self._memory_mb, isolate=self._isolate)
        self._all.add(w)
        return w

    async def score(self, batch: RewardBatch) -> RewardOutput:
        """Score ``batch`` on one worker; failures come back as failed samples, never raised."""
        worker = await self._acquire()
        if worker is None:
            return RewardOutput.failure(len(batch), self._broken or "the pool is closed")
        healthy = False
        try:
            reply = await asyncio.wait_for(worker.call(batch), self.timeout_s)
            healthy = True
            return _output(reply, len(batch))
        except asyncio.TimeoutError:
            self._on_event("timeout")
            log.warning("reward function %s timed out after %.1f s on %d samples; killing its worker",
                        self.spec.name, self.timeout_s, len(batch))
            return RewardOutput.failure(len(batch), f"timed out after {self.timeout_s} s")
        except WorkerDied as e:
            self._on_event("died")
            log.error("reward function %s: worker died (%s)", self.spec.name, e)
            return RewardOutput.failure(len(batch), f"worker died: {e}")
        finally:  # also on cancellation: a worker with a call half-done is not reusable
            if healthy:
                self._idle.put_nowait(worker)
            else:
                self._replace(worker)

    async def _acquire(self) -> WorkerProcess | None:
        """An idle worker; None once the pool is broken or closed (checked twice a second)."""
        while self._broken is None and not self._closed:
            try:
                return await asyncio.wait_for(self._idle.get(), 0.5)
            except asyncio.TimeoutError:
                continue
        return None

    def _replace(self, worker: WorkerProcess) -> None:
        task = asyncio.get_running_loop().create_task(self._restart(worker))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, old: WorkerProcess) -> None:
        await old.kill()
        self._all.discard(old)
        delay = 0.5
        for _attempt in range(6):
            if self._closed:
                return
            w = self._new()
            try:
                await w.start(self._start_timeout)
            except WorkerDied as e:
                self._all.discard(w)
                log.error("reward function %s: restarting a worker failed: %s", self.spec.name, e)
                self._broken_reason = str(e)
                await asyncio.sleep(delay)
                delay *= 2
                continue
            self._on_event("restart")
            self._idle.put_nowait(w)
            return
        self._broken = f"{self.spec.name}: workers cannot be restarted: {self._broken_reason}"

    async def close(self) -> None:
        self._closed = True
        for t in list(self._restarts):
            t.cancel()
        await asyncio.gather(*(w.stop() for w in list(self._all)), return_exceptions=True)
        self._all.clear()
