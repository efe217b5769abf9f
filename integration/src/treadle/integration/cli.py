"""``treadle-launch``: start the rollout, reward and agent daemons and the trainer together.

    treadle-launch --run_dir runs/grpo \\
        -- rollout --backend hf \\
        -- rewards --functions reward.py \\
        -- ppo --actor.model_name_or_path M --data.prompt_dataset p.jsonl --algo.advantage.estimator group_norm ...
    treadle-launch --backend ray --trainer.ranks 8 --trainer.num_gpus_per_rank 1 --rollout.num_gpus 8 \\
        -- rollout -- ppo --actor.model_name_or_path M --vllm.num_engines 4 --vllm.tensor_parallel_size 2 ...
    treadle-launch --help

``main()`` parses (the launcher's flags, then every section with its component's own config: a
bad flag anywhere fails before anything starts), runs the backend, and always tears everything
down. Exit status: 0 when the trainer finished (or, without a trainer, never: daemons serve until
Ctrl-C, which exits 130); 10 trainer, 11 rollout, 12 rewards, 13 agents, 14 reference when that
component failed; 2 for invalid flags; 1 when the launcher itself failed. With ``--max_restarts N`` a run
whose component failed is started again from the trainer's last checkpoint, up to N times
(``restart``); the exit status is then the last attempt's. Each component's log and ``run.json``
are in the run directory (an earlier attempt's in ``attempt-<n>/``).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treadle.common import env
from treadle.common.config import ConfigError, dump_yaml
from treadle.common.log import get_logger, setup_logging
from treadle.integration.config import LaunchConfig, parse_launch
from treadle.integration.plan import EXIT_LAUNCH_ERROR, Plan, make_plan
from treadle.integration.restart import run_attempts
from treadle.integration.supervise import Outcome

log = get_logger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_dir_of(cfg: LaunchConfig) -> Path:
    """The run directory, created: ``--run_dir`` or ``<TREADLE_RUN_DIR>/launch-<UTC time>``."""
    path = Path(cfg.run_dir) if cfg.run_dir else Path(env.get("TREADLE_RUN_DIR")) / time.strftime(
        "launch-%Y%m%d-%H%M%S", time.gmtime())
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def install_stop_handlers(stop: threading.Event) -> None:
    """Ctrl-C, SIGTERM and SIGHUP set ``stop``; the supervisor then tears down (bounded by --stop_timeout_s)."""
    def handler(signum: int, frame: object) -> None:
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def run_once(plan: Plan, run_dir: Path, stop: threading.Event, prior: dict[str, Any]) -> Outcome:
    """One attempt of ``plan`` on its backend (Ray imported only for the ray backend)."""
    if plan.cfg.backend == "ray":
        from treadle.integration.ray_backend import run_ray  # noqa: PLC0415

        return run_ray(plan, run_dir, stop, prior)
    from treadle.integration.local import run_local  # noqa: PLC0415
    from treadle.integration.procs import become_subreaper, kill_children, reap  # noqa: PLC0415

    become_subreaper()  # orphans of the components come to us, so the sweep below finds them
    try:
        return run_local(plan, run_dir, stop, prior)
    finally:
        if kill_children():
            log.warning("killed leftover processes of the components")
        time.sleep(0.1)
        reap()


def launch(plan: Plan, run_dir: Path, stop: threading.Event) -> Outcome:
    """Run ``plan``, and again from the trainer's last checkpoint after a failure while
    ``--max_restarts`` allows (``restart``)."""
    dump_yaml(plan.cfg, run_dir / "launch.yaml")
    return run_attempts(plan, run_dir, stop, run_once)


def report(outcome: Outcome, run_dir: Path) -> str:
    if outcome.exit_code == 0:
        return f"treadle-launch: done; logs and run.json in {run_dir}"
    if outcome.failed:
        return (f"treadle-launch: {outcome.failed} failed ({outcome.reason}); everything was stopped; "
                f"see {run_dir / (outcome.failed + '.log')}")
    return f"treadle-launch: stopped ({outcome.reason or 'launcher error'}); logs in {run_dir}"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    try:
        plan = make_plan(parse_launch(args))
    except ConfigError as e:
        print(f"treadle-launch: error: {e}", file=sys.stderr)
        return 2
    run_dir = run_dir_of(plan.cfg)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        outcome = launch(plan, run_dir, stop)
    except ConfigError as e:  # found while placing (e.g. a component landed on another node)
        print(f"treadle-launch: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        log.error("treadle-launch failed: %s", e, exc_info=e)
        outcome = Outcome(exit_code=EXIT_LAUNCH_ERROR, reason=f"{type(e).__name__}: {e}")
    print(report(outcome, run_dir), file=sys.stderr if outcome.exit_code else sys.stdout, flush=True)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
