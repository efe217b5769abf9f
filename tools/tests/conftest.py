"""Shared fixtures for the tools' tests: the scripts in tools/ loaded by path, one tiny model per
session, and (for the vLLM tests) one in-process vLLM engine per test module.

tools/ is not a package, so its modules are loaded with importlib and registered under their
file names.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a module, loaded once per session."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


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
