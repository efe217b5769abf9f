"""Find and load reward functions: built-ins by name, users' files by path (OpenRLHF style).

A function reference is one of::

    math | format | code                  a built-in (``BUILTINS``), configured by ``params``
    path/to/reward.py                     the file's ``reward_func`` (OpenRLHF's convention)
    path/to/reward.py:my_fn               another function of that file

Files are loaded as OpenRLHF loads them (``importlib`` from the path, nothing added to
``sys.path``), so a file written for OpenRLHF's ``--remote_rm_url reward.py`` loads unchanged;
its ``openrlhf`` imports are served by ``treadle.rewards.openrlhf.namespace`` when OpenRLHF is
not installed (``from openrlhf.utils import extract_boxed_answer, grade_answer``), and one that
treadle does not serve fails ``parse_ref`` and ``load``, naming it, before the file runs.
Provenance records what was loaded: the file's SHA-256, the function's version (``@native``),
the built-in's parameters. Not here: running functions (``worker_main`` / ``workers``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.rewards.api import is_native
from treadle.rewards.code_reward import code_reward
from treadle.rewards.format_reward import format_reward
from treadle.rewards.math_reward import math_reward
from treadle.rewards.openrlhf import namespace as openrlhf_namespace

BUILTINS: dict[str, Callable[..., Callable[..., Any]]] = {
    "math": math_reward,
    "format": format_reward,
    "code": code_reward,
}
"""Built-in reward functions by name: each is a factory taking keyword parameters."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FunctionSpec:
    """Which reward function to load, in a form that travels to a worker process as JSON."""

    name: str
    """Component name (results' extra_logs and provenance use it)."""
    source: str
    """A built-in's name, or a Python file's path."""
    function: str = "reward_func"
    """The function to call in a file."""
    params: dict[str, Any] = field(default_factory=dict)
    """A built-in's keyword parameters (JSON-native values)."""

    @property
    def builtin(self) -> bool:
        return self.source in BUILTINS

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "function": self.function, "params": dict(self.params)}


def parse_ref(ref: str, params: dict[str, Any] | None = None) -> FunctionSpec:
    """A ``FunctionSpec`` for ``ref`` ("math", "f.py", "f.py:fn"); ValueError when it names nothing,
    ``OpenRLHFImportError`` when the file imports from ``openrlhf`` what treadle does not serve."""
    if ref in BUILTINS:
        return FunctionSpec(name=ref, source=ref, params=dict(params or {}))
    path, _, fn = ref.partition(":") if ref.count(":") == 1 and not ref.endswith(":") else (ref, "", "")
    if not path.endswith(".py"):
        raise ValueError(f"reward function {ref!r} is neither a built-in ({sorted(BUILTINS)}) nor a .py file")
    if not Path(path).is_file():
        raise ValueError(f"reward function file {path!r} does not exist")
    openrlhf_namespace.check_imports(path)
    stem = Path(path).stem
    return FunctionSpec(name=f"{stem}.{fn}" if fn else stem, source=str(Path(path).resolve()), function=fn or "reward_func")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedFunction:
    """A loaded reward function and what it is."""

    fn: Callable[..., Any]
    """The callable: native ``fn(batch)`` or OpenRLHF's ``fn(queries, prompts, labels)``."""
    native: bool
    """Whether ``fn`` takes a ``RewardBatch``."""
    provenance: dict[str, Any]
    """What was loaded (msgpack-native)."""


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _load_file(spec: FunctionSpec) -> Callable[..., Any]:
    path = Path(spec.source)
    digest = file_sha256(path)
    module_name = f"treadle_reward_file_{path.stem}_{digest[:12]}"
    mod_spec = importlib.util.spec_from_file_location(module_name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise ValueError(f"cannot load {path} as a Python module")
    openrlhf_namespace.check_imports(path)
    openrlhf_namespace.install()
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[module_name] = module  # dataclasses and pickle-free tools look modules up by name
    mod_spec.loader.exec_module(module)
    fn = getattr(module, spec.function, None)
    if not callable(fn):
        raise ValueError(f"{path} defines no function {spec.function!r}")
    return fn


def load(spec: FunctionSpec) -> LoadedFunction:
    """Load ``spec``'s function (runs the file's top level: call this in a worker process)."""
    if spec.builtin:
        fn = BUILTINS[spec.source](**spec.params)
        prov: dict[str, Any] = {"kind": "builtin", "source": spec.source, "params": dict(spec.params)}
    else:
        fn = _load_file(spec)
        prov = {"kind": "file", "source": spec.source, "function": spec.function, "sha256": file_sha256(spec.source)}
    native = is_native(fn)
    if not native:
        params = inspect.signature(fn).parameters
        if len(params) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in params.values()):
            raise ValueError(f"{spec.source}:{spec.function} takes {len(params)} arguments; OpenRLHF's "
                             "reward_func(queries, prompts, labels, **kwargs) takes 3 (or mark a "
                             "fn(batch) function with @treadle.rewards.api.native)")
    prov.update(name=spec.name, api="native" if native else "openrlhf",
                version=str(getattr(fn, "__treadle_version__", "")), **getattr(fn, "__treadle_info__", {}))
    return LoadedFunction(fn=fn, native=native, provenance=prov)
