"""Shared fixtures for the tools' tests: the scripts in tools/ loaded by path, one tiny model per
session, and (for the vLLM tests) one in-process vLLM engine per test module.

tools/ is not a package, so its modules are loaded with importlib and registered under their
file names.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from treadle_testing import load_tool

TOOLS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tool():
    """``load_tool`` for tests (with --import-mode=importlib a test cannot import conftest)."""
    return load_tool


@pytest.fixture(scope="session")
def tiny_model():
    return load_tool("tiny_model")


@pytest.fixture(scope="session")
def tiny_build(tiny_model, tmp_path_factory):
    """BuildInfo of the tiny preset, seed 0, built once into a session temp folder."""
    return tiny_model.build("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_build):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_build.out)


@pytest.fixture(scope="module")
def llm(tiny_build):
    """An in-process vLLM CPU engine on the tiny model, torn down after the module (another
    package's tests may start their own engine in this process). vLLM's variables are set for the session
    only and removed afterwards, so other packages' tests see the environment they started with."""
    vllm_cpu = load_tool("vllm_cpu")
    added = [name for name in vllm_cpu.vllm_cpu_env(vllm_cpu.cache_dir()) if name not in os.environ]
    vllm_cpu.apply_env()
    engine = vllm_cpu.start_llm(tiny_build.out, seed=0)
    try:
        yield engine
    finally:
        vllm_cpu.stop_llm(engine)
        for name in added:
            os.environ.pop(name, None)
