"""Fixtures of the launcher's tests: the tiny model, a verifiable toy task, and helpers to run
``treadle-launch`` (and Ray) as subprocesses and to check that nothing they started survives.

Everything runs as real processes: the launcher is a subprocess of the test (it becomes a child
subreaper and installs signal handlers, neither of which belongs in the pytest process).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from treadle_testing import load_tool

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
WORDS = ["apple", "banana", "cherry", "delta", "echo", "fox", "golf", "hotel"]

# Reward: the share of digits in the response (a random tiny model already hits it now and then).
REWARD = '''
def reward_func(queries, prompts, labels):
    out = []
    for q, p in zip(queries, prompts):
        text = q[len(p):] if q.startswith(p) else q
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / max(1, len(chars)))
    return {"rewards": out, "scores": out}
'''


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 model (seed 0): folder path."""
    return load_tool("tiny_model").build("tiny", tmp_path_factory.mktemp("tiny"), seed=0).out


@pytest.fixture(scope="session")
def task(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """prompts.jsonl (prompt, label), chat.jsonl (context_messages, as the seed's dataset), reward.py."""
    root = tmp_path_factory.mktemp("task")
    prompts = [f"numbers for {WORDS[i % 8]} {WORDS[(i * 3) % 8]}:" for i in range(32)]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "label": str(i % 10)}) + "\n"
                                                for i, p in enumerate(prompts)))
    (root / "chat.jsonl").write_text("".join(json.dumps({"context_messages": [{"role": "user", "content": p}]}) + "\n"
                                             for p in prompts))
    (root / "reward.py").write_text(REWARD)
    return SimpleNamespace(prompts=root / "prompts.jsonl", chat=root / "chat.jsonl", reward=root / "reward.py")


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a launcher subprocess: caches in the checkout, one thread, Ray without tokens."""
    from treadle.common import env

    return env.child_env({
        "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(CACHE / "torch_extensions"),
        "VLLM_CACHE_ROOT": str(CACHE / "vllm"), "HF_HOME": str(CACHE / "hf"), "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "MPLCONFIGDIR": str(CACHE / "matplotlib"), "TOKENIZERS_PARALLELISM": "false",
        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TREADLE_LOG_LEVEL": "INFO",
        "TREADLE_CACHE_DIR": str(CACHE), **extra,
    })


def ppo_flags(tiny: Path, task: SimpleNamespace, out: Path, *extra: str) -> list[str]:
    """A 2-step GRPO run on the tiny model: 2 prompts x 4 samples per step, 8 new tokens."""
    return ["--actor.model_name_or_path", str(tiny), "--data.prompt_dataset", str(task.prompts),
            "--data.input_key", "prompt", "--data.label_key", "label", "--algo.advantage.estimator", "group_norm",
            "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2", "--train.batch_size", "8",
            "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8", "--rollout.max_new_tokens", "8",
            "--data.prompt_max_len", "32", "--data.max_samples", "4", "--actor.num_gpus_per_node", "1",
            "--ds.param_dtype", "fp32", "--ds.zero_stage", "0", "--algo.kl.init_coef", "0",
            "--vllm.bucket_mb", "1", "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"), *extra]


_STARTED: list[subprocess.Popen] = []


def launch(args: list[str], module: str = "treadle.integration.cli", **popen: Any) -> subprocess.Popen:
    """``python -m MODULE ARGS`` (the launcher by default) with its output captured (text)."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], env=popen.pop("env", child_env()),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, **popen)
    _STARTED.append(proc)
    return proc


def run_json(run_dir: Path) -> dict[str, Any]:
    """run.json, or {} while it is being written for the first time."""
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(predicate: Any, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> Any:
    """Poll ``predicate`` until truthy; fail if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}) before {what}:\n{proc.stdout.read()[-6000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def descendants(pid: int) -> list[psutil.Process]:
    """Every process below ``pid`` right now."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def survivors(procs: list[psutil.Process]) -> list[str]:
    """Those of ``procs`` still running (same pid and start time, not a zombie), described."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            pass
    return out


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for the launcher; its output. Kills it (and fails) on timeout."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in descendants(proc.pid):
            p.kill()
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the launcher did not finish within {timeout} s:\n{out[-6000:]}") from None
    return out


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """Module-level helpers for test modules (conftest is not importable under importlib mode)."""
    return SimpleNamespace(root=ROOT, cache=CACHE, child_env=child_env, ppo_flags=ppo_flags, launch=launch,
                           run_json=run_json, wait_for=wait_for, descendants=descendants, survivors=survivors,
                           finish=finish, tool=load_tool)


@pytest.fixture(autouse=True)
def _no_leftovers() -> Any:
    """A launcher a failing test left running is killed with everything below it, then reported."""
    yield
    left = []
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            tree = descendants(proc.pid)
            left += survivors(tree) + [f"{proc.pid} the launcher"]
            for p in [*tree, psutil.Process(proc.pid)]:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            proc.communicate()
    assert not left, left
