#!/usr/bin/env python3
"""A trainer that restarts alone against a whole-run restart (issue 32): from the failure to the
run's next trained step.

``treadle-launch --max_restarts 1`` (local backend) runs a rollout daemon (``--backend hf`` or
``vllm``), a reward daemon (a rule reward in a function file) and ``-- ppo`` on the tiny model,
with a checkpoint after every step. Once the first checkpoint is on disk the bench SIGKILLs one
component's process group, and times until the next line of the trainer's ``metrics.jsonl``:

- ``trainer``: the trainer alone fails; the launcher starts it again from its checkpoint while
  the daemons keep serving, their engines loaded (``restart.TrainerRestarts``);
- ``rollout``: a daemon fails; the launcher stops the run and starts all of it again from the
  checkpoint (``restart.run_attempts``): every daemon and engine loads again.

Each run finishes with exit 0 (asserted). Figures on this machine are the CPU's, with the tiny
model; with vLLM on a GPU the whole-run restart adds the engines' start (the benchmark's vLLM
daemon took 92 s to get ready on an H100, docs/benchmarks.md), which the trainer-alone restart skips.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_restart.py --backend hf --json .cache/bench/restart_hf.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))


def lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def checkpoint_step(ckpt: Path) -> int | None:
    from treadle.integration.restart import checkpoint_step as step  # noqa: PLC0415

    return step(ckpt)


def one(kill: str, backend: str, model: Path, data: Path, reward: Path, work: Path, timeout_s: float) -> dict:
    """Launch, kill ``kill`` after the first checkpoint, time until the next metrics line."""
    run, ckpt = work / f"run_{kill}", work / f"ckpt_{kill}"
    ppo = ["--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.input_key", "prompt",
           "--data.label_key", "label", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt",
           "4", "--rollout.batch_size", "2", "--train.batch_size", "8", "--train.micro_batch_size", "8",
           "--rollout.micro_batch_size", "8", "--rollout.max_new_tokens", "8", "--data.prompt_max_len", "32",
           "--data.max_samples", "8", "--actor.num_gpus_per_node", "1", "--ds.param_dtype", "fp32",
           "--ds.zero_stage", "0", "--algo.kl.init_coef", "0", "--vllm.bucket_mb", "1", "--vllm.backend", backend,
           "--ckpt.path", str(ckpt), "--ckpt.output_dir", str(work / f"model_{kill}"), "--ckpt.save_steps", "1"]
    cmd = [sys.executable, "-m", "treadle.integration.cli", "--run_dir", str(run), "--max_restarts", "1",
           "--restart_backoff_s", "0", "--stop_timeout_s", "10", "--", "rollout", "--backend", backend,
           "--no_cpu_bind", "--", "rewards", "--functions", str(reward), "--workers.num_workers", "1", "--", "ppo", *ppo]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    metrics = ckpt / "metrics.jsonl"
    try:
        while checkpoint_step(ckpt) is None:
            if proc.poll() is not None or time.monotonic() - started > timeout_s:
                raise RuntimeError(f"no checkpoint ({kill}):\n{proc.stdout.read()[-4000:]}")
            time.sleep(0.05)
        first_step_s = time.monotonic() - started
        pid = json.loads((run / "run.json").read_text())["components"][kill]["pid"]
        seen = lines(metrics)
        killed = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        while lines(metrics) <= seen:
            if proc.poll() is not None or time.monotonic() - killed > timeout_s:
                raise RuntimeError(f"no step after the kill ({kill}):\n{proc.stdout.read()[-4000:]}")
            time.sleep(0.05)
        recovery_s = time.monotonic() - killed
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed ({kill}, exit {proc.returncode}):\n{out[-4000:]}")
    record = json.loads((run / "run.json").read_text())
    return {"kill": kill, "backend": backend, "recovery_s": round(recovery_s, 2),
            "first_checkpoint_s": round(first_step_s, 2), "attempts": len(record["attempts"]),
            "trainer_restarts": len(record.get("trainer_restarts", []))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="the rollout daemon's engines")
    p.add_argument("--repeats", type=int, default=1, help="runs of each kind, interleaved")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default="")
    a = p.parse_args()
    from digit_task import digit_task  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="treadle_bench_restart_") as tmp:
        work = Path(tmp)
        model, data, reward = digit_task(work, 32)
        rows = []
        for r in range(a.repeats):
            for kill in ("trainer", "rollout"):
                row = one(kill, a.backend, model, data, reward, work / f"r{r}", a.timeout_s)
                print(json.dumps(row), flush=True)
                rows.append(row)
    med = {}
    for k in ("trainer", "rollout"):
        times = sorted(r["recovery_s"] for r in rows if r["kill"] == k)
        med[k] = times[len(times) // 2]
    summary = {"backend": a.backend, "repeats": a.repeats, "median_recovery_s": med,
               "trainer_alone_vs_whole_run": round(med["trainer"] / med["rollout"], 3), "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
