"""Fixtures of the rewards tests: reward files written to disk, a tiny reward model, daemons.

The tiny reward model is built once per session from tools/tiny_model.py's tokenizer and Qwen2
config (``Qwen2ForSequenceClassification``, ``num_labels=1``, random weights, seed 0), saved with
``save_pretrained``. Daemons run on their own event loop in a thread (``DaemonThread``) and are
driven through real clients, as a trainer would.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from treadle_testing import load_tool

ROOT = Path(__file__).resolve().parents[3]
CAN_NAMESPACE = sys.platform == "linux" and os.geteuid() == 0


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random Qwen2ForSequenceClassification reward model and its tokenizer."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen2ForSequenceClassification

    tm = load_tool("tiny_model")
    out = tmp_path_factory.mktemp("tiny_rm")
    tokenizer = tm.wrap_tokenizer(tm.train_tokenizer(tm.PRESETS["tiny"].vocab_size), 2048)
    config = tm.model_config(tm.PRESETS["tiny"], tokenizer)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def write_file(tmp_path: Path) -> Callable[[str, str], Path]:
    """write_file(name, source) -> path of a dedented Python file in the test's temp folder."""
    def write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture
def serve() -> Iterator[Callable[..., Any]]:
    """serve(**ServeConfig fields) -> a started DaemonThread on free loopback ports; stopped after."""
    from treadle.rewards.config import HttpConfig, ServeConfig, ZmqConfig
    from treadle.rewards.daemon import DaemonThread

    started = []

    def start(**fields: Any) -> DaemonThread:
        fields.setdefault("http", HttpConfig(port=0))
        fields.setdefault("zmq", ZmqConfig(endpoint="tcp://127.0.0.1:0"))
        d = DaemonThread(ServeConfig(**fields))
        d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
