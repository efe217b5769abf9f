"""Engine-side weight checks: what an update must look like, and the canary.

Every backend refuses a bad update *before* touching its model, because a reload that fails half
way leaves a vLLM engine broken (PLATFORM.md). ``WeightSpec`` holds the names, shapes and dtypes
an update must have: the checkpoint's tensor names and shapes (read from the safetensors headers
of the model folder, no torch needed) and the engine's serving dtype. A tied model's
``lm_head.weight`` is accepted and ignored (the embedding is the source of truth).
``adapter_spec`` derives, from that spec, the tensors a LoRA adapter update must carry.
``check_ipc_buckets`` checks a cuda_ipc update's handles against the bucket layout.

What this module does not do: lay buckets out or move bytes (``treadle.common.weights`` and
``treadle.common.ipc``), or load tensors into a model (the engines).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.common.errors import CanaryMismatch, WeightMismatch
from treadle.common.ipc import handles_on, loads
from treadle.common.records import IpcWeights
from treadle.common.weights import bucket_layout, bucket_ranges

if TYPE_CHECKING:
    import torch

__all__ = ["ADAPTER_PREFIX", "FLOAT_DTYPES", "TIED_HEAD", "TIED_SOURCE", "CanaryMismatch", "TensorSpec",
           "WeightMismatch", "WeightSpec", "adapter_spec", "as_tensor", "canary_error", "check_ipc_buckets",
           "model_eos_ids",
           "read_safetensors_header", "spec_from_checkpoint"]

TIED_HEAD = "lm_head.weight"
TIED_SOURCE = "model.embed_tokens.weight"
FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})
# safetensors header dtype codes -> torch dtype names
_ST_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype name of one tensor."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightSpec:
    """The tensors a weight update must carry (all of ``required``) and may carry (``ignored``)."""

    required: Mapping[str, TensorSpec]
    ignored: Mapping[str, TensorSpec] = field(default_factory=dict)

    def check_header(self, names: Sequence[str], dtypes: Sequence[str],
                     shapes: Sequence[Sequence[int]]) -> None:
        """Raise ``WeightMismatch`` listing every problem unless the header fits exactly."""
        problems: list[str] = []
        seen: set[str] = set()
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            want = self.required.get(name) or self.ignored.get(name)
            if name in seen:
                problems.append(f"{name}: sent twice")
            elif want is None:
                problems.append(f"{name}: no such tensor in the model")
            elif tuple(shape) != want.shape:
                problems.append(f"{name}: shape {list(shape)}, the model has {list(want.shape)}")
            elif dtype != want.dtype:
                problems.append(f"{name}: dtype {dtype}, the engine serves {want.dtype}")
            seen.add(name)
        missing = [n for n in self.required if n not in seen]
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}"
                            + (" ..." if len(missing) > 5 else ""))
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise WeightMismatch("weight update refused, nothing was loaded: "
                                 + "; ".join(problems[:8]) + more)

    def check_tensors(self, names: Sequence[str], dtypes: Sequence[str],
                      shapes: Sequence[Sequence[int]], tensors: Sequence[Any]) -> None:
        """Check the header, then that every tensor really has its header's shape and dtype."""
        if len(tensors) != len(names):
            raise WeightMismatch(f"weight update refused: {len(names)} names but {len(tensors)} tensors")
        self.check_header(names, dtypes, shapes)
        for name, dtype, shape, t in zip(names, dtypes, shapes, tensors, strict=True):
            got = str(t.dtype).removeprefix("torch.")
            if tuple(t.shape) != tuple(shape) or got != dtype:
                raise WeightMismatch(f"weight update refused: tensor {name} is {got}{list(t.shape)}, "
                                     f"its header says {dtype}{list(shape)}")

    @property
    def skip(self) -> frozenset[str]:
        """Names that are accepted but must not be loaded."""
        return frozenset(self.ignored)


def read_safetensors_header(path: Path) -> dict[str, TensorSpec]:
    """``{name: TensorSpec}`` from one .safetensors file's JSON header (no tensor data read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: TensorSpec(tuple(v["shape"]), _ST_DTYPES.get(v["dtype"], v["dtype"].lower()))
            for k, v in header.items()}


def spec_from_checkpoint(folder: str | Path, dtype: str | None = None) -> WeightSpec:
    """The spec of the HF checkpoint in ``folder``; floating tensors take ``dtype`` if given.

    ``dtype`` is the engine's serving dtype: an engine serving bfloat16 wants bfloat16 tensors,
    whatever the checkpoint on disk holds.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (weight checks read their headers)")
    specs: dict[str, TensorSpec] = {}
    for f in files:
        specs.update(read_safetensors_header(f))
    if dtype is not None:
        specs = {k: TensorSpec(v.shape, dtype if v.dtype in FLOAT_DTYPES else v.dtype)
                 for k, v in specs.items()}
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    ignored: dict[str, TensorSpec] = {}
    if config.get("tie_word_embeddings") and TIED_SOURCE in specs:
        ignored[TIED_HEAD] = specs.pop(TIED_HEAD, specs[TIED_SOURCE])
    return WeightSpec(required=specs, ignored=ignored)


ADAPTER_PREFIX = "base_model.model."  # PEFT's file names: the PeftModel's, adapter name dropped


def adapter_spec(model: WeightSpec, rank: int, target_modules: Sequence[str], dtype: str) -> WeightSpec:
    """The tensors a LoRA adapter of ``rank`` on ``target_modules`` must carry for a model of spec
    ``model``, named as PEFT saves them: for every 2-d weight ``<m>.weight`` [out, in] whose module
    is a target (PEFT's rule: a target is the module's name or its last components), ``base_model.model.<m>.lora_A.weight`` [rank, in] and
    ``...lora_B.weight`` [out, rank], in ``dtype``."""
    targets = frozenset(target_modules)
    required: dict[str, TensorSpec] = {}
    for name, t in model.required.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(t.shape) != 2 or not _targeted(module, targets):
            continue
        out, inp = t.shape
        required[f"{ADAPTER_PREFIX}{module}.lora_A.weight"] = TensorSpec((rank, inp), dtype)
        required[f"{ADAPTER_PREFIX}{module}.lora_B.weight"] = TensorSpec((out, rank), dtype)
    if not required:
        raise WeightMismatch(f"adapter update refused: no 2-d weight of the model is in target_modules "
                             f"{sorted(targets)}")
    return WeightSpec(required=required)


def _targeted(module: str, targets: frozenset[str]) -> bool:
    """PEFT's rule for a list of targets: the module's name is one, or ends with ``.`` + one."""
    parts = module.split(".")
    return any(".".join(parts[i:]) in targets for i in range(len(parts)))


def model_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (else ``config.json``) of an HF model folder."""
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(sorted({eos} if isinstance(eos, int) else set(eos)))
    return ()


def check_ipc_buckets(update: IpcWeights, uuid: str) -> list[bytes]:
    """The handles of ``update`` on the GPU ``uuid`` (``ipc.handles_on``: strict, and
    ``IpcHandleError`` when that GPU has none); ``WeightMismatch`` unless each bucket's bytes are
    what its tensors' layout needs. In bucket order."""
    buckets = len(update.bucket_sizes) if update.bucket_sizes else len(update.names)
    mine = handles_on(update.handles, uuid, buckets)
    handles = [loads(h) for h in mine]
    for h, (lo, hi) in zip(handles, bucket_ranges(update.bucket_sizes, len(update.names)), strict=True):
        need = bucket_layout(update.dtypes[lo:hi], update.shapes[lo:hi])[1]
        if h.numel != need:
            raise WeightMismatch(f"cuda_ipc bucket of tensors [{lo}, {hi}) has {h.numel} bytes, its "
                                 f"layout needs {need}")
    return mine


def as_tensor(a: Any) -> torch.Tensor:
    """A torch tensor for an array from the wire (numpy arrays are wrapped, not copied)."""
    import warnings

    import torch

    if isinstance(a, torch.Tensor):
        return a
    with warnings.catch_warnings():  # zero-copy wire buffers are read-only; we only read them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def canary_gap(expected: Any, got: Any) -> float:
    """``max |expected - got|`` over the canary's prompt logprobs (0.0 for none); inf when the
    lengths differ or a value is NaN (pure)."""
    import numpy as np

    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    g = np.asarray(got, dtype=np.float64).reshape(-1)
    if e.shape != g.shape:
        return float("inf")
    if e.size == 0:
        return 0.0
    diff = np.abs(e - g)
    return float("inf") if np.isnan(diff).any() else float(diff.max())


def canary_error(expected: Any, got: Any, tolerance: float) -> str | None:
    """None when ``max |expected - got| <= tolerance`` (same length), else what differs."""
    import numpy as np

    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    g = np.asarray(got, dtype=np.float64).reshape(-1)
    if e.shape != g.shape:
        return f"canary has {g.size} prompt logprobs, the sender sent {e.size}"
    if e.size == 0:
        return None
    diff = np.abs(e - g)
    worst = int(np.argmax(diff))
    if not diff[worst] <= tolerance:  # also catches NaN
        return (f"canary prompt logprobs differ from the sender's by up to {diff[worst]:.3g} "
                f"(position {worst}: sender {e[worst]:.6f}, engine {g[worst]:.6f}; "
                f"tolerance {tolerance:g})")
    return None
