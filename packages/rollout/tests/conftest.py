"""Fixtures of the rollout tests: tiny models, their HF references, one engine per backend.

Each backend is started once per session (vLLM's start costs ~10 s). Tests are plain functions
that drive the engines through ``aio``, one event loop for the whole session: the engines'
background tasks run whenever a test awaits something on it. Tests that change an engine's
weights put the base weights back before they return (``Subject.restore``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from treadle_testing import Loop, free_port, load_tool

from treadle.common.weights import send_buckets

ROOT = Path(__file__).resolve().parents[3]
MAX_MODEL_LEN = 2048


def _builder() -> Any:
    """tools/tiny_model.py (tools/ is not a package)."""
    return load_tool("tiny_model")


@dataclass
class Subject:
    """An engine under test, and what it needs to go back to the base weights."""

    name: str
    engine: Any
    aio: Loop
    base: dict[str, torch.Tensor]  # the tiny model's checkpoint tensors (what it started with)
    model_b: Path  # the other tiny model's folder (weights to update to)

    def update(self, tensors: dict[str, torch.Tensor], **kw: Any) -> int:
        from treadle.common.records import InlineWeights

        upd = InlineWeights(version=self.engine.weight_version + 1, names=list(tensors),
                            dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                            shapes=[list(t.shape) for t in tensors.values()], tensors=list(tensors.values()), **kw)
        return self.aio(self.engine.update_weights(upd))

    def restore(self) -> None:
        self.update(self.base)


@pytest.fixture(scope="session")
def aio() -> Loop:
    loop = Loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny models of one architecture: "a" (seed 0, the engines' base) and "b" (seed 1)."""
    tiny = _builder()
    root = tmp_path_factory.mktemp("models")
    return {name: tiny.build("tiny", root / name, seed=seed).out for name, seed in (("a", 0), ("b", 1))}


@pytest.fixture(scope="session")
def ref(models: dict[str, Path]) -> dict[str, Any]:
    """The HF models themselves (fp32, eval): the references every engine is checked against."""
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in models.items()}


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


@pytest.fixture(scope="session")
def hf_engine(aio: Loop, models: dict[str, Path]) -> Subject:
    from treadle.rollout.engine import ENGINES

    cls, cfg = ENGINES["hf"]
    engine = cls(cfg(model=str(models["a"]), max_model_len=MAX_MODEL_LEN, eos_token_ids=()))
    aio(engine.start())
    yield Subject("hf", engine, aio, checkpoint(models["a"]), models["b"])
    aio(engine.close())


@pytest.fixture(scope="session")
def vllm_engine(aio: Loop, models: dict[str, Path]) -> Subject:
    pytest.importorskip("vllm")
    from treadle.rollout.engine import ENGINES

    cls, cfg = ENGINES["vllm"]
    engine = cls(cfg(model=str(models["a"]), max_model_len=MAX_MODEL_LEN, dtype="float32",
                     enforce_eager=True, eos_token_ids=(), kv_cache_memory_bytes=64 << 20))
    aio(engine.start(), timeout=300)
    yield Subject("vllm", engine, aio, checkpoint(models["a"]), models["b"])
    aio(engine.close())


@pytest.fixture(params=["hf", "vllm"])
def subject(request: pytest.FixtureRequest) -> Subject:
    return request.getfixturevalue(f"{request.param}_engine")


def reference_distributions(model: Any, prompt: Any, response: Any, temperature: float = 1.0,
                            top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """float64 [R, V]: the HF model's processed distribution (log-probs) at each response token.

    Written independently of the engines: softmax(logits / T) restricted to the top-k tokens and
    then to the smallest top set whose mass reaches top_p (ties at the cut kept), renormalised.
    """
    p = np.asarray(prompt, dtype=np.int64)
    r = np.asarray(response, dtype=np.int64)
    ids = torch.from_numpy(np.concatenate([p, r]))[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(p) - 1:-1].double()
    out = []
    for t in range(len(r)):
        z = logits[t] / (temperature if temperature > 0 else 1.0)
        keep = torch.ones_like(z, dtype=torch.bool)
        if temperature > 0 and top_k > 0:
            keep &= z >= torch.topk(z, top_k).values[-1]
        if temperature > 0 and top_p < 1.0:
            probs = torch.softmax(z.masked_fill(~keep, -torch.inf), -1)
            order = torch.argsort(probs, descending=True)
            mass_before = torch.cumsum(probs[order], 0) - probs[order]
            kept = order[mass_before < top_p]
            mask = torch.zeros_like(keep)
            mask[kept] = True
            keep &= mask
        out.append(torch.log_softmax(z.masked_fill(~keep, -torch.inf), -1))
    return torch.stack(out) if out else torch.zeros(0, 0, dtype=torch.float64)


def reference_logprobs(model: Any, prompt: Any, response: Any, temperature: float = 1.0,
                       top_k: int = -1, top_p: float = 1.0) -> np.ndarray:
    """float64 [R]: log-prob of each response token under the HF model's processed distribution."""
    dist = reference_distributions(model, prompt, response, temperature, top_k, top_p)
    r = torch.as_tensor(np.asarray(response, dtype=np.int64))
    return dist.gather(1, r[:, None]).squeeze(1).numpy()


def reference_prompt_logprobs(model: Any, ids: Any) -> np.ndarray:
    x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
    return lp.gather(1, x[0, 1:, None]).squeeze(1).numpy()


@pytest.fixture(scope="session")
def tools() -> Any:
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(logprobs=reference_logprobs, distributions=reference_distributions,
                           prompt_logprobs=reference_prompt_logprobs,
                           checkpoint=checkpoint, free_port=free_port, send_buckets=send_buckets)
