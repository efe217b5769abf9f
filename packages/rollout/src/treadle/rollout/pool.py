"""The engine pool: N engine processes, least-loaded routing, restarts, scaling.

``EnginePool(cfg)`` spawns one worker process per engine (``handle.EngineHandle``), pinned to
its own cores (``config.placement``), or with ``--engine_placement ray`` under a Ray actor on
any node of a cluster (``ray_engines``), and runs one lifecycle task per engine: start, wait until
it answers, bring it to the pool's weight version (``updates.WeightCoordinator.catch_up``),
serve, and when the process exits for any reason but a scale-down or shutdown, restart it
(up to ``--max_restarts``). Health checks every ``--health_interval_s`` refresh each engine's
stats; one that does not answer within ``--health_timeout_s`` is killed (and so restarted).

Routing (``pick``): only engines that are ``ready`` and hold the pool's current weight version
take work; among them the one with the fewest samples in flight. When none can, the request
waits up to ``--route_timeout_s`` for one (a restart, a catch-up), then fails ``NoEngine``.

What this module does not do: the failover of a request (``dispatch``), weight updates and the
weight group (``updates``), the wire (``server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from treadle.common import env
from treadle.common.errors import EngineDead, NoEngine, RequestTimeout, TreadleError
from treadle.common.log import get_logger
from treadle.rollout.config import ServeConfig, engine_fields, placement
from treadle.rollout.handle import EngineHandle, LocalStarter
from treadle.rollout.telemetry import PoolMetrics
from treadle.rollout.updates import WeightCoordinator
from treadle.rollout.worker import WorkerSpec

log = get_logger(__name__)
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # wait before the k-th consecutive restart
LIVE = ("catching_up", "ready", "quarantined", "behind")  # states of a running, loaded engine
LEAVING = ("draining", "stopped")  # being removed: no state change brings these back


class EnginePool:
    """The engines of one daemon; every method runs on the daemon's event loop."""

    def __init__(self, cfg: ServeConfig, metrics: PoolMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or PoolMetrics(None)
        self.handles: dict[str, EngineHandle] = {}
        self.version = 0  # weight version every routable engine holds
        self.sleeping = 0  # sleep level the pool was put in (0: awake)
        self.failovers = 0  # samples regenerated after an engine died
        self.weights = WeightCoordinator(self)
        self._ids = itertools.count()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._first_ready: dict[str, asyncio.Future[None]] = {}
        self._changed = asyncio.Event()
        self._scale_lock = asyncio.Lock()
        self._closing = False
        self._run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="treadle-rollout-")
        self._ray: Any = None  # ray_engines.RayEngines with --engine_placement ray
        self._cpus = list(cfg.cpus) or (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [])

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start ``cfg.engines`` engines and wait until every one is ready (raises if one fails)."""
        if self.cfg.engine_placement == "ray":
            from treadle.rollout.ray_engines import RayEngines  # noqa: PLC0415  (ray: only when asked)

            self._ray = await RayEngines.create(self.cfg.ray, self.cfg.ranks_per_engine, self.cfg.start_timeout_s,
                                                self._run_dir)
        await self._add(self.cfg.engines)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop every engine (in-flight requests fail) and leave any weight group."""
        self._closing = True
        await self.weights.close()
        await asyncio.gather(*(self._stop(h, grace_s) for h in list(self.handles.values())))
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await asyncio.gather(*(h.starter.close() for h in self.handles.values()), return_exceptions=True)
        if self._ray is not None:
            self._ray.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._run_dir):
                os.unlink(os.path.join(self._run_dir, name))
            if not self.cfg.run_dir:
                os.rmdir(self._run_dir)

    def _new_handle(self, slot: int, engines: int) -> EngineHandle:
        engine_id = f"e{next(self._ids)}"
        if self._ray is not None:  # Ray picks the node and the GPUs; threads per rank from --ray.*
            where = self.cfg.ray.placement()
            spec = WorkerSpec(backend=self.cfg.backend, engine=engine_fields(self.cfg, engine_id, where), endpoint="")
            return EngineHandle(slot=slot, engine_id=engine_id, starter=self._ray.starter(spec, slot))
        where = placement(slot, engines, self.cfg.ranks_per_engine, self._cpus, self.cfg.gpu_ids,
                          bind=self.cfg.cpu_bind)
        # hf computes in the worker process: pin the process. vLLM computes in its own workers,
        # whose OMP threads it binds itself (cpu_threads_bind); the worker process, which only
        # relays requests and results, stays free to run on any core, like any client of vLLM.
        spec = WorkerSpec(backend=self.cfg.backend, engine=engine_fields(self.cfg, engine_id, where),
                          endpoint=f"ipc://{self._run_dir}/{engine_id}.sock",
                          cpus=where.cpus if self.cfg.backend == "hf" else (), parent_pid=os.getpid())
        extra = {"OMP_NUM_THREADS": str(where.threads_per_rank)} if where.cpus else {}
        if where.gpus:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in where.gpus)
        return EngineHandle(slot=slot, engine_id=engine_id, starter=LocalStarter(spec, env.child_env(extra)),
                            cpus=where.cpus)

    async def _add(self, count: int) -> list[EngineHandle]:
        used = {h.slot for h in self.handles.values()}
        slots = list(itertools.islice((s for s in itertools.count() if s not in used), count))
        total = len(self.handles) + count
        new = [self._new_handle(slot, total) for slot in slots]
        loop = asyncio.get_running_loop()
        for h in new:
            self.handles[h.engine_id] = h
            self._first_ready[h.engine_id] = loop.create_future()
            self._tasks[h.engine_id] = loop.create_task(self._lifecycle(h), name=f"engine:{h.engine_id}")
        results = await asyncio.gather(*(self._first_ready[h.engine_id] for h in new), return_exceptions=True)
        failed = [(h, r) for h, r in zip(new, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(self._stop(h, 1.0) for h, _ in failed))
            raise failed[0][1]
        return new

    async def _lifecycle(self, h: EngineHandle) -> None:
        """Start ``h``; serve; restart it whenever its process exits unasked."""
        first = self._first_ready[h.engine_id]
        while True:
            health = exit_task = None
            try:
                await h.spawn()
                self._notify()
                exit_task = asyncio.create_task(h.wait_exit())
                await h.wait_ready(self.cfg.start_timeout_s)
                if h.state not in LEAVING:
                    self._set(h, "catching_up")
                await self.weights.catch_up(h)
                health = asyncio.create_task(self._health_loop(h))
                if not first.done():
                    first.set_result(None)
            except Exception as e:  # any failure to start: report it, never leave scale() waiting
                (log.info if self._closing else log.error)("engine %s failed to start: %s", h.engine_id, e)
                h.reason = str(e)
                h.kill()
                if not first.done():
                    first.set_exception(e)
            code = await exit_task if exit_task is not None else -1
            if health is not None:
                health.cancel()
            self._on_exit(h, code)
            if self._closing or h.state in ("draining", "stopped") or not first.done() or first.exception():
                self._set(h, "stopped")
                await h.starter.close()
                return
            h.restarts += 1
            self.metrics.restarts.inc()
            if h.restarts > self.cfg.max_restarts:
                h.reason = f"died {h.restarts} times (--max_restarts {self.cfg.max_restarts}): left down"
                self._set(h, "stopped")
                log.error("engine %s %s", h.engine_id, h.reason)
                await h.starter.close()
                return
            self._set(h, "dead")
            await asyncio.sleep(RESTART_BACKOFF_S[min(h.restarts, len(RESTART_BACKOFF_S)) - 1])

    def _on_exit(self, h: EngineHandle, code: int) -> None:
        """The process is gone: fail its in-flight parts over, drop it from the weight group."""
        if not self._closing and h.state not in ("draining", "stopped"):
            why = f" ({h.proc.error})" if h.proc is not None and h.proc.error else ""
            log.warning("engine %s (pid %d on %s) exited with status %s%s", h.engine_id, h.pid,
                        h.proc.node if h.proc is not None else "?", code, why)
            h.reason = f"process exited with status {code}{why}"
        h.kill()  # whatever the worker left behind in its process group
        for part in list(h.parts):
            part.died = True
            if part.task is not None:
                part.task.cancel()
        if h.client is not None:
            asyncio.get_running_loop().create_task(h.client.close())
        self.weights.membership_changed(f"engine {h.engine_id} left (exit status {code})")

    async def _health_loop(self, h: EngineHandle) -> None:
        while h.alive:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                h.stats = dict((await h.call("stats", timeout=self.cfg.health_timeout_s)).args)
            except RequestTimeout:
                log.error("engine %s did not answer a health check within %g s (--health_timeout_s): "
                          "killing it", h.engine_id, self.cfg.health_timeout_s)
                h.kill()
                return
            except TreadleError:
                return
            self._check_broken(h, h.stats.get("broken", ""))

    def _check_broken(self, h: EngineHandle, broken: str) -> None:
        """An engine that refuses work: quarantined (canary) or restarted (anything else)."""
        if not broken or h.state not in ("ready", "behind"):
            return
        if "canary" in broken:
            self.quarantine(h, broken)
        else:
            log.error("engine %s is broken (%s): restarting it", h.engine_id, broken)
            h.kill()

    async def _stop(self, h: EngineHandle, grace_s: float) -> None:
        if h.state != "stopped":
            self._set(h, "draining" if h.state != "starting" else "stopped")
        await h.stop(grace_s)

    # ------------------------------------------------------------------ state

    def _set(self, h: EngineHandle, state: str) -> None:
        h.state = state  # type: ignore[assignment]
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self.metrics.engines(self.handles.values(), self.version)

    def quarantine(self, h: EngineHandle, reason: str) -> None:
        if h.state in LEAVING:
            return
        h.reason = reason
        self._set(h, "quarantined")
        log.error("engine %s quarantined: %s", h.engine_id, reason)

    def mark_ready(self, h: EngineHandle, version: int) -> None:
        """``h`` holds ``version`` and passed its canary (if any): it may take work."""
        h.version = version
        if h.state in LEAVING:  # scaled down while it was catching up
            return
        h.reason = ""
        self._set(h, "ready" if version == self.version else "behind")

    def set_version(self, version: int) -> None:
        """The pool moved to ``version``: engines still behind stop taking work."""
        self.version = version
        for h in self.handles.values():
            if h.state == "ready" and h.version != version:
                h.state = "behind"
        self._notify()

    def live(self, states: Iterable[str] = LIVE) -> list[EngineHandle]:
        wanted = set(states)
        return [h for h in self.handles.values() if h.state in wanted and h.alive]

    # ------------------------------------------------------------------ routing (dispatch.Router)

    async def pick(self, n: int, min_version: int) -> EngineHandle:
        deadline = time.monotonic() + self.cfg.route_timeout_s
        while True:
            best = None
            for h in self.handles.values():
                if h.state == "ready" and h.version == self.version and h.version >= min_version \
                        and h.alive and (best is None or h.load < best.load):
                    best = h
            if best is not None:
                best.load += n
                return best
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoEngine(f"no engine can serve: waited {self.cfg.route_timeout_s:g} s (--route_timeout_s) "
                               f"for an engine at weight version >= {max(min_version, self.version)}; "
                               f"engines: {self._states()}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def engine_failed(self, handle: EngineHandle, exc: BaseException) -> None:
        if handle.state in ("ready", "behind") and handle.alive:
            log.error("engine %s reported itself dead (%s): restarting it", handle.engine_id, exc)
            handle.kill()

    def note_failover(self, samples: int) -> None:
        self.failovers += samples
        self.metrics.failovers.inc(samples)

    def _states(self) -> str:
        return ", ".join(f"{h.engine_id}={h.state}@v{h.version}" + (f" ({h.reason})" if h.reason else "")
                         for h in self.handles.values()) or "none"

    # ------------------------------------------------------------------ control

    async def fan_out(self, method: str, msg: Any = None, *, timeout: float | None = None,
                      states: Iterable[str] = LIVE) -> dict[str, Any]:
        """Call ``method`` on every live engine; engine id -> reply or the exception it raised."""
        targets = self.live(states)
        replies = await asyncio.gather(*(h.call(method, msg, timeout=timeout) for h in targets),
                                       return_exceptions=True)
        return {h.engine_id: r for h, r in zip(targets, replies, strict=True)}

    async def scale(self, engines: int) -> dict[str, Any]:
        """Add or remove engines until ``engines`` are up; newcomers are ready (at the pool's
        version) and removed ones drained when this returns."""
        if engines < 1:
            raise ValueError(f"a pool needs >= 1 engine, got {engines}")
        if self.cfg.ray.colocate and engines > len(self.cfg.ray.colocate):
            raise ValueError(f"--ray.colocate places {len(self.cfg.ray.colocate)} engines beside the trainer's ranks: "
                             f"a colocated pool does not scale to {engines}")
        async with self._scale_lock:
            up = [h for h in self.handles.values() if h.state not in ("stopped", "draining")]
            added, removed = [], []
            try:
                if engines > len(up):
                    added = [h.engine_id for h in await self._add(engines - len(up))]
                elif engines < len(up):
                    going = sorted(up, key=lambda h: (h.state == "ready", -h.slot))[:len(up) - engines]
                    removed = [h.engine_id for h in going]
                    await asyncio.gather(*(self._remove(h) for h in going))
            finally:
                self._forget_stopped()
            return {"engines": len(self.live(("ready",))), "added": added, "removed": removed}

    async def _remove(self, h: EngineHandle) -> None:
        self._set(h, "draining")
        self.weights.membership_changed(f"engine {h.engine_id} was removed")
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while h.load > 0 and h.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await h.stop(grace_s=5.0)
        await h.starter.close()
        self._set(h, "stopped")

    def _forget_stopped(self) -> None:
        for engine_id in [i for i, h in self.handles.items() if h.state == "stopped" and not h.alive]:
            del self.handles[engine_id]
            self._first_ready.pop(engine_id, None)
            task = self._tasks.pop(engine_id, None)
            if task is not None and not task.done():
                task.cancel()
        self._notify()

    # ------------------------------------------------------------------ observability

    def stats(self) -> dict[str, Any]:
        engines = [h.describe() for h in self.handles.values()]
        return {
            "version": self.version, "sleeping": self.sleeping, "failovers": self.failovers,
            "engines_ready": sum(e["state"] == "ready" for e in engines), "engines": engines,
            "load": sum(e["load"] for e in engines),
            "running": sum(e["running"] for e in engines),
            "waiting": sum(e["waiting"] + e["gated"] for e in engines),
            "tokens_per_s": round(sum(e["tokens_per_s"] for e in engines), 3),
            "restarts": sum(e["restarts"] for e in engines),
            "weight_group": self.weights.describe(),
        }

    def health(self) -> dict[str, Any]:
        states = {h.engine_id: h.state for h in self.handles.values()}
        ready = sum(s == "ready" for s in states.values())
        status = "ok" if ready == len(states) and ready else ("degraded" if ready else "down")
        return {"status": status, "version": self.version, "engines_ready": ready, "engines": states,
                "quarantined": {h.engine_id: h.reason for h in self.handles.values() if h.state == "quarantined"}}


def first_error(replies: dict[str, Any]) -> BaseException | None:
    """The first exception among fan-out replies, or None."""
    return next((r for r in replies.values() if isinstance(r, BaseException)), None)


__all__ = ["EnginePool", "EngineDead", "first_error"]
