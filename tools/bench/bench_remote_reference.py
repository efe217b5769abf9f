#!/usr/bin/env python3
"""PPO's reference in the trainer's ranks against a reference daemon of its own (issue 32): what
scoring the KL's reference apart costs a step.

``treadle-launch`` (local backend) runs a hf rollout daemon and ``-- ppo`` GRPO on the tiny model
with a KL term, twice, interleaved: ``ranks`` keeps the reference in the trainer's ranks (a replica
under ZeRO-0, one batched forward per micro-batch); ``daemon`` gives it ``--ref.num_gpus_per_node``
unlike the actor's, so the launcher serves it in a reference daemon of that many hf engines and the
ranks score through ``--ref.remote_url`` (one forward per sequence, spread over the engines). It
reports the median ``time/experience`` (where the reference is scored) and ``time/step`` of the
steps after the first, and the first step's KL (0 in the ranks, rounding apart). On this CPU
machine the daemon's engines share the trainer's cores; on a GPU cluster they have devices of
their own, which is the point of the placement.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_remote_reference.py --json .cache/bench/remote_reference.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))


def one(where: str, model: Path, data: Path, reward: Path, work: Path, a: argparse.Namespace) -> dict:
    ckpt = work / f"ckpt_{where}"
    ppo = ["--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.input_key", "prompt",
           "--data.label_key", "label", "--reward.remote_url", str(reward), "--algo.advantage.estimator", "group_norm",
           "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", str(a.prompts), "--train.batch_size",
           str(8 * a.prompts), "--train.micro_batch_size", "16", "--rollout.micro_batch_size", "16",
           "--rollout.max_new_tokens", str(a.max_new_tokens), "--data.prompt_max_len", "32",
           "--data.max_samples", str(a.prompts * a.steps), "--actor.num_gpus_per_node", "1", "--ds.param_dtype", "fp32",
           "--ds.zero_stage", "0", "--algo.kl.init_coef", "0.01", "--vllm.bucket_mb", "1", "--vllm.backend", "hf",
           "--ckpt.path", str(ckpt), "--ckpt.output_dir", str(work / f"model_{where}")]
    if where == "daemon":
        ppo += ["--ref.num_gpus_per_node", str(a.ref_engines)]
    cmd = [sys.executable, "-m", "treadle.integration.cli", "--run_dir", str(work / f"run_{where}"), "--", "rollout",
           "--backend", "hf", "--no_cpu_bind", "--", "ppo", *ppo]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=a.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{where}: exit {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:]
    return {"where": where, "steps": len(rows), "first_step_kl": rows[0]["kl"],
            "experience_s": round(statistics.median(r["time/experience"] for r in later), 3),
            "step_s": round(statistics.median(r["time/step"] for r in later), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (8 samples each)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ref-engines", type=int, default=2, help="the reference daemon's engines")
    p.add_argument("--repeats", type=int, default=1, help="runs of each kind, interleaved")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--json", default="")
    a = p.parse_args()
    from digit_task import digit_task  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="treadle_bench_ref_") as tmp:
        work = Path(tmp)
        model, data, reward = digit_task(work, a.prompts * a.steps)
        rows = []
        for r in range(a.repeats):
            for where in ("ranks", "daemon"):
                row = one(where, model, data, reward, work / f"r{r}", a)
                print(json.dumps(row), flush=True)
                rows.append(row)
    med = {w: {k: statistics.median(r[k] for r in rows if r["where"] == w) for k in ("experience_s", "step_s")}
           for w in ("ranks", "daemon")}
    summary = {"prompts": a.prompts, "samples_per_step": 8 * a.prompts, "max_new_tokens": a.max_new_tokens,
               "ref_engines": a.ref_engines, "repeats": a.repeats, "median": med,
               "step_daemon_vs_ranks": round(med["daemon"]["step_s"] / med["ranks"]["step_s"], 3), "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
