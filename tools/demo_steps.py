"""The `make demo` steps' machinery: the recipe, the command lines, child processes, the daemon.

``Recipe`` holds every size and rate of the demo; ``sft_command`` / ``ppo_command`` /
``serve_command`` turn it into the exact ``treadle-train`` and ``treadle-rollout`` command lines
(pure, so tests pin them). ``run_logged`` runs a trainer as a child process with its output in a
log file and drives a progress bar from the ``metrics.jsonl`` the trainer appends to. ``Daemon``
owns one ``treadle-rollout serve`` process (vLLM's CPU build) and ``evaluate`` scores greedy and
sampled answers from it with the verifier of ``demo_task``.

Not here: the dataset (``demo_task``), the table and the PNG (``demo_report``), the order of the
steps (``demo.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo_task import parse_prompt, score

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """Sizes and rates of the demo (defaults: measured to fit 10 minutes on 2 busy cores)."""

    seed: int = 0  # dataset, SFT and RL seeds
    sft_steps: int = 1500  # SFT optimizer steps (one epoch of sft_steps * sft_batch generated rows)
    sft_batch: int = 32  # SFT rows per optimizer step
    sft_lr: float = 3e-3  # SFT peak learning rate (cosine to 10%)
    rl_steps: int = 96  # GRPO steps (3 passes over the 1,400 training problems)
    rl_prompts: int = 32  # prompts per GRPO step
    group_size: int = 8  # samples per prompt (GRPO's group)
    rl_lr: float = 1e-4  # GRPO learning rate (constant after 5% warm-up); 3e-4 already unlearns
    kl_coef: float = 0.0  # KL loss coefficient against the SFT model; 0: no reference model runs
    max_new_tokens: int = 12  # "\boxed{108}" + <|im_end|> is 10 tokens
    eval_every: int = 12  # trainer's greedy pass@1 on the eval split every this many GRPO steps
    sampled_n: int = 4  # samples per eval prompt for the sampled (temperature 1) accuracy

    def __post_init__(self) -> None:
        for name in ("sft_steps", "sft_batch", "rl_steps", "rl_prompts", "eval_every", "sampled_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO normalises within a group), got {self.group_size}")

    def episodes(self, num_prompts: int) -> tuple[int, int]:
        """(passes over the RL prompts, prompts used) that give exactly ``rl_steps`` steps."""
        wanted = self.rl_steps * self.rl_prompts
        passes = math.ceil(wanted / num_prompts)
        return passes, math.ceil(wanted / passes)


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def serve_command(model: Path, endpoint: str, seed: int, gpu: bool = False) -> list[str]:
    """One vLLM engine: on CPU fp32 like the trainer (so its logprobs match), unpinned (the
    trainer and the engine take turns on the same two cores); ``gpu``: bf16 on GPU 0, beside the
    trainer, eager (answers of 12 tokens: CUDA graphs would cost more start-up than they save),
    with a fixed 2 GiB KV cache (some 150k tokens of 64-token sequences): a fixed size skips
    vLLM's memory profiling, which other processes on the same GPU (the trainer, another run)
    would upset, and leaves the rest of the GPU to them."""
    where = (["--engine.dtype", "bfloat16", "--gpu_ids", "0", "--engine.gpu_memory_utilization", "0.1",
              "--engine.kv_cache_memory_bytes", str(2 << 30), "--engine.enforce_eager"] if gpu
             else ["--engine.dtype", "float32", "--no_cpu_bind"])
    return [sys.executable, "-m", "treadle.rollout", "serve", "--model", str(model), "--engines", "1",
            "--backend", "vllm", "--endpoint", endpoint, "--engine.max_model_len", "64", "--engine.seed", str(seed),
            *where]


def _precision(gpu: bool) -> list[str]:
    """The trainers' DeepSpeed settings: ZeRO-2, fp32 on CPU, bf16 on a GPU."""
    return ["--ds.zero_stage", "2", "--ds.param_dtype", "bf16" if gpu else "fp32"]


def sft_command(r: Recipe, *, model: Path, data: Path, out: Path, gpu: bool = False) -> list[str]:
    """``treadle-train sft``: one process, ZeRO-2, the answer tokens (+ EOS) as targets."""
    return [sys.executable, "-m", "treadle.trainer.cli", "sft", "--actor.model_name_or_path", str(model),
            "--data.dataset", str(data), "--data.input_key", "prompt", "--data.output_key", "answer",
            "--train.batch_size", str(r.sft_batch), "--train.micro_batch_size", str(r.sft_batch),
            "--train.max_epochs", "1", "--train.seed", str(r.seed), "--adam.lr", str(r.sft_lr), *_precision(gpu),
            "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"), "--ckpt.disable_ds"]


def ppo_command(r: Recipe, *, model: Path, prompts: Path, num_prompts: int, eval_data: Path, endpoint: str,
                out: Path, gpu: bool = False) -> list[str]:
    """``treadle-train ppo`` as GRPO with the built-in math verifier, on the demo's daemon.

    One optimizer step per rollout batch (strictly on-policy, so no scoring pass is needed), no
    KL term unless ``kl_coef`` (then the SFT model runs as the reference), greedy pass@1 on the eval
    split every ``eval_every`` steps for the curve; no best-checkpoint saves (they cost time and the
    demo exports the last).
    ``gpu``: the weights reach the engine on the trainer's GPU over CUDA IPC."""
    sync = ["--vllm.sync_backend", "cuda_ipc", "--vllm.bucket_mb", "256"] if gpu else ["--vllm.bucket_mb", "1"]
    passes, used = r.episodes(num_prompts)
    samples = r.rl_prompts * r.group_size
    return [sys.executable, "-m", "treadle.trainer.cli", "ppo", "--actor.model_name_or_path", str(model),
            "--data.prompt_dataset", str(prompts), "--data.input_key", "prompt", "--data.label_key", "label",
            "--data.max_samples", str(used), "--train.num_episodes", str(passes), "--data.prompt_max_len", "16",
            "--reward.remote_url", "math", "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", f"{r.kl_coef:g}",
            "--rollout.batch_size", str(r.rl_prompts), "--rollout.n_samples_per_prompt", str(r.group_size),
            "--rollout.max_new_tokens", str(r.max_new_tokens), "--rollout.temperature", "1.0",
            "--rollout.micro_batch_size", str(samples), "--train.batch_size", str(samples),
            "--train.micro_batch_size", str(samples), "--train.seed", str(r.seed),
            "--actor.adam.lr", str(r.rl_lr), "--actor.lr_scheduler", "constant_with_warmup",
            "--actor.lr_warmup_ratio", "0.05", "--actor.num_gpus_per_node", "1",
            *_precision(gpu), "--vllm.endpoint", endpoint, *sync,
            "--eval.dataset", str(eval_data), "--eval.steps", str(r.eval_every), "--eval.temperature", "0",
            "--eval.n_samples_per_prompt", "1", "--ckpt.path", str(out / "ckpt"),
            "--ckpt.output_dir", str(out / "model"), "--ckpt.best_metric_key", "none", "--ckpt.disable_ds"]


class StepFailed(RuntimeError):
    """A child process of a step failed; the message names its log."""


def _tail(log: Path, lines: int = 25) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, SIGKILL it after 30 s (its daemons and ranks too)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


@dataclass(slots=True)
class MetricsTail:
    """Reads the complete lines appended to a ``metrics.jsonl`` since the last call."""

    path: Path
    offset: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        new = [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
        self.rows.extend(new)
        return new


def run_logged(name: str, cmd: Sequence[str], log: Path, metrics: Path,
               on_rows: Callable[[list[dict[str, Any]]], None], env: dict[str, str]) -> list[dict[str, Any]]:
    """Run ``cmd`` (output to ``log``), calling ``on_rows`` with each batch of new metric rows;
    returns every row. StepFailed (with the log's tail) when it exits non-zero."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tail = MetricsTail(metrics)
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=ROOT, start_new_session=True)
    try:
        while proc.poll() is None:
            if rows := tail.poll():
                on_rows(rows)
            time.sleep(0.3)
        if rows := tail.poll():
            on_rows(rows)
    finally:
        _stop(proc)
    if proc.returncode != 0:
        raise StepFailed(f"{name} exited with status {proc.returncode}; "
                         f"its log is {log}. Last lines:\n{_tail(log)}")
    return tail.rows


class Daemon:
    """A ``treadle-rollout serve`` child process on a free loopback port; a context manager."""

    def __init__(self, model: Path, log: Path, *, seed: int, env: dict[str, str], gpu: bool = False) -> None:
        self.endpoint = free_endpoint()
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as fh:
            self.proc = subprocess.Popen(serve_command(model, self.endpoint, seed, gpu), stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        from treadle.rollout.client import SyncRolloutClient  # noqa: PLC0415

        deadline = time.monotonic() + timeout_s
        with SyncRolloutClient(self.endpoint) as rc:
            while True:
                if self.proc.poll() is not None:
                    raise StepFailed(f"the rollout daemon exited with status {self.proc.returncode} while starting; "
                                     f"its log is {self.log}:\n{_tail(self.log)}")
                try:
                    rc.wait_ready(timeout=2.0)
                    return
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise StepFailed(f"rollout daemon not ready in {timeout_s:g} s; see {self.log}") from None

    def weight_digest(self) -> str:
        """The engine's weight digest (equal digests: bit-identical weights in vLLM's layout)."""
        from treadle.rollout.client import SyncRolloutClient  # noqa: PLC0415

        with SyncRolloutClient(self.endpoint) as rc:
            return ",".join(sorted(rc.weight_digest().values()))

    def stop(self) -> None:
        _stop(self.proc)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalResult:
    """Accuracies of one model on the eval split (verifier scores, 0..1)."""

    greedy: float  # temperature 0, one answer per prompt
    sampled: float  # temperature 1, mean over sampled_n answers per prompt
    greedy_carry: float  # greedy, problems whose units carry
    greedy_no_carry: float  # greedy, the others
    answers: dict[str, str]  # prompt -> greedy response text

    def to_json(self) -> dict[str, Any]:
        return {"greedy": self.greedy, "sampled": self.sampled, "greedy_carry": self.greedy_carry,
                "greedy_no_carry": self.greedy_no_carry}


async def _generate(endpoint: str, prompt_ids: Sequence[list[int]], sampling: list[Any],
                    on_done: Callable[[], None]) -> list[list[Any]]:
    from treadle.rollout.client import RolloutClient  # noqa: PLC0415

    async with RolloutClient(endpoint) as rc:
        async def one(ids: list[int], sp: Any) -> list[Any]:
            out = await rc.generate(ids, sp)
            on_done()
            return out

        return list(await asyncio.gather(*(one(ids, sp) for ids, sp in zip(prompt_ids, sampling, strict=True))))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def evaluate(endpoint: str, tokenizer: Any, rows: Sequence[dict[str, str]], r: Recipe,
             on_done: Callable[[], None]) -> EvalResult:
    """Greedy and sampled answers from the daemon at ``endpoint``, scored by the verifier;
    ``on_done`` is called once per finished request (2 per row)."""
    from treadle.common.records import SamplingParams  # noqa: PLC0415

    prompts = [row["prompt"] for row in rows]
    labels = [row["label"] for row in rows]
    ids = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    greedy_sp = [SamplingParams(n=1, temperature=0.0, max_tokens=r.max_new_tokens, logprobs=False)] * len(ids)
    sampled_sp = [SamplingParams(n=r.sampled_n, temperature=1.0, max_tokens=r.max_new_tokens, logprobs=False,
                                 seed=r.seed * 1_000_003 + i * r.sampled_n) for i in range(len(ids))]
    results = asyncio.run(_generate(endpoint, ids + ids, greedy_sp + sampled_sp, on_done))

    def text(res: Any) -> str:
        return tokenizer.decode(list(res.response_token_ids), skip_special_tokens=True)

    greedy_text = [text(res[0]) for res in results[:len(ids)]]
    greedy = score(prompts, greedy_text, labels)
    flat = [(p, text(s), lab) for p, lab, res in zip(prompts, labels, results[len(ids):], strict=True) for s in res]
    sampled = score([f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat])
    carry = [parse_prompt(p).carries for p in prompts]
    return EvalResult(greedy=_mean(greedy), sampled=_mean(sampled),
                      greedy_carry=_mean([s for s, c in zip(greedy, carry, strict=True) if c]),
                      greedy_no_carry=_mean([s for s, c in zip(greedy, carry, strict=True) if not c]),
                      answers=dict(zip(prompts, greedy_text, strict=True)))
