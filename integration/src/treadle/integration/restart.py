"""Restarting a failed run from the trainer's last checkpoint (``--max_restarts``).

A launch is one or more attempts. An attempt is what a backend does once: place, start, watch,
tear everything down. When an attempt ends because a component failed (the trainer, a daemon,
or a whole Ray node with what ran on it), ``restart_decision`` says whether to run another one:

- never after success, Ctrl-C / SIGTERM (exit 130), or once ``--max_restarts`` restarts are used;
- never when the trainer itself exited with treadle-train's config-error status (2: a bad flag or
  data row, which would fail the same way again);
- never when the attempt saved no new checkpoint (``checkpoint_step`` did not advance): a failure
  that comes back before the first checkpoint of every attempt (a model that does not load, a
  daemon that cannot start, a config error under torchrun, whose own exit status hides the
  trainer's 2) stops after one attempt instead of looping, and a restart always resumes from
  further on than the last one did.

Inside an attempt, a failed trainer whose daemons still run is started again alone
(``TrainerRestarts``, used by both backends); each such restart counts against ``--max_restarts``
too, and ``run.json`` lists them in ``trainer_restarts``. Not with ``--train.colocate_all`` over
several trainer nodes: the engines there sit on the GPU ids of the trainer's parts, which a part
placed again may not get back, so the whole run restarts.

The next attempt runs the whole plan again (new placement on Ray, new daemon addresses, new
ports), the trainer with ``--ckpt.load_enable`` added when the user did not give it
(``resumed_plan``): it loads the newest complete checkpoint and its trajectory log keeps every
trajectory trained exactly once. Before it starts, the finished attempt's logs and run.json move
to ``<run_dir>/attempt-<n>/``; the top-level run.json keeps ``attempt`` (1, 2, ...) and
``attempts``: one entry per finished attempt (exit code, failed component, why, each component's
exit code, the checkpoint step, and whether and why it was restarted). The launcher's exit status
is the last attempt's.

Not here: starting or supervising components (``local``, ``ray_backend``, ``supervise``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.common.log import get_logger
from treadle.integration.plan import EXIT_INTERRUPTED, Plan, gives_flag, make_plan
from treadle.integration.supervise import Outcome

log = get_logger(__name__)
TRAINER_CONFIG_ERROR = 2
"""treadle-train's exit status for an invalid flag or data row (``treadle.trainer.cli._fail``)."""
LOAD_FLAG = "--ckpt.load_enable"
STATE_FILE = "state.json"
"""A checkpoint folder is complete once this file is in it (the trainer's ``Checkpointer``)."""


def checkpoint_step(root: str | Path | None) -> int | None:
    """The step of the newest complete checkpoint under ``root`` (the trainer's ``--ckpt.path``:
    ``step_<N>/state.json``), or None when there is none. Half-written saves (``.tmp-*``, or a
    ``step_*`` folder without its state file) do not count."""
    if root is None:
        return None
    path = Path(root)
    if not path.is_dir():
        return None
    steps = []
    for p in path.glob("step_*"):
        head, _, num = p.name.partition("_")
        if num.isdigit() and (p / STATE_FILE).is_file():
            steps.append(int(num))
    return max(steps) if steps else None


def checkpoint_root(plan: Plan) -> Path | None:
    """The trainer's checkpoint folder as this launcher sees it (relative paths: from the
    launcher's working directory), or None without a trainer."""
    ckpt = getattr(plan.trainer_cfg, "ckpt", None)
    if ckpt is None:
        return None
    return Path(ckpt.path).resolve()


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Whether to run another attempt, and why (in words, for the log and run.json)."""

    restart: bool
    why: str


def restart_decision(outcome: Outcome, *, attempt: int, max_restarts: int, trainer_exit: int | None,
                     step_before: int | None, step_after: int | None) -> Decision:
    """Whether attempt number ``attempt`` (1 = the first) that ended with ``outcome`` is followed
    by another one; ``trainer_exit``: the trainer's own exit code (None: still running when torn
    down, or no trainer); ``step_before`` / ``step_after``: ``checkpoint_step`` when the attempt
    started and ended. See the module docstring for the rules."""
    if outcome.exit_code == 0:
        return Decision(restart=False, why="finished")
    if outcome.exit_code == EXIT_INTERRUPTED:
        return Decision(restart=False, why="interrupted: a stop request never restarts")
    if attempt > max_restarts:
        return Decision(restart=False, why=f"no restarts left (--max_restarts {max_restarts})")
    if trainer_exit == TRAINER_CONFIG_ERROR:
        return Decision(restart=False, why=f"the trainer refused its config (exit status {TRAINER_CONFIG_ERROR}): "
                                           "it would fail the same way again")
    if step_after is None or (step_before is not None and step_after <= step_before):
        since = "none saved" if step_after is None else f"still step {step_after}"
        return Decision(restart=False, why=f"no new checkpoint during attempt {attempt} ({since}): a failure "
                                           "before the first checkpoint is not retried")
    return Decision(restart=True, why=f"{outcome.failed or 'the launch'} failed ({outcome.reason}); resuming "
                                      f"from the checkpoint of step {step_after}")


def resumed_plan(plan: Plan) -> Plan:
    """``plan`` with ``--ckpt.load_enable`` added to the trainer's flags (unless the user gave it,
    or its ``--ckpt.no_load_enable`` twin: then theirs stands)."""
    t = plan.cfg.trainer
    if t.command is None or gives_flag(t.args, LOAD_FLAG):
        return plan
    cfg = dataclasses.replace(plan.cfg, trainer=dataclasses.replace(t, args=(*t.args, LOAD_FLAG)))
    return make_plan(cfg)


class TrainerRestarts:
    """Restarts of the trainer alone within one attempt, its daemons kept serving.

    When the part that failed is the trainer's (``trainer``, ``trainer.1``, ...: its process, or
    the Ray node under it) and every daemon still runs, the backend stops the trainer's other parts
    and starts the trainer again from its last checkpoint (``resumed_plan``) instead of ending the
    attempt: the engines keep their loaded models and the weights they hold (the resumed trainer
    sends its own as a newer version first), so a restart costs a trainer start, not a whole
    launch. The same rules as for attempts decide (``restart_decision``: a new checkpoint since the
    trainer started, not its config-error status), and each one uses one of ``--max_restarts``.
    A daemon's failure still ends the attempt (``run_attempts`` then starts everything again).
    """

    def __init__(self, plan: Plan, prior: dict[str, Any] | None) -> None:
        prior = prior or {}
        self.plan = plan
        self.root = checkpoint_root(plan)
        self.left = int(prior.get("restarts_left", plan.cfg.max_restarts))
        self.done: list[dict[str, Any]] = []
        self.step = checkpoint_step(self.root)  # where the running trainer started from

    def next_plan(self, outcome: Outcome, trainer_exit: int | None, daemons_alive: bool) -> Plan | None:
        """The plan to start the trainer again with, or None when the attempt ends with ``outcome``."""
        failed = outcome.failed or ""
        if failed.split(".")[0] != "trainer" or not daemons_alive or self.left <= 0:
            return None
        if self.plan.colocate and self.plan.cfg.trainer.nodes > 1:
            # The engines sit in the trainer's bundles on the GPU ids its parts had: a part placed
            # again (its node lost) may get others, so the whole plan is placed again instead.
            log.warning("%s failed with engines colocated on the trainer's nodes: restarting the whole run", failed)
            return None
        after = checkpoint_step(self.root)
        decision = restart_decision(outcome, attempt=1, max_restarts=1, trainer_exit=trainer_exit,
                                    step_before=self.step, step_after=after)
        if not decision.restart:
            return None
        self.left -= 1
        self.done.append({"failed": failed, "reason": outcome.reason, "trainer_exit": trainer_exit,
                          "checkpoint_step": after, "at": time.time()})
        log.warning("restarting the trainer alone (the daemons keep serving): %s", decision.why,
                    extra={"fields": {"restart": len(self.done), "restarts_left": self.left}})
        print(f"treadle-launch: {failed} failed ({outcome.reason}); restarting the trainer from step {after}, "
              "daemons kept", flush=True)
        self.step = after
        self.plan = resumed_plan(self.plan)
        return self.plan


def archive_trainer_logs(run_dir: Path, names: tuple[str, ...], restart: int) -> None:
    """``<part>.log`` -> ``<part>.restart-<n>.log`` for each trainer part, before it starts again."""
    for name in names:
        p = run_dir / f"{name}.log"
        if p.is_file():
            p.replace(run_dir / f"{name}.restart-{restart}.log")


def archive_attempt(run_dir: Path, attempt: int) -> Path:
    """Move attempt ``attempt``'s component logs and run.json into ``<run_dir>/attempt-<n>/``."""
    dest = run_dir / f"attempt-{attempt}"
    dest.mkdir(exist_ok=True)
    for p in [*run_dir.glob("*.log"), run_dir / "run.json"]:
        if p.is_file():
            shutil.move(str(p), dest / p.name)
    return dest


def _read_record(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


Backend = Callable[[Plan, Path, threading.Event, dict[str, Any]], Outcome]
"""Runs one attempt: (plan, run dir, stop event, fields run.json starts with) -> outcome."""


def run_attempts(plan: Plan, run_dir: Path, stop: threading.Event, backend: Backend) -> Outcome:
    """Run ``plan`` with ``backend``, then again from the last checkpoint while
    ``restart_decision`` says so; the last attempt's outcome."""
    max_restarts = plan.cfg.max_restarts
    root = checkpoint_root(plan)
    history: list[dict[str, Any]] = []
    attempt, in_place = 1, 0  # in_place: trainer restarts inside attempts (``TrainerRestarts``)
    while True:
        before = checkpoint_step(root)
        prior = {"attempt": attempt, "attempts": history,
                 "restarts_left": max_restarts - (attempt - 1) - in_place} if max_restarts else {}
        outcome = backend(plan, run_dir, stop, prior)
        record = _read_record(run_dir)
        in_place += len(record.get("trainer_restarts", []))
        comps = record.get("components", {})
        codes = {n: c.get("exit_code") for n, c in comps.items()}
        failed = outcome.failed or ""
        trainer_exit = codes.get(failed) if failed.split(".")[0] == "trainer" else None
        after = checkpoint_step(root)
        decision = restart_decision(outcome, attempt=attempt + in_place, max_restarts=max_restarts,
                                    trainer_exit=trainer_exit, step_before=before, step_after=after)
        if max_restarts == 0:
            return outcome
        history.append({"attempt": attempt, "exit_code": outcome.exit_code, "failed": outcome.failed,
                        "reason": outcome.reason, "exit_codes": codes, "checkpoint_step": after,
                        "restarted": decision.restart, "why": decision.why})
        if not decision.restart:
            if attempt > 1 or outcome.exit_code:
                log.info("not restarting: %s", decision.why, extra={"fields": {"attempt": attempt}})
            _write_history(run_dir, attempt, history)
            return outcome
        log.warning("restarting the run: %s", decision.why,
                    extra={"fields": {"attempt": attempt + 1, "max_restarts": max_restarts,
                                      "exit_codes": codes}})
        print(f"treadle-launch: attempt {attempt} failed ({outcome.failed}: {outcome.reason}); restart "
              f"{attempt} of {max_restarts} from step {after} in {plan.cfg.restart_backoff_s:g} s", flush=True)
        archive_attempt(run_dir, attempt)
        if stop.wait(plan.cfg.restart_backoff_s):
            outcome = Outcome(exit_code=EXIT_INTERRUPTED, reason="interrupted")
            history[-1].update(restarted=False, why="interrupted during --restart_backoff_s")
            _write_history(run_dir, attempt, history, ended=time.time(), exit_code=EXIT_INTERRUPTED,
                           reason="interrupted")
            return outcome
        plan = resumed_plan(plan) if after is not None else plan
        attempt += 1


def _write_history(run_dir: Path, attempt: int, history: list[dict[str, Any]], **more: Any) -> None:
    """The attempts into the top-level run.json (kept whole: a new one if the attempt's moved away)."""
    data = _read_record(run_dir)
    data.update(attempt=attempt, attempts=history, **more)
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(run_dir / "run.json")
