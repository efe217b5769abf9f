"""The Ray backend: every component a Ray actor in one placement group on the launcher's node.

Each daemon is a ``ComponentActor`` whose ``run_main`` calls the daemon's own CLI ``main`` (the
very code ``treadle-rollout serve`` runs) in the actor's process, on its main thread, so the
daemon's SIGTERM handling and shutdown work as they do from a shell. The actor first reports its
node, pid, GPU ids and free ports (``prepare``); the launcher turns those into the daemon's flags
and addresses. The trainer runs in its actor as a subprocess (``python -m treadle.trainer.cli``,
or torchrun with ``--nproc_per_node`` = ranks): one actor holds all ranks' resources, which is
the simplest correct placement for ranks of one node; a trainer spanning nodes is not supported.

Placement: one bundle for the trainer (ranks x CPUs/GPUs), one per daemon; with ppo's
``--train.colocate_all`` the rollout daemon shares the trainer's bundle and gets the trainer's
GPU ids (``--gpu_ids``) instead of GPUs of its own. Daemons bind loopback (non-loopback binds
need CURVE keys the trainer's clients cannot use yet), so every bundle is pinned to the
launcher's node (``ray.io/node-id`` label selector).

Logs: each actor points its stdout/stderr (and its children's) at ``<run_dir>/<name>.log``.
Teardown: SIGTERM to the actor process (the daemon shuts down; the trainer actor forwards it to
the trainer), then SIGKILL of every process the actor started, ``ray.kill`` and the placement
group's removal. Not here: the supervision policy (``supervise``).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treadle.common import env
from treadle.common.config import ConfigError
from treadle.common.log import get_logger
from treadle.integration.config import RayLaunch
from treadle.integration.health import probe_for
from treadle.integration.plan import (
    EXIT_INTERRUPTED,
    EXIT_LAUNCH_ERROR,
    Addresses,
    Plan,
    bind,
    bundles_of,
    flag_value,
    merge_addresses,
    trainer_argv,
)
from treadle.integration.procs import Tree, free_ports
from treadle.integration.supervise import (
    ComponentFailed,
    Interrupted,
    Outcome,
    RunRecord,
    Supervisor,
    ready_banner,
)

log = get_logger(__name__)
HOST = "127.0.0.1"
FORWARDED_ENV = ("TREADLE_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "TORCH_", "OMP_", "MKL_", "NCCL_",
                 "GLOO_", "DS_", "PYTHONPATH", "MPLCONFIGDIR")
"""Variables of the launcher's environment the actors get (a Ray worker starts from the raylet's)."""
LOCAL_OBJECT_STORE_BYTES = 256 << 20
DIED = -int(signal.SIGKILL)  # exit code recorded for an actor that died without returning


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


@ray.remote(max_restarts=0)
class ComponentActor:
    """Runs one component in a Ray worker process."""

    def prepare(self, ports: int) -> dict[str, Any]:
        """Where this actor runs: pid, node, GPU ids, and ``ports`` free loopback ports."""
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "ports": free_ports(ports) if ports else []}

    def run_main(self, module: str, argv: list[str], log_path: str) -> int:
        """``module.main(argv)`` here, output to ``log_path``; its exit status."""
        _redirect_output(log_path)
        try:
            importlib.import_module(module).main(argv)
            return 0
        except SystemExit as e:
            return _exit_code(e)
        except BaseException:
            traceback.print_exc()
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()

    def run_process(self, argv: list[str], environ: dict[str, str], log_path: str) -> int:
        """``python ARGV`` as a child (own session), output to ``log_path``; SIGTERM is passed on to it."""
        with open(log_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=env.child_env({**environ, "PYTHONUNBUFFERED": "1"}))

        def forward(signum: int, frame: object) -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return proc.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def _redirect_output(log_path: str) -> None:
    """Point this process's fds 1 and 2 (inherited by its children) at ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class ActorHandle:
    """A component running in a ``ComponentActor`` on this node (the supervisor's ``Handle``)."""

    def __init__(self, name: str, actor: Any, where: dict[str, Any], ref: Any, log_path: Path, cmd: list[str]) -> None:
        self.name = name
        self.actor = actor
        self.where = where
        self.ref = ref
        self.log_path = log_path
        self.cmd = cmd
        self.tree = Tree(where["pid"])
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            done, _ = ray.wait([self.ref], timeout=0)
            if done:
                try:
                    self._code = int(ray.get(done[0]))
                except ray.exceptions.RayError:
                    self._code = DIED
        return self._code

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.where["pid"], signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL what the actor started, then end the actor through Ray (a SIGKILL only if that fails)."""
        pid = self.where["pid"]
        self.tree.kill(spare=frozenset({pid}))
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(10)
        self.tree.kill()
        if self._code is None:
            with contextlib.suppress(Exception):
                ray.wait([self.ref], timeout=5)
            self.poll()

    def track(self) -> None:
        self.tree.refresh()

    def info(self) -> dict[str, Any]:
        return {"cmd": self.cmd, "pid": self.where["pid"], "node_ip": self.where["node_ip"],
                "node_id": self.where["node_id"], "gpu_ids": self.where["gpu_ids"], "log": self.log_path.name}


# ---------------------------------------------------------------------------------------------
# placement


def connect(ray_cfg: RayLaunch, need_cpus: float) -> bool:
    """``ray.init`` per ``--ray.address``; True when this call started a new local cluster."""
    if ray.is_initialized():
        return False
    if ray_cfg.address not in (None, "local"):
        ray.init(address=ray_cfg.address, log_to_driver=True)
        return False
    if ray_cfg.address is None:
        with contextlib.suppress(ConnectionError):
            ray.init(address="auto", log_to_driver=True)
            return False
    temp = Path(ray_cfg.temp_dir) if ray_cfg.temp_dir else Path(env.get("TREADLE_CACHE_DIR") or ".cache") / "ray"
    temp.mkdir(parents=True, exist_ok=True)
    cpus = ray_cfg.num_cpus or max(os.cpu_count() or 1, math.ceil(need_cpus))
    # treadle moves no data through Ray's object store (weights go over gloo / NCCL): keep it small.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=str(temp.resolve()),
             object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    return True


def forwarded_env() -> dict[str, str]:
    """The launcher's variables the actors need (caches, thread counts, treadle knobs)."""
    return {k: v for k, v in env.child_env().items() if k.startswith(FORWARDED_ENV)}


def place(plan: Plan, stop: threading.Event) -> tuple[Any, dict[str, Any], dict[str, dict[str, Any]]]:
    """(placement group, component -> actor, component -> actor's ``prepare`` answer)."""
    bundles, index, need = bundles_of(plan)
    node = ray.get_runtime_context().get_node_id()
    pg = placement_group(bundles, strategy="STRICT_PACK",
                         bundle_label_selector=[{"ray.io/node-id": node} for _ in bundles])
    deadline = time.monotonic() + plan.cfg.ray.placement_timeout_s
    while not ray.wait([pg.ready()], timeout=0.5)[0]:
        if stop.is_set():
            remove_placement_group(pg)
            raise Interrupted()
        if time.monotonic() > deadline:
            remove_placement_group(pg)
            raise ConfigError(f"the placement group {bundles} did not fit on this node within "
                              f"{plan.cfg.ray.placement_timeout_s:g} s (--ray.placement_timeout_s); "
                              f"cluster resources: {ray.available_resources()}")
    actors, where = {}, {}
    environ = forwarded_env()
    for name, i in index.items():
        opts = {"num_cpus": need[name]["CPU"], "num_gpus": need[name]["GPU"], "runtime_env": {"env_vars": environ},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}
        actors[name] = ComponentActor.options(**opts).remote()
    ports = {d.name: d.ports_needed for d in plan.daemons}
    answers = ray.get([actors[n].prepare.remote(ports.get(n, 0)) for n in actors])
    where = dict(zip(actors, answers, strict=True))
    return pg, actors, where


def rollout_gpu_flags(plan: Plan, where: dict[str, dict[str, Any]]) -> list[str]:
    """``--gpu_ids`` for the rollout daemon: its own GPUs, or the trainer's when colocated."""
    d = plan.daemon("rollout")
    if d is None or flag_value(d.args[1:], "--gpu_ids") is not None:  # args[0] is "serve"
        return []
    gpus = where["trainer"]["gpu_ids"] if plan.colocate and "trainer" in where else where["rollout"]["gpu_ids"]
    return ["--gpu_ids", *gpus] if gpus else []


def start_daemons(plan: Plan, sup: Supervisor, actors: dict[str, Any], where: dict[str, dict[str, Any]],
                  run_dir: Path) -> Addresses:
    addresses = Addresses()
    for d in plan.daemons:
        argv, mine = bind(d, HOST, where[d.name]["ports"], addresses)
        if d.name == "rollout":
            argv += rollout_gpu_flags(plan, where)
        addresses = merge_addresses(addresses, mine)
        log_path = run_dir / f"{d.name}.log"
        ref = actors[d.name].run_main.remote(d.module, argv, str(log_path))
        sup.add(ActorHandle(d.name, actors[d.name], where[d.name], ref, log_path, [d.module, *argv]))
    sup.record.addresses(addresses)
    return addresses


def _check_same_node(where: dict[str, dict[str, Any]]) -> None:
    node = ray.get_runtime_context().get_node_id()
    away = {n: w["node_ip"] for n, w in where.items() if w["node_id"] != node}
    if away:
        raise ConfigError(f"{away} run on another node than the launcher; daemons bind loopback, so every "
                          "component must run on the launcher's node")


def run_ray(plan: Plan, run_dir: Path, stop: threading.Event) -> Outcome:
    """Start, supervise and tear down ``plan`` as Ray actors; the outcome is also in run.json."""
    cfg = plan.cfg
    bundles, _, _ = bundles_of(plan)
    started = connect(cfg.ray, sum(b.get("CPU", 0) for b in bundles))
    record = RunRecord(run_dir, "ray")
    record.update(ray={"address": ray.get_runtime_context().gcs_address, "started_local_cluster": started,
                       "bundles": bundles})
    sup = Supervisor(record, stop, stop_timeout_s=cfg.stop_timeout_s)
    trainer = "trainer" if cfg.trainer.command else None
    pg, actors = None, {}
    try:
        pg, actors, where = place(plan, stop)
        _check_same_node(where)
        addresses = start_daemons(plan, sup, actors, where, run_dir)
        for d in plan.daemons:
            sup.wait_ready(d.name, probe_for(d.name, addresses), cfg.start_timeout_s)
        if trainer:
            argv = trainer_argv(cfg, addresses)[1:]  # the actor runs its own python
            log_path = run_dir / "trainer.log"
            ref = actors[trainer].run_process.remote(argv, {}, str(log_path))
            sup.add(ActorHandle(trainer, actors[trainer], where[trainer], ref, log_path, argv))
        print(ready_banner(plan, addresses, run_dir), flush=True)
        outcome = sup.watch(trainer)
    except ComponentFailed as e:
        outcome = sup.failed(e)
    except Interrupted:
        outcome = Outcome(exit_code=EXIT_INTERRUPTED, reason="interrupted")
    except BaseException as e:
        outcome = Outcome(exit_code=EXIT_LAUNCH_ERROR, reason=f"{type(e).__name__}: {e}")
        raise
    finally:
        sup.teardown(trainer)
        release(actors, pg)
        sup.finish(outcome)
    return outcome


def release(actors: dict[str, Any], pg: Any) -> None:
    """Kill every actor (also those never started), remove the placement group, disconnect."""
    for a in actors.values():
        with contextlib.suppress(Exception):
            ray.kill(a, no_restart=True)
    if pg is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
    ray.shutdown()
