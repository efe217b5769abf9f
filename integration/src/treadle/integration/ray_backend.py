"""The Ray backend: every component a Ray actor in one placement group, on whichever nodes fit.

Each daemon is a ``ComponentActor`` whose ``run_main`` calls the daemon's own CLI ``main`` (the
very code ``treadle-rollout serve`` runs) in the actor's process, on its main thread, so the
daemon's SIGTERM handling and shutdown work as they do from a shell. The actor first reports its
node, its node's address, pid, GPU ids and free ports there (``prepare``); the launcher turns
those into the daemon's flags and addresses: a daemon binds its node's address, and one off
loopback gets the run's CURVE keys and HTTP token, made by the launcher in ``<run_dir>/keys``
(``plan.Keys``); the trainer and the launcher's health probes get the client side.

The trainer: one actor per node it spans (``trainer``, ``trainer.1``, ...), each running torchrun
as a subprocess of the actor for that node's ranks: ``--standalone --nproc_per_node K`` on one
node, else ``--nnodes N --node_rank i --master_addr <node 0's address> --master_port <a free
port there> --nproc_per_node K`` (torchrun's static rendezvous, which DeepSpeed's
``init_distributed`` joins: gloo on CPU, NCCL on GPUs). Why one actor per node and not
OpenRLHF's one actor per rank: the trainer is a command line (``treadle.trainer.cli``) that
finds its world from torchrun (``ranks.launcher_world``) and sets up LOCAL_RANK, the per-node
data cache and a failed rank's stop of its node's other ranks through it, exactly as a user's
own ``torchrun`` on each host would; actors per rank would need a second rendezvous path in the
trainer. The cost is the bundle shape: one bundle per node holding K ranks' GPUs (CPUs), since
an actor holds one bundle, where OpenRLHF has one bundle per GPU; a bundle that does not fit on
one node is never split.

A critic server (``-- critic``, or ppo's ``--critic.num_gpus_per_node`` unlike the actor's) runs
as the trainer does: one actor per node it spans, each running its ranks as a subprocess
(``treadle-train critic --ranks K`` on one node, torchrun over several, meeting on the first part's
node, whose rank 0 binds the endpoint: ``start_critic``).

Placement: the bundles of the trainer's nodes, one per daemon (a critic: one per node; with ppo's
``--train.colocate_all`` the rollout daemon shares the first trainer bundle and gets its GPU ids,
``--gpu_ids``; over several trainer nodes its engines are Ray actors in every trainer node's
bundle instead, on the GPUs of the ranks there, ``--ray.colocate``), in one placement group with strategy PACK: a run that fits on one node stays on
it, a larger one spreads over as few nodes as Ray can. Where things go is the user's to say with
Ray node labels: ``ray start --labels role=trainer`` on some nodes, ``--trainer.node_labels
role=trainer`` (``--rollout.node_labels``, ``--rewards.node_labels``, ``--agents.node_labels``)
to the launcher, which become the bundles' ``bundle_label_selector``. The run directory (logs,
keys) and the trainer's checkpoint folder must be on a filesystem every node sees.

Logs: each actor points its stdout/stderr (and its children's) at ``<run_dir>/<name>.log``.
Teardown: SIGTERM to the actor process (the daemon shuts down; the trainer actor forwards it to
torchrun), then SIGKILL of every process the actor started, ``ray.kill`` and the placement
group's removal. An actor in the launcher's own pid namespace (same machine) is signalled and
its process tree tracked directly; one on another machine through a task pinned to its node
(``NodeAffinitySchedulingStrategy``), which signals the actor's process tree as it is then.
Not here: the supervision policy (``supervise``), the restart rules (``restart``). A trainer part
that fails (its node lost with it) while the daemons run is started again in its bundle, which
Ray places anew when its node died, from the last checkpoint (``restart.TrainerRestarts``); any
other component's failure ends the attempt, and ``--max_restarts`` then runs the whole plan
again, placed anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from treadle.common import env
from treadle.common.config import ConfigError
from treadle.common.log import get_logger
from treadle.integration.config import RayLaunch
from treadle.integration.health import probe_for
from treadle.integration.plan import (
    EXIT_INTERRUPTED,
    EXIT_LAUNCH_ERROR,
    Addresses,
    DaemonPlan,
    Keys,
    Plan,
    Rendezvous,
    bind,
    bundles_of,
    colocated_places,
    flag_value,
    merge_addresses,
    off_loopback_host,
    selectors_of,
    trainer_argv,
    trainer_groups,
)
from treadle.integration.procs import Tree, free_ports
from treadle.integration.restart import TrainerRestarts, archive_trainer_logs
from treadle.integration.supervise import (
    ComponentFailed,
    Interrupted,
    Outcome,
    RunRecord,
    Supervisor,
    ready_banner,
)

log = get_logger(__name__)
LOCAL_OBJECT_STORE_BYTES = 256 << 20
DIED = -int(signal.SIGKILL)  # exit code recorded for an actor that died without returning
SIGNAL_TASK_S = 120.0
"""How long a signalling task on another machine's node may take (it may need a new Ray worker)."""
STRATEGY = "PACK"
"""Placement-group strategy: as few nodes as fit (Ray's PACK), so a small run stays on one node."""
KEYS_DIR = "keys"
"""The run's CURVE keys and HTTP token, in the run directory (made only when a daemon binds off loopback)."""


def host_id() -> str:
    """This process's machine and pid namespace (boot id + pid-namespace inode): two processes
    with the same one can signal each other by pid."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{os.uname().nodename}:?"


@ray.remote(num_cpus=0, max_retries=0)
def _signal_tree(pid: int, sig: int, below: bool) -> int:
    """On the node of an actor process ``pid``: send ``sig`` to it, or (``below``) to every
    process under it; how many were signalled."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) if below else [root]
    except psutil.Error:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)
    return len(procs)


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


@ray.remote(max_restarts=0)
class ComponentActor:
    """Runs one component in a Ray worker process."""

    def prepare(self, ports: int) -> dict[str, Any]:
        """Where this actor runs: pid, node, the node's address, GPU ids, and ``ports`` ports free
        on that address."""
        ctx = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "node_ip": ip, "host": host_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "ports": free_ports(ports, ip) if ports else []}

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
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
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
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)  # a node that does not share the run dir
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class ActorHandle:
    """A component running in a ``ComponentActor`` (the supervisor's ``Handle``)."""

    def __init__(self, name: str, actor: Any, where: dict[str, Any], ref: Any, log_path: Path, cmd: list[str]) -> None:
        self.name = name
        self.actor = actor
        self.where = where
        self.ref = ref
        self.log_path = log_path
        self.cmd = cmd
        self.tree = Tree(where["pid"])
        self.local = where.get("host") == host_id()
        """In the launcher's pid namespace: signalled and tracked by pid from here."""
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

    def _on_node(self, sig: int, *, below: bool) -> int | None:
        """Signal the actor process (or everything under it) through a task on its node; how many
        processes were signalled (None: the task did not answer within ``SIGNAL_TASK_S``)."""
        strategy = NodeAffinitySchedulingStrategy(self.where["node_id"], soft=False)
        task = _signal_tree.options(scheduling_strategy=strategy).remote(self.where["pid"], int(sig), below)
        try:
            return int(ray.get(task, timeout=SIGNAL_TASK_S))
        except Exception as e:  # noqa: BLE001  (a lost node, a slow worker start: teardown goes on)
            log.warning("signalling %s on its node failed: %s", self.name, e)
            return None

    def terminate(self) -> None:
        if not self.local:
            if self.poll() is None:
                self._on_node(signal.SIGTERM, below=False)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.where["pid"], signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL what the actor started, then end the actor through Ray (a SIGKILL only if that fails)."""
        pid = self.where["pid"]
        if not self.local:
            self._on_node(signal.SIGKILL, below=True)
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
            if self._code is None:
                with contextlib.suppress(Exception):
                    ray.wait([self.ref], timeout=5)
                self.poll()
            return
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
        if self.local:
            self.tree.refresh()

    def info(self) -> dict[str, Any]:
        return {"cmd": self.cmd, "pid": self.where["pid"], "node_ip": self.where["node_ip"],
                "node_id": self.where["node_id"], "gpu_ids": self.where["gpu_ids"], "log": self.log_path.name}


# ---------------------------------------------------------------------------------------------
# placement


RAY_SOCKET_SUFFIX = len("/session_2026-12-03_07-12-00_123456_1234567/sockets/plasma_store")
"""What Ray appends to its temp folder for its longest AF_UNIX socket path."""
AF_UNIX_MAX = 107


def ray_temp_dir(given: str, cache: Path) -> Path:
    """The temp folder of a new local Ray cluster (pure but for resolving paths): ``--ray.temp_dir``,
    else ``<cache>/ray``, else, where that is too deep for Ray's socket paths (AF_UNIX allows 107
    bytes; a checkout deep in the tree passed it and Ray died with a raw OSError), a folder of this
    user's under the system's temp folder. A given folder too deep is a ConfigError naming the flag."""
    def fits(path: Path) -> bool:
        return len(str(path.resolve())) + RAY_SOCKET_SUFFIX <= AF_UNIX_MAX

    if given:
        if not fits(Path(given)):
            raise ConfigError(f"--ray.temp_dir {given}: too long for Ray's socket paths (AF_UNIX allows "
                              f"{AF_UNIX_MAX} bytes, Ray adds {RAY_SOCKET_SUFFIX}); use a shorter folder such as /tmp/ray")
        return Path(given)
    default = cache / "ray"
    return default if fits(default) else Path(tempfile.gettempdir()) / f"treadle-ray-{os.getuid()}"


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
    temp = ray_temp_dir(ray_cfg.temp_dir, Path(env.get("TREADLE_CACHE_DIR") or ".cache"))
    temp.mkdir(parents=True, exist_ok=True)
    cpus = ray_cfg.num_cpus or max(os.cpu_count() or 1, math.ceil(need_cpus))
    # treadle moves no data through Ray's object store (weights go over gloo / NCCL): keep it small.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=str(temp.resolve()),
             object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    return True


def place(plan: Plan, stop: threading.Event) -> tuple[Any, dict[str, Any], dict[str, dict[str, Any]]]:
    """(placement group, component -> actor, component -> actor's ``prepare`` answer)."""
    bundles, index, need = bundles_of(plan)
    selectors = selectors_of(plan)
    pg = placement_group(bundles, strategy=STRATEGY,
                         bundle_label_selector=selectors if any(selectors) else None)
    deadline = time.monotonic() + plan.cfg.ray.placement_timeout_s
    while not ray.wait([pg.ready()], timeout=0.5)[0]:
        if stop.is_set():
            remove_placement_group(pg)
            raise Interrupted()
        if time.monotonic() > deadline:
            remove_placement_group(pg)
            wanted = ", ".join(f"{b} on {s or 'any node'}" for b, s in zip(bundles, selectors, strict=True))
            raise ConfigError(f"the placement group [{wanted}] did not fit on the cluster within "
                              f"{plan.cfg.ray.placement_timeout_s:g} s (--ray.placement_timeout_s); free now: "
                              f"{ray.available_resources()}; nodes' labels: "
                              f"{[n.get('Labels', {}) for n in ray.nodes() if n.get('Alive')]}")
    ports = {part: d.part_ports(part) for d in plan.daemons for part in d.parts}
    actors, where = new_actors(plan, pg, list(index), ports)
    return pg, actors, where


def new_actors(plan: Plan, pg: Any, names: list[str], ports: dict[str, int],
               timeout_s: float | None = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A ``ComponentActor`` for each of ``names`` in its bundle of ``pg``, and its ``prepare`` answer
    (``ports``: free ports it needs; the trainer's node rank 0 one more for torchrun's rendezvous).
    A bundle whose node died is placed again by Ray when a node has room: ``timeout_s`` bounds the wait."""
    _, index, need = bundles_of(plan)
    environ = env.forwarded_env()
    actors = {}
    for name in names:
        opts = {"num_cpus": need[name]["CPU"], "num_gpus": need[name]["GPU"], "runtime_env": {"env_vars": environ},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index[name])}
        actors[name] = ComponentActor.options(**opts).remote()
    if plan.cfg.trainer.nodes > 1:
        ports = {**ports, "trainer": 1}  # torchrun's rendezvous, hosted by node rank 0
    try:
        answers = ray.get([actors[n].prepare.remote(ports.get(n, 0)) for n in actors], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ComponentFailed(names[0], f"no room to place it again within {timeout_s:g} s "
                                        "(--ray.placement_timeout_s)") from None
    return actors, dict(zip(actors, answers, strict=True))


def make_keys(run_dir: Path) -> Keys:
    """CURVE keys (``treadle-keys generate``: server pair, one client pair, allow-list) and an HTTP
    bearer token in ``<run_dir>/keys`` (owner-only)."""
    from treadle.common.rpc import generate_keys  # noqa: PLC0415

    root = run_dir / KEYS_DIR
    root.mkdir(mode=0o700, exist_ok=True)
    root.chmod(0o700)
    generate_keys(root, clients=("client",))
    token = root / "http_token"
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    return Keys(curve_dir=str(root), token_file=str(token))


def rollout_placement_flags(plan: Plan, where: dict[str, dict[str, Any]]) -> list[str]:
    """Where the rollout daemon's engines run: ``--gpu_ids``, its own GPUs or (colocated) the
    trainer's; colocated with a trainer over several nodes, Ray actors in each trainer node's
    bundle on the GPUs of the ranks they sit beside (``--engine_placement ray --ray.colocate``,
    ``plan.colocated_places``)."""
    d = plan.daemon("rollout")
    if d is None or d.ray_engines or flag_value(d.args[1:], "--gpu_ids") is not None:  # args[0] is "serve"
        return []
    nodes = trainer_groups(plan.cfg)
    if plan.colocate and len(nodes) > 1:
        places = []
        for bundle, ranks in colocated_places(d.engines, d.ranks_per_engine, len(nodes), plan.cfg.trainer.ranks):
            gpus = where[nodes[bundle]]["gpu_ids"]  # bundle i holds trainer node i (``bundles_of``)
            places.append(f"{bundle}:{','.join(gpus[r] for r in ranks)}" if gpus else str(bundle))
        return ["--engine_placement", "ray", "--ray.colocate", *places]
    gpus = where["trainer"]["gpu_ids"] if plan.colocate and "trainer" in where else where["rollout"]["gpu_ids"]
    return ["--gpu_ids", *gpus] if gpus else []


def reference_gpu_flags(plan: Plan, where: dict[str, dict[str, Any]]) -> list[str]:
    """The reference daemon's GPUs, its bundle's (its hf engines on CUDA, one GPU each); none on CPU
    or when the user gave ``--gpu_ids``."""
    d = plan.daemon("reference")
    gpus = where["reference"]["gpu_ids"] if d is not None and not d.ray_engines else []
    if not gpus or flag_value(d.args[1:], "--gpu_ids") is not None:
        return []
    return ["--gpu_ids", *gpus, *(() if flag_value(d.args[1:], "--engine.device") else ("--engine.device", "cuda"))]


def start_daemons(plan: Plan, sup: Supervisor, actors: dict[str, Any], where: dict[str, dict[str, Any]],
                  run_dir: Path, keys: Keys | None) -> Addresses:
    """Start every daemon bound to its node's address (rollout first: the gateway is wired to it)."""
    addresses = Addresses()
    for d in plan.daemons:
        argv, mine = bind(d, where[d.name]["node_ip"], where[d.name]["ports"][:d.ports_needed], addresses, keys)
        if d.name == "critic":  # a process group: each node's part a subprocess, as the trainer's
            addresses = merge_addresses(addresses, mine)
            start_critic(d, sup, actors, where, run_dir, argv)
            continue
        if d.name == "rollout":
            argv += rollout_placement_flags(plan, where)
        if d.name == "reference":
            argv += reference_gpu_flags(plan, where)
        replicas = [(d.name, argv, mine)]
        for part in d.parts[1:]:  # reward daemons on further nodes: replicas, each on its own node's addresses
            replicas.append((part, *bind(d, where[part]["node_ip"], where[part]["ports"], addresses, keys)))
        if len(replicas) > 1:
            mine = dataclasses.replace(mine, rewards=",".join(r[2].rewards or "" for r in replicas))
        addresses = merge_addresses(addresses, mine)
        for part, part_argv, _ in replicas:
            log_path = run_dir / f"{part}.log"
            ref = actors[part].run_main.remote(d.module, part_argv, str(log_path))
            sup.add(ActorHandle(part, actors[part], where[part], ref, log_path, [d.module, *part_argv]))
    sup.record.addresses(addresses)
    return addresses


def start_critic(d: DaemonPlan, sup: Supervisor, actors: dict[str, Any], where: dict[str, dict[str, Any]],
                 run_dir: Path, argv: list[str]) -> None:
    """The critic server's parts, one per node (``critic`` is node rank 0: its rank 0 binds the
    endpoint and it hosts the rendezvous, on its last free port), as subprocesses of their actors."""
    head = where[d.name]
    for i, part in enumerate(d.parts):
        rendezvous = Rendezvous(node_rank=i, master_addr=head["node_ip"], master_port=head["ports"][-1]) \
            if d.nodes > 1 else None
        cmd = d.command(argv, rendezvous=rendezvous)[1:]  # the actor runs its own python
        log_path = run_dir / f"{part}.log"
        ref = actors[part].run_process.remote(cmd, {}, str(log_path))
        sup.add(ActorHandle(part, actors[part], where[part], ref, log_path, cmd))


def start_trainer(plan: Plan, sup: Supervisor, actors: dict[str, Any], where: dict[str, dict[str, Any]],
                  run_dir: Path, addresses: Addresses, keys: Keys | None) -> None:
    """One torchrun per trainer node (``trainer`` is node rank 0: it hosts the rendezvous)."""
    cfg = plan.cfg
    head = where["trainer"]
    rdzv = head["ports"][0] if cfg.trainer.nodes > 1 else None
    for i, name in enumerate(trainer_groups(cfg)):
        rendezvous = Rendezvous(node_rank=i, master_addr=head["node_ip"], master_port=rdzv) if rdzv else None
        argv = trainer_argv(cfg, addresses, rendezvous=rendezvous, keys=keys,
                            sync_host=head["node_ip"])[1:]  # the actor runs its own python
        log_path = run_dir / f"{name}.log"
        ref = actors[name].run_process.remote(argv, {}, str(log_path))
        sup.add(ActorHandle(name, actors[name], where[name], ref, log_path, argv))


def run_ray(plan: Plan, run_dir: Path, stop: threading.Event, prior: dict[str, Any] | None = None) -> Outcome:
    """Start, supervise and tear down ``plan`` as Ray actors; the outcome is also in run.json."""
    cfg = plan.cfg
    bundles, _, _ = bundles_of(plan)
    started = connect(cfg.ray, sum(b.get("CPU", 0) for b in bundles))
    record = RunRecord(run_dir, "ray", prior)
    record.update(ray={"address": ray.get_runtime_context().gcs_address, "started_local_cluster": started,
                       "bundles": bundles, "strategy": STRATEGY, "label_selectors": selectors_of(plan)})
    sup = Supervisor(record, stop, stop_timeout_s=cfg.stop_timeout_s)
    trainers = trainer_groups(cfg)
    pg, actors = None, {}
    try:
        pg, actors, where = place(plan, stop)
        record.update(placement={n: {"node_id": w["node_id"], "node_ip": w["node_ip"]} for n, w in where.items()})
        keys = None
        if any(off_loopback_host(where[d.name]["node_ip"]) for d in plan.daemons):
            keys = make_keys(run_dir)
            record.update(keys=keys.curve_dir)
        addresses = start_daemons(plan, sup, actors, where, run_dir, keys)
        curve = None
        if keys is not None:
            from treadle.common.rpc import load_client_keys  # noqa: PLC0415

            curve = load_client_keys(keys.curve_dir)
        for d in plan.daemons:
            sup.wait_ready(d.name, probe_for(d.name, addresses, curve), cfg.start_timeout_s)
        restarts = TrainerRestarts(plan, prior)
        if trainers:
            start_trainer(plan, sup, actors, where, run_dir, addresses, keys)
        print(ready_banner(plan, addresses, run_dir), flush=True)
        outcome = sup.watch(trainers)
        while trainers and (again := restarts.next_plan(outcome, sup.exit_of(outcome.failed),
                                                        sup.daemons_alive(trainers))):
            sup.stop_parts(trainers)
            for name in trainers:
                with contextlib.suppress(Exception):
                    ray.kill(actors[name], no_restart=True)
            archive_trainer_logs(run_dir, trainers, len(restarts.done))
            record.update(trainer_restarts=restarts.done)
            fresh, placed = new_actors(again, pg, list(trainers), {}, timeout_s=cfg.ray.placement_timeout_s)
            actors.update(fresh)
            where.update(placed)
            record.update(placement={n: {"node_id": w["node_id"], "node_ip": w["node_ip"]} for n, w in where.items()})
            start_trainer(again, sup, actors, where, run_dir, addresses, keys)
            outcome = sup.watch(trainers)
    except ComponentFailed as e:
        outcome = sup.failed(e)
    except Interrupted:
        outcome = Outcome(exit_code=EXIT_INTERRUPTED, reason="interrupted")
    except BaseException as e:
        outcome = Outcome(exit_code=EXIT_LAUNCH_ERROR, reason=f"{type(e).__name__}: {e}")
        raise
    finally:
        sup.teardown(trainers)
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
