"""Every environment knob treadle reads, declared once: name, type, default, doc.

Nothing else in treadle reads ``os.environ`` for its own settings; code calls ``env.get(NAME)``.
Flags on the command line are the normal way to configure a run; these knobs are for
deployment-wide settings (log format, limits, caches) and for child processes we spawn.

Third-party variables (``OMP_NUM_THREADS``, ``VLLM_*``, ``HF_*``) are theirs; treadle sets them for
its children through ``child_env`` and never reads them back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Knob:
    """One environment variable treadle understands."""

    name: str
    type: type
    default: Any
    doc: str

    def parse(self, raw: str) -> Any:
        if self.type is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(f"{self.name}={raw!r}: expected a boolean (1/0, true/false)")
        try:
            return self.type(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: expected {self.type.__name__}") from None


_KNOBS = (
    Knob(name="TREADLE_LOG_LEVEL", type=str, default="INFO", doc="Log level of treadle loggers."),
    Knob(name="TREADLE_LOG_JSON", type=bool, default=False, doc="Emit logs as one JSON object per line."),
    Knob(name="TREADLE_MAX_FRAME_BYTES", type=int, default=2 << 30,
         doc="Largest ZeroMQ frame a service or client accepts (bytes); larger ones get an Error."),
    Knob(name="TREADLE_RPC_TIMEOUT_S", type=float, default=60.0,
         doc="Default per-request timeout of RPC clients (seconds)."),
    Knob(name="TREADLE_CURVE_DIR", type=str, default="",
         doc="Folder holding CURVE key files (server.key_secret, client.key_secret, ...)."),
    Knob(name="TREADLE_CACHE_DIR", type=str, default="",
         doc="Where treadle keeps caches (tiny models, compiled ops); empty: ./.cache."),
    Knob(name="TREADLE_RUN_DIR", type=str, default="runs",
         doc="Default parent folder of run directories (logs, metrics, checkpoints)."),
)
KNOBS: Mapping[str, Knob] = {k.name: k for k in _KNOBS}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of knob ``name`` (its default when unset); unknown names raise KeyError."""
    knob = KNOBS[name]
    raw = (os.environ if environ is None else environ).get(name)
    return knob.default if raw is None else knob.parse(raw)


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of this process's environment plus ``extra``, for spawning a child process."""
    env = dict(os.environ)
    if extra:
        env.update(extra)
    return env


FORWARDED_PREFIXES = ("TREADLE_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "TORCH_", "OMP_", "MKL_", "NCCL_",
                      "GLOO_", "DS_", "PYTHONPATH", "MPLCONFIGDIR")
"""Variables a process started on another Ray node gets from ours (a Ray worker starts from the raylet's)."""


def forwarded_env() -> dict[str, str]:
    """This process's variables that Ray actors it starts need (caches, thread counts, treadle knobs)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set third-party environment variables inside the block only (for the child processes or
    the library build started there; None unsets one); the old values, or their absence, come
    back afterwards."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def describe() -> str:
    """A table of every knob, for ``--help`` epilogues and docs."""
    width = max(len(k.name) for k in _KNOBS)
    return "\n".join(f"{k.name:<{width}}  {k.type.__name__:<5} default={k.default!r}  {k.doc}" for k in _KNOBS)
