"""Fixtures of the trainer tests: a tiny model built once per session, its tokenizer, small
synthetic datasets written as jsonl, and a runner for commands under ``torchrun``.

Distributed behaviour is tested in subprocesses (2 gloo ranks under torchrun), never in the
pytest process itself, so no process group leaks into other packages' tests.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from treadle_testing import load_tool

ROOT = Path(__file__).resolve().parents[3]
SRC_PATHS = [ROOT / "packages" / p / "src" for p in ("common", "rollout", "rewards", "agents", "trainer")]
WORDS = ["apple", "banana", "cherry", "delta", "echo", "fox", "golf", "hotel", "india", "juliet", "kilo", "lima", "mango", "nova", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 model (seed 0): folder path."""
    return load_tool("tiny_model").build("tiny", tmp_path_factory.mktemp("tiny"), seed=0).out


@pytest.fixture(scope="session")
def tokenizer(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def phrase(rng: random.Random, lo: int = 1, hi: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_datasets(folder: Path, n: int = 64, seed: int = 0) -> SimpleNamespace:
    """sft.jsonl (question/response: repeat the words), pref.jsonl (prompt/chosen/rejected/margin),
    kto.jsonl (input/output/label), chat.jsonl (multi-turn messages)."""
    rng = random.Random(seed)
    sft, pref, kto, chat = [], [], [], []
    for _ in range(n):
        words, other = phrase(rng), phrase(rng)
        sft.append({"question": f"repeat {words}", "response": words})
        pref.append({"prompt": f"repeat {words}", "chosen": words, "rejected": other, "margin": 0.5})
        good = rng.random() < 0.5
        kto.append({"input": f"repeat {words}", "output": words if good else other, "label": good})
        chat.append({"messages": [{"role": "user", "content": f"repeat {words}"}, {"role": "assistant", "content": words},
                                  {"role": "user", "content": f"again {other}"}, {"role": "assistant", "content": other}]})
    return SimpleNamespace(sft=write_jsonl(folder / "sft.jsonl", sft), pref=write_jsonl(folder / "pref.jsonl", pref),
                           kto=write_jsonl(folder / "kto.jsonl", kto), chat=write_jsonl(folder / "chat.jsonl", chat))


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    return make_datasets(tmp_path_factory.mktemp("data"))


def child_env() -> dict[str, str]:
    """Environment of a training subprocess: sources on the path, caches in the checkout, 1 thread."""
    from treadle.common import env

    cache = ROOT / ".cache"
    return env.child_env({
        # what the parent had on its path stays (the GPU machine puts carried wheels there)
        "PYTHONPATH": os.pathsep.join([*map(str, SRC_PATHS), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"), "HF_HOME": str(cache / "hf"),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLCONFIGDIR": str(cache / "matplotlib"),
        "TOKENIZERS_PARALLELISM": "false", "TREADLE_LOG_LEVEL": "WARNING",
    })


def torchrun(args: list[str], nproc: int = 2, timeout: float = 400) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc ARGS`` (standalone rendezvous); raises with its output on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


@pytest.fixture(scope="session")
def run_torchrun() -> Any:
    return torchrun


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """Module-level helpers for test modules (conftest is not importable under importlib mode)."""
    return SimpleNamespace(root=ROOT, child_env=child_env, torchrun=torchrun)
