"""Rollout engines: the interface (``base.Engine``) and its backends, by name.

``ENGINES[name]`` gives ``(engine class, config class)`` on first use, importing the backend then:
importing this package pulls in neither torch, transformers nor vLLM.

    from treadle.rollout.engine import ENGINES
    engine_cls, config_cls = ENGINES["vllm"]
    engine = engine_cls(config_cls(model="path/to/model"))
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from treadle.common.errors import CanaryMismatch, WeightMismatch
from treadle.rollout.engine.base import Engine, PauseMode
from treadle.rollout.engine.state import EngineStats, SleepState
from treadle.rollout.engine.weights import WeightSpec

BackendName = Literal["vllm", "hf"]

_BACKENDS: dict[str, tuple[str, str, str]] = {
    # name: (module, engine class, config class)
    "vllm": ("treadle.rollout.engine.vllm_engine", "VllmEngine", "VllmEngineConfig"),
    "hf": ("treadle.rollout.engine.hf_engine", "HfEngine", "HfEngineConfig"),
}


class _LazyEngines(Mapping[str, tuple[type[Engine], type[Any]]]):
    """A read-only dict of backends whose values import their module when first looked up."""

    def __getitem__(self, name: str) -> tuple[type[Engine], type[Any]]:
        if name not in _BACKENDS:
            raise KeyError(f"unknown engine backend {name!r}; known: {sorted(_BACKENDS)}")
        module, engine, config = _BACKENDS[name]
        mod = importlib.import_module(module)
        return getattr(mod, engine), getattr(mod, config)

    def __iter__(self) -> Iterator[str]:
        return iter(_BACKENDS)

    def __len__(self) -> int:
        return len(_BACKENDS)


ENGINES: Mapping[str, tuple[type[Engine], type[Any]]] = _LazyEngines()

__all__ = ["ENGINES", "BackendName", "CanaryMismatch", "Engine", "EngineStats", "PauseMode", "SleepState",
           "WeightMismatch", "WeightSpec"]
