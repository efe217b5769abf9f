"""The local backend: every component a subprocess of the launcher, in a session of its own.

Daemons start first, all at once, each on free loopback ports the launcher picks (``plan.bind``);
once every daemon answers its health call the trainer starts with their addresses
(``--vllm.endpoint``, ``--reward.remote_url``), under torchrun when it has several ranks. Each
component's stdout and stderr go to ``<run_dir>/<component>.log``. Own sessions keep a terminal's
Ctrl-C away from the components: the launcher alone decides when and in which order they stop.

Not here: the supervision policy (``supervise``), Ray (``ray_backend``).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from treadle.common import env
from treadle.integration.health import probe_for
from treadle.integration.plan import (
    EXIT_INTERRUPTED,
    EXIT_LAUNCH_ERROR,
    Addresses,
    Plan,
    bind,
    merge_addresses,
    trainer_argv,
    trainer_groups,
)
from treadle.integration.procs import Tree, die_with_parent, free_ports, signal_group
from treadle.integration.restart import TrainerRestarts, archive_trainer_logs
from treadle.integration.supervise import (
    ComponentFailed,
    Interrupted,
    Outcome,
    RunRecord,
    Supervisor,
    ready_banner,
)

HOST = "127.0.0.1"
CHILD_ENV = {"PYTHONUNBUFFERED": "1"}  # logs reach the run directory as they are written


class LocalProcess:
    """A component running as a subprocess (session leader) with its output in a log file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, environ: dict[str, str]) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=environ, preexec_fn=die_with_parent)
        self.tree = Tree(self.proc.pid)
        self.tree.refresh()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        signal_group(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        signal_group(self.proc.pid, signal.SIGKILL)
        self.tree.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def track(self) -> None:
        self.tree.refresh()

    def info(self) -> dict[str, Any]:
        return {"cmd": self.cmd, "pid": self.proc.pid, "log": self.log_path.name}


def start_daemons(plan: Plan, sup: Supervisor, run_dir: Path, environ: dict[str, str]) -> Addresses:
    """Start every daemon on free loopback ports (rollout first: the gateway is wired to it)."""
    ports = iter(free_ports(sum(d.ports_needed for d in plan.daemons)))
    addresses = Addresses()
    for d in plan.daemons:
        argv, mine = bind(d, HOST, [next(ports) for _ in range(d.ports_needed)], addresses)
        addresses = merge_addresses(addresses, mine)
        sup.add(LocalProcess(d.name, d.command(argv), run_dir / f"{d.name}.log", environ))
    sup.record.addresses(addresses)
    return addresses


def run_local(plan: Plan, run_dir: Path, stop: threading.Event, prior: dict[str, Any] | None = None) -> Outcome:
    """Start, supervise and tear down ``plan`` as local processes; the outcome is also in run.json."""
    cfg = plan.cfg
    record = RunRecord(run_dir, "local", prior)
    sup = Supervisor(record, stop, stop_timeout_s=cfg.stop_timeout_s)
    trainers = trainer_groups(cfg)  # one: the local backend runs one node
    environ = env.child_env(CHILD_ENV)
    try:
        addresses = start_daemons(plan, sup, run_dir, environ)
        for d in plan.daemons:
            sup.wait_ready(d.name, probe_for(d.name, addresses), cfg.start_timeout_s)
        restarts = TrainerRestarts(plan, prior)
        if trainers:
            sup.add(LocalProcess(trainers[0], trainer_argv(cfg, addresses), run_dir / "trainer.log", environ))
        print(ready_banner(plan, addresses, run_dir), flush=True)
        outcome = sup.watch(trainers)
        while trainers and (again := restarts.next_plan(outcome, sup.exit_of(outcome.failed), sup.daemons_alive(trainers))):
            sup.stop_parts(trainers)
            archive_trainer_logs(run_dir, trainers, len(restarts.done))
            record.update(trainer_restarts=restarts.done)
            sup.add(LocalProcess(trainers[0], trainer_argv(again.cfg, addresses), run_dir / "trainer.log", environ))
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
        sup.finish(outcome)
    return outcome
