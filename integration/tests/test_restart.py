"""``--max_restarts``: a failed run starts again from the trainer's last checkpoint.

Fast part: the rules (``restart_decision``), the resumed plan (``--ckpt.load_enable`` added), and
the attempt loop (``run_attempts``) driven by a fake backend standing in for local / Ray (it
writes run.json and checkpoint folders as the real ones do and returns a scripted outcome): a
restart after progress, none after a config error, without progress, or after Ctrl-C; run.json's
attempt history and the archived logs. Refusals at parse time. And one real launch (local
backend, real trainer): a trainer exiting 2 on a bad data row is not restarted.

Slow part (test_ray_multinode's three nodes): the engines' node is removed after the first
checkpoint and a node with the same labels added back; with ``--max_restarts 1`` the launcher
tears down, places the plan again, resumes from the checkpoint and finishes every step with exit
0, each trajectory trained once.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from treadle.common.config import ConfigError
from treadle.integration.config import parse_launch
from treadle.integration.plan import EXIT_CODES, EXIT_INTERRUPTED, flag_value, make_plan
from treadle.integration.restart import (
    TRAINER_CONFIG_ERROR,
    checkpoint_step,
    restart_decision,
    resumed_plan,
    run_attempts,
)
from treadle.integration.supervise import Outcome, RunRecord

DAEMON_FAILED = Outcome(exit_code=EXIT_CODES["rollout"], failed="rollout", reason="killed by SIGKILL")


def plan_for(ckpt: Path, *launcher: str, ppo: tuple[str, ...] = ()):
    return make_plan(parse_launch([
        "--max_restarts", "2", "--restart_backoff_s", "0", *launcher, "--", "rollout", "--", "ppo",
        "--actor.model_name_or_path", "M", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "math",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
        "--rollout.batch_size", "2", "--train.batch_size", "8", "--ckpt.save_steps", "1",
        "--ckpt.path", str(ckpt), *ppo]))


def save(ckpt: Path, step: int, *, complete: bool = True) -> None:
    d = ckpt / f"step_{step:08d}"
    d.mkdir(parents=True)
    if complete:
        (d / "state.json").write_text("{}")


def test_the_newest_complete_checkpoint_is_what_counts(tmp_path):
    assert checkpoint_step(tmp_path / "none") is None
    save(tmp_path, 3)
    save(tmp_path, 12)
    save(tmp_path, 14, complete=False)  # being written, or killed mid-save
    (tmp_path / ".tmp-step_00000015").mkdir()
    assert checkpoint_step(tmp_path) == 12


@pytest.mark.parametrize("outcome, kw, restart, why", [
    (DAEMON_FAILED, {}, True, "rollout failed (killed by SIGKILL); resuming from the checkpoint of step 4"),
    (Outcome(exit_code=0), {}, False, "finished"),
    (Outcome(exit_code=EXIT_INTERRUPTED, reason="interrupted"), {}, False, "a stop request never restarts"),
    (DAEMON_FAILED, {"attempt": 3}, False, "no restarts left (--max_restarts 2)"),
    (Outcome(exit_code=10, failed="trainer", reason="exit status 2"), {"trainer_exit": TRAINER_CONFIG_ERROR},
     False, "the trainer refused its config"),
    (DAEMON_FAILED, {"step_before": 4}, False, "no new checkpoint during attempt 1 (still step 4)"),
    (DAEMON_FAILED, {"step_after": None, "step_before": None}, False, "no new checkpoint during attempt 1 (none"),
])
def test_when_a_failed_attempt_is_restarted(outcome, kw, restart, why):
    args = {"attempt": 1, "max_restarts": 2, "trainer_exit": None, "step_before": 2, "step_after": 4, **kw}
    decision = restart_decision(outcome, **args)
    assert decision.restart is restart and why in decision.why


def test_the_resumed_plan_loads_the_checkpoint_unless_the_user_said(tmp_path):
    plan = plan_for(tmp_path)
    again = resumed_plan(plan)
    assert again.trainer_cfg.ckpt.load_enable and again.cfg.trainer.args[-1] == "--ckpt.load_enable"
    assert resumed_plan(again).cfg.trainer.args == again.cfg.trainer.args  # given once
    theirs = plan_for(tmp_path, ppo=("--ckpt.no_load_enable",))
    assert resumed_plan(theirs).cfg.trainer.args == theirs.cfg.trainer.args


class FakeBackend:
    """Stands in for run_local / run_ray: records run.json as they do (RunRecord with the loop's
    prior fields, one log per component), saves the scripted checkpoints, returns the scripted
    outcomes; remembers the trainer flags of each attempt."""

    def __init__(self, ckpt: Path, script: list[tuple[Outcome, int | None, dict[str, int]]]) -> None:
        self.ckpt = ckpt
        self.script = list(script)
        self.trainer_args: list[tuple[str, ...]] = []

    def __call__(self, plan, run_dir: Path, stop: threading.Event, prior: dict) -> Outcome:
        outcome, saved, codes = self.script.pop(0)
        self.trainer_args.append(plan.cfg.trainer.args)
        record = RunRecord(run_dir, "fake", prior)
        for name, code in codes.items():
            (run_dir / f"{name}.log").write_text(f"attempt {prior.get('attempt', 1)}\n")
            record.component(name, state="exited", exit_code=code)
        if saved is not None:
            save(self.ckpt, saved)
        record.update(exit_code=outcome.exit_code, failed=outcome.failed)
        return outcome


def test_a_failed_run_restarts_from_its_checkpoint_and_records_each_attempt(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    run.mkdir()
    backend = FakeBackend(ckpt, [
        (DAEMON_FAILED, 1, {"rollout": -9, "trainer": -15}),
        (Outcome(exit_code=0), 3, {"rollout": 0, "trainer": 0}),
    ])
    outcome = run_attempts(plan_for(ckpt), run, threading.Event(), backend)

    assert outcome.exit_code == 0
    assert "--ckpt.load_enable" not in backend.trainer_args[0]
    assert backend.trainer_args[1][-1] == "--ckpt.load_enable"
    record = json.loads((run / "run.json").read_text())
    assert record["attempt"] == 2 and record["exit_code"] == 0
    first, last = record["attempts"]
    assert first["attempt"] == 1 and first["restarted"] and first["exit_code"] == 11 and first["failed"] == "rollout"
    assert first["exit_codes"] == {"rollout": -9, "trainer": -15} and first["checkpoint_step"] == 1
    assert last == {**last, "attempt": 2, "restarted": False, "why": "finished", "exit_code": 0}
    # the first attempt's logs and record moved aside; the top level is the last attempt's
    assert (run / "attempt-1" / "rollout.log").read_text() == "attempt 1\n"
    assert json.loads((run / "attempt-1" / "run.json").read_text())["attempt"] == 1
    assert (run / "trainer.log").read_text() == "attempt 2\n"


def test_a_config_error_or_a_failure_without_progress_is_not_restarted(tmp_path):
    ckpt = tmp_path / "ckpt"
    config_error = Outcome(exit_code=EXIT_CODES["trainer"], failed="trainer", reason="exit status 2")
    for name, script in (("config", [(config_error, None, {"rollout": 0, "trainer": TRAINER_CONFIG_ERROR})]),
                         ("stuck", [(DAEMON_FAILED, 2, {"rollout": -9, "trainer": -15}),
                                    (DAEMON_FAILED, None, {"rollout": -9, "trainer": -15})])):
        run = tmp_path / name
        run.mkdir()
        backend = FakeBackend(ckpt, script)
        outcome = run_attempts(plan_for(ckpt), run, threading.Event(), backend)
        assert not backend.script, name  # every scripted attempt ran, and no more
        record = json.loads((run / "run.json").read_text())
        assert outcome.exit_code == record["attempts"][-1]["exit_code"] == script[-1][0].exit_code
        assert not record["attempts"][-1]["restarted"]
    assert "refused its config" in json.loads((tmp_path / "config" / "run.json").read_text())["attempts"][0]["why"]
    stuck = json.loads((tmp_path / "stuck" / "run.json").read_text())["attempts"]
    assert [a["restarted"] for a in stuck] == [True, False] and "still step 2" in stuck[1]["why"]


def test_a_stop_during_the_backoff_ends_the_launch(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    run.mkdir()
    stop = threading.Event()
    backend = FakeBackend(ckpt, [(DAEMON_FAILED, 1, {"rollout": -9})])
    plan = plan_for(ckpt, "--restart_backoff_s", "30")
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    outcome = run_attempts(plan, run, stop, backend)
    assert outcome.exit_code == EXIT_INTERRUPTED and time.monotonic() - started < 30
    assert json.loads((run / "run.json").read_text())["attempts"][0]["why"] == "interrupted during --restart_backoff_s"


def test_without_max_restarts_one_failure_ends_the_launch_as_before(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    run.mkdir()
    backend = FakeBackend(ckpt, [(DAEMON_FAILED, 1, {"rollout": -9})])
    plan = plan_for(ckpt, "--max_restarts", "0")
    assert run_attempts(plan, run, threading.Event(), backend) == DAEMON_FAILED
    assert "attempts" not in json.loads((run / "run.json").read_text())


@pytest.mark.parametrize("argv, message", [
    (["--max_restarts", "-1", "--", "rollout"], "--max_restarts must be >= 0"),
    (["--max_restarts", "1", "--", "rollout"], "add a trainer section"),
    (["--restart_backoff_s", "-1", "--", "rollout"], "--restart_backoff_s must be >= 0"),
])
def test_restart_flags_are_checked_at_parse_time(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_launch(argv)


def test_ppo_max_restarts_is_the_launchers_max_restarts(tmp_path):
    """``-- ppo --train.max_restarts N`` (what train_ppo_ray users give): the launcher's
    ``--max_restarts N``, and the trainer does not get the flag; given both ways it must agree."""
    from treadle.integration.train_ppo_ray import launch_config
    from treadle.trainer.config import parse_ppo

    ppo = ["--actor.model_name_or_path", "M", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "math",
           "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size",
           "2", "--train.batch_size", "8", "--ckpt.path", str(tmp_path), "--ckpt.save_steps", "1",
           "--train.max_restarts", "2"]
    plan = make_plan(parse_launch(["--", "ppo", *ppo]))
    assert plan.cfg.max_restarts == 2 and "--train.max_restarts" not in plan.cfg.trainer.args
    assert make_plan(parse_launch(["--max_restarts", "2", "--", "ppo", *ppo])).cfg.max_restarts == 2
    with pytest.raises(ConfigError, match=r"--train\.max_restarts 2 but --max_restarts 1: give it once"):
        make_plan(parse_launch(["--max_restarts", "1", "--", "ppo", *ppo]))
    assert make_plan(launch_config(ppo, parse_ppo(ppo), gpus=False)).cfg.max_restarts == 2  # train_ppo_ray


def test_restarts_need_checkpoints_during_the_run(tmp_path):
    with pytest.raises(ConfigError, match="--ckpt.save_steps -1"):
        plan_for(tmp_path, ppo=("--ckpt.save_steps", "-1"))
    assert flag_value(list(plan_for(tmp_path).cfg.trainer.args), "--ckpt.save_steps") == "1"


def test_a_trainer_refusing_a_data_row_is_not_restarted(tiny, helpers, tmp_path):
    """The local backend, a real trainer and no daemons: a prompt row without its key makes
    treadle-train exit 2 before its first step; with --max_restarts 2 the launcher runs it once."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"nope": 1}\n')
    run = tmp_path / "run"
    proc = helpers.launch(["--run_dir", str(run), "--max_restarts", "2", "--restart_backoff_s", "0", "--", "ppo",
                           "--actor.model_name_or_path", str(tiny), "--data.prompt_dataset", str(bad),
                           "--data.input_key", "prompt", "--reward.remote_url", "math", "--algo.advantage.estimator",
                           "group_norm", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "1",
                           "--train.batch_size", "2", "--ckpt.save_steps", "1", "--ckpt.path", str(tmp_path / "ckpt"),
                           "--ckpt.output_dir", str(tmp_path / "model"), "--vllm.backend", "hf"])
    out = helpers.finish(proc, 300)
    assert proc.returncode == EXIT_CODES["trainer"], out[-4000:]
    assert "not restarting: the trainer refused its config" in out
    record = helpers.run_json(run)
    assert record["attempt"] == 1 and not (run / "attempt-1").exists()
    (only,) = record["attempts"]
    assert only["exit_codes"] == {"trainer": TRAINER_CONFIG_ERROR} and not only["restarted"]
    assert "row 1: key 'prompt'" in (run / "trainer.log").read_text()


def test_a_trainer_killed_mid_run_restarts_alone_while_its_daemons_keep_serving(tiny, task, helpers, tmp_path):
    """The local backend with a rollout and a reward daemon and a critic server (gae, its critic on 2
    ranks of its own), ``--max_restarts 1``: the trainer is SIGKILLed after its first checkpoint.
    The launcher starts the trainer again from that checkpoint in the same attempt, the daemons
    untouched (same pids, no restart of the run; the critic server keeps its model and loads the
    checkpoint's critic state); the run finishes every step with exit 0 and trains each trajectory once."""
    import os
    import signal

    from treadle.integration.restart import checkpoint_step
    from treadle.trainer.rl.trajlog import TrajectoryLog

    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    flags = helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf", "--data.max_samples", "8",
                              "--ckpt.save_steps", "1", "--critic.num_gpus_per_node", "2")  # 4 steps, a checkpoint after each
    values = {"--algo.advantage.estimator": "gae", "--train.micro_batch_size": "4"}
    flags = [values.get(flags[i - 1], f) if i else f for i, f in enumerate(flags)]
    proc = helpers.launch(["--run_dir", str(run), "--max_restarts", "1", "--restart_backoff_s", "0",
                           "--stop_timeout_s", "10", "--", "rollout", "--backend", "hf", "--no_cpu_bind",
                           "--", "rewards", "--functions", str(task.reward), "--workers.num_workers", "1",
                           "--", "ppo", *flags])
    helpers.wait_for(lambda: checkpoint_step(ckpt), 300, proc, "the first checkpoint")
    before = helpers.run_json(run)["components"]
    os.killpg(before["trainer"]["pid"], signal.SIGKILL)
    out = helpers.finish(proc, 300)
    assert proc.returncode == 0, out[-6000:]
    record = helpers.run_json(run)
    assert record["attempt"] == 1 and len(record["attempts"]) == 1  # one attempt: not a whole restart
    (restart,) = record["trainer_restarts"]
    assert restart["failed"] == "trainer" and restart["checkpoint_step"] >= 1
    comps = record["components"]
    kept = ("rollout", "rewards", "critic")
    assert {n: comps[n]["pid"] for n in kept} == {n: before[n]["pid"] for n in kept}
    assert comps["trainer"]["pid"] != before["trainer"]["pid"] and "--ckpt.load_enable" in comps["trainer"]["cmd"]
    assert (run / "trainer.restart-1.log").is_file() and "restarting the trainer from step" in out
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 4 and {r["step"] for r in rows} == {1, 2, 3, 4}
    assert all(r["critic/loss"] > 0 for r in rows)
    with TrajectoryLog(ckpt / "trajectories") as tl:
        lineage = tl.lineage(4)
        pending = tl.recover(4).pending
    used = [u for step in sorted(lineage) for u in lineage[step]]
    assert sorted(lineage) == [1, 2, 3, 4] and len(used) == 4 * 8 and len(set(used)) == len(used) and not pending
