"""Engines as Ray actors (``treadle-rollout serve --engine_placement ray``): one daemon, engines on any node.

Each engine slot gets a placement group of its own: one bundle of ``--ray.num_cpus_per_rank``
and ``--ray.num_gpus_per_rank`` times the engine's ranks (tensor x pipeline parallel), strategy
STRICT_PACK (an engine's ranks share a node), with ``--ray.node_labels`` as the bundle's label
selector. In it an ``EngineActor`` starts ``python -m treadle.rollout.worker`` as its child, the
very worker a local pool starts, serving tcp on the node's address. Ray sets the actor's
CUDA_VISIBLE_DEVICES; the worker inherits it.

The channel from the front end to each worker crosses hosts, so it is CURVE-encrypted: the pool
makes a key set per daemon run (``generate_keys``, in the pool's run folder) and hands each actor
the server side, which it writes owner-only on its node; the client key stays with the pool.

Colocated (``--ray.colocate``, what ``treadle-launch`` gives with ``--train.colocate_all`` over
several nodes): engine k runs in bundle B of the placement group the daemon itself runs in (the
launcher's, whose bundles hold the trainer's nodes), on the GPU ids given for it, the trainer's
ranks' there. Its actor reserves nothing (the trainer's part holds the bundle's CPUs and GPUs,
as the local engines of a colocated daemon share them); the placement group is never removed
here. A restart of the slot goes back into the same bundle.

Death: the front end awaits the actor's ``wait`` call, which returns the worker's exit status, or
raises when the actor dies with its node (Ray's health checks notice a lost node in seconds to
tens of seconds: ``health_check_period_ms`` x ``health_check_failure_threshold`` on the head).
Either way the pool sees an exit, fails the engine's in-flight samples over to the others, and
restarts the slot (``pool._lifecycle``): the old placement group is removed and a new one asked
for, which Ray places wherever there is room; the first start of a slot waits at most
``--start_timeout_s`` for room, a restart waits until room returns (the daemon keeps serving
with the engines it has). The restarted engine catches up to the pool's weights as any restart
does (``updates.catch_up``).

Not here: routing, failover, weights (``pool``, ``dispatch``, ``updates``); the launcher's own
placement of the daemon (``treadle.integration.ray_backend``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treadle.common import env
from treadle.common.config import ConfigError, label_selector
from treadle.common.log import get_logger
from treadle.common.rpc import ClientCurve, generate_keys, load_client_keys
from treadle.rollout.config import ColocatedSlot, RayEngineOptions
from treadle.rollout.worker import WorkerSpec

log = get_logger(__name__)
DIED = -int(signal.SIGKILL)  # exit status recorded for an engine whose actor died (its node, ray.kill)
KILL_GRACE_S = 5.0  # after asking the actor to kill its worker, ray.kill the actor itself
CLIENT = "pool"  # the pool's CURVE client name
ACTOR_CONCURRENCY = 4  # wait() blocks a thread for the worker's life; the rest stay callable


class EngineActor:
    """Hosts one engine worker process on its node (a threaded actor: ``wait`` blocks)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._keys = ""

    def prepare(self) -> dict[str, Any]:
        """This node's address and a free tcp port on it."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return {"node_ip": ip, "port": port, "node_id": ray.get_runtime_context().get_node_id()}

    def start(self, spec_json: str, environ: dict[str, str], keys: dict[str, str]) -> int:
        """Write the server keys owner-only, start the worker (watching this actor's pid); its pid."""
        if keys:
            self._keys = tempfile.mkdtemp(prefix="treadle-engine-keys-")
            for rel, text in keys.items():
                path = Path(self._keys, rel)
                path.parent.mkdir(mode=0o700, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
        spec = dataclasses.replace(WorkerSpec.from_json(spec_json), curve_dir=self._keys, parent_pid=os.getpid())
        self._proc = subprocess.Popen([sys.executable, "-m", "treadle.rollout.worker", spec.to_json()],
                                      env={**os.environ, **environ}, stdin=subprocess.DEVNULL, start_new_session=True)
        return self._proc.pid

    def wait(self) -> int:
        """Block until the worker exits; its exit status."""
        assert self._proc is not None
        code = self._proc.wait()
        if self._keys:
            shutil.rmtree(self._keys, ignore_errors=True)
        return code

    def kill_worker(self) -> None:
        """SIGKILL the worker's process group (vLLM's children included)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)


RemoteEngineActor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=ACTOR_CONCURRENCY)(EngineActor)


def _ref(ref: Any) -> asyncio.Future[Any]:
    """An ObjectRef as an awaitable of this event loop."""
    return asyncio.wrap_future(ref.future())


class RayProcess:
    """A worker under an ``EngineActor`` (``handle.EngineProcess``)."""

    def __init__(self, actor: Any, pid: int, node: str, wait_ref: Any) -> None:
        self._actor = actor
        self.pid = pid
        self.node = node
        self.error = ""
        self._returncode: int | None = None
        self._exit = asyncio.ensure_future(self._wait(wait_ref))
        self._killed = False

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def _wait(self, wait_ref: Any) -> int:
        try:
            code = int(await _ref(wait_ref))
        except ray.exceptions.RayError as e:
            code = DIED
            self.error = f"its Ray actor died (node {self.node}): {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        self._returncode = code
        return code

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def kill(self) -> None:
        """SIGKILL the worker's process group through its actor, then ``ray.kill`` the actor."""
        if self._killed:
            return
        self._killed = True
        with contextlib.suppress(Exception):
            self._actor.kill_worker.remote()
        asyncio.get_running_loop().call_later(KILL_GRACE_S, self.kill_actor)

    def kill_actor(self) -> None:
        if not ray.is_initialized():  # the pool closed and left Ray: ray.kill would start a new cluster
            return
        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)


class RayStarter:
    """Starts one engine slot's worker in a placement group of its own, or (``--ray.colocate``)
    in its bundle of the daemon's own placement group (``handle.Starter``)."""

    def __init__(self, spec: WorkerSpec, engines: RayEngines, slot: ColocatedSlot | None = None) -> None:
        self.spec = spec
        self._engines = engines
        self._slot = slot
        self._pg: Any = None
        self._proc: RayProcess | None = None
        self._started = False

    async def start(self, engine_id: str) -> tuple[RayProcess, str, ClientCurve | None]:
        await self.close()  # the previous incarnation's actor and placement group
        if self._slot is not None:
            return await self._start_colocated(engine_id, self._slot)
        e = self._engines
        selector = label_selector(e.opts.node_labels)
        self._pg = placement_group([e.bundle], strategy="STRICT_PACK",
                                   bundle_label_selector=[selector] if selector else None)
        # A slot's first start fails after --start_timeout_s without room; a restart waits for room.
        timeout = None if self._started else e.start_timeout_s
        ready = self._pg.ready()
        if not (await asyncio.to_thread(ray.wait, [ready], timeout=0.5))[0]:
            log.info("engine %s: waiting for a Ray node with %s free%s", engine_id, e.bundle,
                     f" and labels {selector}" if selector else "")
            try:
                await asyncio.wait_for(_ref(ready), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"engine {engine_id}: no Ray node had {e.bundle} free"
                                   + (f" with labels {selector}" if selector else "")
                                   + f" within {timeout:g} s (--start_timeout_s); free now: "
                                   f"{ray.available_resources()}") from None
        self._started = True
        return await self._run(engine_id, self._pg, 0, e.bundle, e.worker_env)

    async def _start_colocated(self, engine_id: str, slot: ColocatedSlot) -> tuple[RayProcess, str, ClientCurve | None]:
        e = self._engines
        environ = {**e.worker_env, **({"CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)} if slot.gpus else {})}
        return await self._run(engine_id, e.own_group, slot.bundle, {}, environ)

    async def _run(self, engine_id: str, pg: Any, bundle_index: int, resources: dict[str, float],
                   environ: dict[str, str]) -> tuple[RayProcess, str, ClientCurve | None]:
        """An ``EngineActor`` in bundle ``bundle_index`` of ``pg`` reserving ``resources``, and its worker."""
        e = self._engines
        actor = RemoteEngineActor.options(
            num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
            runtime_env={"env_vars": env.forwarded_env()},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index)).remote()
        where = await _ref(actor.prepare.remote())
        spec = dataclasses.replace(self.spec, endpoint=f"tcp://{where['node_ip']}:{where['port']}")
        pid = await _ref(actor.start.remote(spec.to_json(), environ, e.server_keys))
        self._proc = RayProcess(actor, pid, where["node_id"], actor.wait.remote())
        log.info("engine %s: worker %d on Ray node %s (%s), serving %s", engine_id, pid, where["node_id"],
                 where["node_ip"], spec.endpoint)
        return self._proc, spec.endpoint, e.client_curve

    async def close(self) -> None:
        if self._proc is not None:
            self._proc.kill_actor()
            self._proc = None
        if self._pg is not None:  # only a placement group of the slot's own (never the daemon's)
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None


class RayEngines:
    """The pool's side of ``--engine_placement ray``: the Ray connection and the run's CURVE keys."""

    def __init__(self, opts: RayEngineOptions, ranks: int, start_timeout_s: float, key_dir: Path,
                 owns_ray: bool, own_group: Any = None) -> None:
        self.opts = opts
        self.slots = opts.slots()
        self.own_group = own_group
        """The placement group this daemon runs in (``--ray.colocate``'s bundles are its)."""
        self.bundle = opts.bundle(ranks)
        self.start_timeout_s = start_timeout_s
        self.worker_env = {"OMP_NUM_THREADS": str(opts.placement().threads_per_rank)}
        self.server_keys = {rel: (key_dir / rel).read_text() for rel in
                            ("server.key", "server.key_secret", f"authorized_clients/{CLIENT}.key")}
        self.client_curve = load_client_keys(key_dir, name=CLIENT)
        self._key_dir = key_dir
        self._owns_ray = owns_ray

    @classmethod
    async def create(cls, opts: RayEngineOptions, ranks: int, start_timeout_s: float, run_dir: str) -> RayEngines:
        owns = await connect(opts.address)
        key_dir = Path(run_dir) / "engine-keys"
        key_dir.mkdir(mode=0o700, exist_ok=True)
        generate_keys(key_dir, clients=(CLIENT,), overwrite=True)
        return cls(opts, ranks, start_timeout_s, key_dir, owns, own_group=own_group(opts))

    def starter(self, spec: WorkerSpec, slot: int) -> RayStarter:
        if self.slots and slot >= len(self.slots):
            raise ValueError(f"--ray.colocate places {len(self.slots)} engines, one per place given: no place for "
                             f"engine slot {slot} (a colocated pool does not scale past them)")
        return RayStarter(spec, self, self.slots[slot] if self.slots else None)

    def close(self) -> None:
        shutil.rmtree(self._key_dir, ignore_errors=True)
        if self._owns_ray:
            ray.shutdown()


def own_group(opts: RayEngineOptions) -> Any:
    """With ``--ray.colocate``: the placement group this process runs in, checked to have every
    bundle named (ConfigError before any engine starts); else None."""
    slots = opts.slots()
    if not slots:
        return None
    from ray.util import get_current_placement_group  # noqa: PLC0415

    pg = get_current_placement_group() if ray.is_initialized() else None  # (asked unconnected, Ray would start one)
    if pg is None:
        raise ConfigError("--ray.colocate names bundles of the placement group this daemon runs in, and it runs in "
                          "none: it is for a daemon that treadle-launch (--backend ray) starts in a Ray actor")
    beyond = sorted({s.bundle for s in slots if s.bundle >= pg.bundle_count})
    if beyond:
        raise ConfigError(f"--ray.colocate: bundle(s) {beyond} not in this daemon's placement group of "
                          f"{pg.bundle_count} bundles")
    return pg


async def connect(address: str) -> bool:
    """Join (or, for "local", start) a Ray cluster unless this process is already in one; True
    when this call connected. Ray's driver set-up replaces the SIGTERM / SIGINT handlers (its own
    made a SIGTERM'd daemon abort): the daemon's are put back."""
    if ray.is_initialized():
        return False
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    kwargs: dict[str, Any] = {"address": address, "log_to_driver": True}
    if address == "local":
        kwargs.update(include_dashboard=False, object_store_memory=128 << 20)
    await asyncio.to_thread(lambda: ray.init(**kwargs))
    for s, handler in saved.items():
        if handler is not None:
            signal.signal(s, handler)
    return True
