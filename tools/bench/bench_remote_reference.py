#!/usr/bin/env python3
"""A PPO model in the trainer's ranks against the same model placed apart (issue 32): what the
placement costs a step. ``--role reference``: the KL's reference scored by a reference daemon;
``--role critic``: the critic valued and trained by a critic server.

``treadle-launch`` (local backend) runs a hf rollout daemon and ``-- ppo`` on the tiny model,
twice, interleaved. ``ranks`` keeps the model in the trainer's ranks. ``apart`` gives it
``--ref.num_gpus_per_node`` (``--critic.num_gpus_per_node``) unlike the actor's, so the launcher
serves it apart: a reference daemon of that many hf engines, scored through ``--ref.remote_url``
(one batched forward per queue of sequences); or a critic server of that many ranks, driven
through ``--critic.remote_url`` (its values while the ranks score the rest, its optimizer steps
while the actor trains). It reports the median ``time/experience``, ``time/train`` and
``time/step`` of the steps after the first, and the first step's KL (reference: 0 in the ranks,
rounding apart) or critic loss (critic: the same in both). On this CPU machine what runs apart
shares the trainer's cores; on a GPU cluster it has devices of its own, which is the point.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_remote_reference.py --json .cache/bench/remote_reference.json
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_remote_reference.py --role critic --json .cache/bench/remote_critic.json
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
    estimator = "gae" if a.role == "critic" else "group_norm"
    ppo = ["--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.input_key", "prompt",
           "--data.label_key", "label", "--reward.remote_url", str(reward), "--algo.advantage.estimator", estimator,
           "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", str(a.prompts), "--train.batch_size",
           str(8 * a.prompts), "--train.micro_batch_size", "16", "--rollout.micro_batch_size", "16",
           "--rollout.max_new_tokens", str(a.max_new_tokens), "--data.prompt_max_len", "32",
           "--data.max_samples", str(a.prompts * a.steps), "--actor.num_gpus_per_node", "1", "--ds.param_dtype", "fp32",
           "--ds.zero_stage", "0", "--algo.kl.init_coef", "0.01", "--vllm.bucket_mb", "1", "--vllm.backend", "hf",
           "--ckpt.path", str(ckpt), "--ckpt.output_dir", str(work / f"model_{where}")]
    if where == "apart":
        ppo += [f"--{'ref' if a.role == 'reference' else 'critic'}.num_gpus_per_node", str(a.apart)]
    cmd = [sys.executable, "-m", "treadle.integration.cli", "--run_dir", str(work / f"run_{where}"), "--", "rollout",
           "--backend", "hf", "--no_cpu_bind", "--", "ppo", *ppo]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=a.timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{where}: exit {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:]
    first = {"first_step_kl": rows[0]["kl"]} if a.role == "reference" else {"first_critic_loss": rows[0]["critic/loss"]}
    return {"where": where, "steps": len(rows), **first,
            **{f"{k}_s": round(statistics.median(r[f"time/{k}"] for r in later), 3) for k in ("experience", "train", "step")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (8 samples each)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--role", choices=("reference", "critic"), default="reference", help="the model placed apart")
    p.add_argument("--apart", type=int, default=2, help="the reference daemon's engines / the critic server's ranks")
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
            for where in ("ranks", "apart"):
                row = one(where, model, data, reward, work / f"r{r}", a)
                print(json.dumps(row), flush=True)
                rows.append(row)
    med = {w: {k: statistics.median(r[k] for r in rows if r["where"] == w) for k in ("experience_s", "train_s", "step_s")}
           for w in ("ranks", "apart")}
    summary = {"role": a.role, "prompts": a.prompts, "samples_per_step": 8 * a.prompts, "max_new_tokens": a.max_new_tokens,
               "apart": a.apart, "repeats": a.repeats, "median": med,
               "step_apart_vs_ranks": round(med["apart"]["step_s"] / med["ranks"]["step_s"], 3), "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
