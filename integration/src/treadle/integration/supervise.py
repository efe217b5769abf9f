"""Supervision shared by both backends: readiness, watching, teardown, and the run record.

A backend wraps each started component in a ``Handle`` (a local process group, or a Ray actor)
and hands them to a ``Supervisor``, which

- waits for each daemon's health probe, failing fast when the daemon exits, its start timeout
  passes, or a stop is requested (Ctrl-C, SIGTERM);
- then watches: the run ends when the trainer exits 0 (success; a trainer across nodes is one
  part per node, ``trainer``, ``trainer.1``, ..., and succeeds when every part has), when any
  component exits otherwise (a daemon exiting at all while the trainer runs is a failure), or on
  a stop request;
- tears down: SIGTERM the trainer's parts, wait, SIGTERM the daemons, wait, then SIGKILL whatever
  of any component's process tree is left;
- keeps ``run.json`` in the run directory up to date (components, addresses, pids, exit codes).

Not here: starting anything (``local``, ``ray_backend``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from treadle.common.log import get_logger
from treadle.integration.health import Probe
from treadle.integration.plan import EXIT_CODES, EXIT_INTERRUPTED, Addresses, Plan
from treadle.integration.procs import describe_signal

log = get_logger(__name__)
POLL_S = 0.2


class Handle(Protocol):
    """One started component."""

    name: str

    def poll(self) -> int | None:
        """Its exit code once it ended (negative: killed by that signal), else None."""

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: daemons and the trainer shut down cleanly on it)."""

    def kill(self) -> None:
        """SIGKILL it and every process it started; safe to call when it already ended."""

    def track(self) -> None:
        """Remember its current descendants (so they can be killed after re-parenting)."""

    def info(self) -> dict[str, Any]:
        """What run.json records about it (command, pid, node, log)."""


class ComponentFailed(Exception):
    """A component exited, died or never got ready."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


class Interrupted(Exception):
    """A stop was requested (Ctrl-C, SIGTERM)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """How a launch ended."""

    exit_code: int
    """The launcher's exit status (0, an EXIT_CODES value, EXIT_INTERRUPTED, ...)."""
    failed: str | None = None
    """The component that failed first; None on success or interruption."""
    reason: str = ""
    """Why, in words."""


class RunRecord:
    """``run.json``: rewritten whole (atomically) on every change."""

    def __init__(self, run_dir: Path, backend: str, prior: dict[str, Any] | None = None) -> None:
        """``prior``: fields the record starts with (``restart``: the attempt number and the
        attempts before this one)."""
        self.path = run_dir / "run.json"
        self.data: dict[str, Any] = {"backend": backend, "run_dir": str(run_dir), "started": time.time(),
                                     "launcher_pid": os.getpid(), **(prior or {}), "components": {},
                                     "addresses": {}}
        self.write()

    def component(self, name: str, **fields: Any) -> None:
        self.data["components"].setdefault(name, {}).update(fields)
        self.write()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def addresses(self, addresses: Addresses) -> None:
        self.update(addresses={k: getattr(addresses, k) for k in Addresses.__slots__ if getattr(addresses, k)})

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


class Supervisor:
    """Readiness, watching and teardown of a set of handles."""

    def __init__(self, record: RunRecord, stop: threading.Event, *, stop_timeout_s: float) -> None:
        self.record = record
        self.stop = stop
        self.stop_timeout_s = stop_timeout_s
        self.handles: dict[str, Handle] = {}

    def add(self, handle: Handle) -> None:
        self.handles[handle.name] = handle
        self.record.component(handle.name, state="starting", **handle.info())

    def _check_all(self) -> None:
        """Raise ComponentFailed for the first component that has ended, Interrupted on a stop request."""
        if self.stop.is_set():
            raise Interrupted()
        for name, h in self.handles.items():
            h.track()
            code = h.poll()
            if code is not None:
                raise ComponentFailed(name, describe_signal(code))

    def wait_ready(self, name: str, probe: Probe, timeout_s: float) -> float:
        """Block until ``probe`` passes; seconds waited. Raises ComponentFailed / Interrupted."""
        start = time.monotonic()
        try:
            while True:
                self._check_all()
                if probe.check():
                    break
                if time.monotonic() - start > timeout_s:
                    raise ComponentFailed(name, f"not ready within {timeout_s:g} s (--start_timeout_s)")
                self.stop.wait(POLL_S)
        finally:
            probe.close()
        waited = time.monotonic() - start
        self.record.component(name, state="ready", ready_s=round(waited, 2))
        log.info("%s ready", name, extra={"fields": {"seconds": round(waited, 1)}})
        return waited

    def watch(self, trainers: Sequence[str]) -> Outcome:
        """Until every part of the trainer (``trainers``) exits 0, any component ends otherwise,
        or a stop is requested."""
        try:
            while True:
                if self.stop.is_set():
                    raise Interrupted()
                done = 0
                for name, h in self.handles.items():
                    h.track()
                    code = h.poll()
                    if code == 0 and name in trainers:
                        done += 1
                    elif code is not None:
                        raise ComponentFailed(name, describe_signal(code))
                if trainers and done == len(trainers):
                    return Outcome(exit_code=0)
                self.stop.wait(POLL_S)
        except ComponentFailed as e:
            return self.failed(e)
        except Interrupted:
            return Outcome(exit_code=EXIT_INTERRUPTED, reason="interrupted")

    def failed(self, e: ComponentFailed) -> Outcome:
        log.error("%s failed: %s", e.name, e.reason)
        return Outcome(exit_code=EXIT_CODES.get(e.name.split(".")[0], 1), failed=e.name, reason=e.reason)

    def finish(self, outcome: Outcome) -> None:
        """Record how the launch ended."""
        self.record.update(ended=time.time(), exit_code=outcome.exit_code, failed=outcome.failed,
                           reason=outcome.reason)

    def exit_of(self, name: str | None) -> int | None:
        """Component ``name``'s exit code (None: running, or no such component)."""
        h = self.handles.get(name or "")
        return h.poll() if h is not None else None

    def daemons_alive(self, trainers: Sequence[str]) -> bool:
        """Whether every component but the trainer's parts is still running."""
        return all(h.poll() is None for n, h in self.handles.items() if n not in trainers)

    def stop_parts(self, names: Sequence[str]) -> dict[str, int | None]:
        """SIGTERM, wait up to ``stop_timeout_s``, SIGKILL the components ``names`` (the trainer's
        parts, before it starts again) and drop them; their exit codes."""
        parts = [self.handles[n] for n in names if n in self.handles]
        self._terminate(parts)
        codes = {}
        for h in parts:
            h.kill()
            codes[h.name] = h.poll()
            del self.handles[h.name]
        return codes

    def _terminate(self, handles: Sequence[Handle]) -> None:
        """SIGTERM those of ``handles`` still running and wait up to ``stop_timeout_s`` for them,
        tracking their descendants meanwhile (so a later SIGKILL finds re-parented ones)."""
        running = [h for h in handles if h.poll() is None]
        for h in running:
            h.track()
            h.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        while any(h.poll() is None for h in running) and time.monotonic() < deadline:
            for h in running:
                h.track()
            time.sleep(POLL_S)

    def teardown(self, trainers: Sequence[str]) -> None:
        """SIGTERM the trainer's parts, then the daemons, each wave given ``stop_timeout_s``; then SIGKILL the rest."""
        first = [h for n, h in self.handles.items() if n in trainers]
        rest = [h for n, h in self.handles.items() if n not in trainers]
        for wave in (first, rest):
            self._terminate(wave)
        for h in self.handles.values():
            h.kill()
        for name, h in self.handles.items():
            code = h.poll()
            self.record.component(name, state="exited", exit_code=code, exit=describe_signal(code))


def ready_banner(plan: Plan, addresses: Addresses, run_dir: Path) -> str:
    """One line for the terminal: what serves where, and where the logs go."""
    parts = [f"{k}={getattr(addresses, k)}" for k in Addresses.__slots__ if getattr(addresses, k)]
    trainer = f"; trainer: treadle-train {plan.cfg.trainer.command}" if plan.cfg.trainer.command else ""
    return f"treadle-launch: {' '.join(parts) or 'no daemons'}{trainer}; logs in {run_dir}"
