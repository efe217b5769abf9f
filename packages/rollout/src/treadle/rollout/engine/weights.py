"""Engine-side weight loading: what an update must look like, how buckets are laid out, the canary.

Every backend refuses a bad update *before* touching its model, because a reload that fails half
way leaves a vLLM engine broken (PLATFORM.md). ``WeightSpec`` holds the names, shapes and dtypes
an update must have: the checkpoint's tensor names and shapes (read from the safetensors headers
of the model folder, no torch needed) and the engine's serving dtype. A tied model's
``lm_head.weight`` is accepted and ignored (the embedding is the source of truth).

Buckets: tensors ``lo..hi-1`` of an update are packed into one flat ``uint8`` buffer, tensor ``i``
at byte ``offset_i = round_up(offset_{i-1} + nbytes_{i-1}, ALIGN)``, so every tensor's view is
aligned for its dtype and sender and receiver derive the same layout from the header alone.

What this module does not do: move bytes between processes (``group``), or load tensors into a
model (the engines).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.common.errors import BadRequest, InternalError

if TYPE_CHECKING:
    import torch

ALIGN = 64  # bytes; >= every dtype's size, and a cache line
TIED_HEAD = "lm_head.weight"
TIED_SOURCE = "model.embed_tokens.weight"

DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})
# safetensors header dtype codes -> torch dtype names
_ST_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class WeightMismatch(BadRequest):
    """An update's names, shapes or dtypes do not fit the engine's model; nothing was loaded."""


class CanaryMismatch(InternalError):
    """The weights loaded, but the engine's canary logprobs differ from the sender's."""


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


def model_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (else ``config.json``) of an HF model folder."""
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(sorted({eos} if isinstance(eos, int) else set(eos)))
    return ()


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a dense tensor: prod(shape) * itemsize(dtype)."""
    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= int(d)
    return n


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


def bucket_layout(dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                  align: int = ALIGN) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a bucket and the bucket's total size.

    offset_0 = 0; offset_i = round_up(offset_{i-1} + nbytes_{i-1}, align);
    total = round_up(offset_last + nbytes_last, align).
    """
    offsets, end = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        start = _round_up(end, align)
        offsets.append(start)
        end = start + tensor_nbytes(dtype, shape)
    return offsets, _round_up(end, align)


def plan_buckets(nbytes: Sequence[int], bucket_bytes: int, ramp: int = 0) -> list[int]:
    """``bucket_sizes`` for tensors of ``nbytes``: greedy runs of consecutive tensors.

    A bucket takes tensors while its (aligned) size stays <= its limit; a tensor larger than the
    limit gets a bucket of its own. The limit is ``bucket_bytes``, except for the first ``ramp``
    buckets: ``bucket_bytes / 2**ramp`` for the first, doubling with each bucket up to
    ``bucket_bytes`` (limit_k = bucket_bytes >> (ramp - k) for k < ramp). A sender that packs
    one bucket while it broadcasts the one before can start broadcasting after packing a small
    bucket, not a full one. ``bucket_bytes <= 0``: one tensor per bucket.
    """
    if bucket_bytes <= 0:
        return [1] * len(nbytes)
    if ramp < 0:
        raise ValueError(f"ramp must be >= 0, got {ramp}")
    sizes: list[int] = []
    count = used = 0
    for nb in nbytes:
        limit = bucket_bytes >> max(0, ramp - len(sizes))
        grown = _round_up(used, ALIGN) + nb
        if count and grown > limit:
            sizes.append(count)
            count, grown = 0, nb
        count, used = count + 1, grown
    if count:
        sizes.append(count)
    return sizes


def send_order(nbytes: Sequence[int], bucket_bytes: int) -> list[int]:
    """Indices of tensors of ``nbytes`` in the order to send them: those that fit a bucket of
    ``bucket_bytes`` in their order, then the larger ones in theirs (an embedding table first
    in a model's order would be the first bucket, which nothing overlaps: the sender packs it
    before the first broadcast can start). ``bucket_bytes <= 0``: the given order."""
    if bucket_bytes <= 0:
        return list(range(len(nbytes)))
    return [i for i, n in enumerate(nbytes) if n <= bucket_bytes] + [i for i, n in enumerate(nbytes) if n > bucket_bytes]


def bucket_ranges(bucket_sizes: Sequence[int], n: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` tensor index ranges of each bucket; empty sizes: one tensor each."""
    sizes = list(bucket_sizes) or [1] * n
    if sum(sizes) != n or any(s < 1 for s in sizes):
        raise BadRequest(f"bucket_sizes {sizes[:8]}... must be >= 1 each and sum to {n}")
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


def _views(flat: torch.Tensor, dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
           offsets: Sequence[int]) -> list[torch.Tensor]:
    import torch

    return [flat[o:o + tensor_nbytes(d, s)].view(getattr(torch, d)).view(tuple(s))
            for d, s, o in zip(dtypes, shapes, offsets, strict=True)]


def byte_splits(dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[int]:
    """Split sizes that cut a bucket (``bucket_layout``) into its pieces: the gap before tensor 0
    (0), tensor 0's bytes, the alignment gap after it, tensor 1's bytes, ..., the tail; tensor i
    is piece ``2 * i + 1``."""
    offsets, total = bucket_layout(dtypes, shapes)
    out, end = [], 0
    for dtype, shape, offset in zip(dtypes, shapes, offsets, strict=True):
        n = tensor_nbytes(dtype, shape)
        out += [offset - end, n]
        end = offset + n
    out.append(total - end)
    return out


def word_views(flat: torch.Tensor, dtypes: Sequence[str],
               shapes: Sequence[Sequence[int]]) -> tuple[int, list[torch.Tensor]]:
    """``(size, views)``: each tensor's bytes in the bucket ``flat`` (uint8, ``bucket_layout``) as
    a 1-d view of integer words (``span_views``). For loaders that copy a bucket's bytes into
    their tensors' bytes (the same dtypes): ``unpack_bucket``'s typed, shaped views cost three
    view calls a tensor, which on an H200 took longer (1.9 ms for a 1.5B model's 338 tensors)
    than copying the bytes (1.5 ms); and a multi-tensor copy of 8-byte words ran faster there
    than of 2-byte bf16 elements or single bytes (2.0 / 2.3 / 3.4 ms)."""
    import torch

    splits = byte_splits(dtypes, shapes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != sum(splits):
        raise WeightMismatch(f"bucket buffer is {flat.dtype}{list(flat.shape)}, layout needs uint8[{sum(splits)}]")
    offsets = bucket_layout(dtypes, shapes)[0]
    return span_views(flat, [(o, n) for o, n in zip(offsets, splits[1::2], strict=True)])


def span_views(flat: torch.Tensor, spans: Sequence[tuple[int, int]]) -> tuple[int, list[torch.Tensor]]:
    """``(size, views)``: the byte spans ``(offset, bytes)`` of ``flat`` (1-d uint8) as 1-d views
    of integer words of ``size`` bytes, the widest of 8, 4, 2, 1 that divides every span's offset
    and length and ``flat``'s own offset; in the order given. Spans that do not overlap come from
    one ``split`` call (one view call a span costs more host time than a load's copies take on a
    GPU); overlapping ones (one tensor's bytes sent under two names) are sliced one by one."""
    import torch

    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise WeightMismatch(f"expected a flat uint8 buffer, got {flat.dtype}{list(flat.shape)}")
    end = max((o + n for o, n in spans), default=0)
    if any(o < 0 or n < 0 for o, n in spans) or end > flat.numel():
        raise WeightMismatch(f"byte spans up to {end} do not lie inside a buffer of {flat.numel()} bytes")
    size = next(w for w in (8, 4, 2, 1) if flat.storage_offset() % w == 0 and all(o % w == 0 and n % w == 0
                                                                                 for o, n in spans))
    words = flat[:end].view(word_dtype(size))
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    cuts, at = [], 0
    for i in order:
        o, n = spans[i]
        if o < at:  # overlaps the one before
            return size, [words[o // size:(o + n) // size] for o, n in spans]
        cuts += [(o - at) // size, n // size]
        at = o + n
    out: list[Any] = [None] * len(spans)
    for i, view in zip(order, words.split([*cuts, (end - at) // size])[1::2], strict=True):
        out[i] = view
    return size, out


MIRROR_COVER = 0.75
"""``mirror_spans``: the least share of a span's bytes the sent tensors must fill."""
MIRROR_ALIGN = 256  # bytes: where a mirrored span starts (a buffer of its own is at least this aligned)


def mirror_spans(dtypes: Sequence[str], pieces: Sequence[tuple[int, int, int]],
                 spans: Mapping[int, Sequence[int]]) -> list[tuple[int, int, int]] | None:
    """``[(storage, lo, hi)]``: for each storage ``k`` of ``spans`` (storage -> the indices of
    the tensors lying in it, ``pieces[i] = (k, offset, bytes)``, ``dtypes[i]``), the byte range
    that holds them, ``lo`` rounded down to ``MIRROR_ALIGN``: a buffer of ``hi - lo`` bytes can
    then hold every one of them at ``offset - lo``, aligned for its dtype, and be filled by one
    copy. None when that cannot be done or does not pay: a tensor not aligned to its dtype's
    size, two tensors overlapping, or a range the tensors fill less than ``MIRROR_COVER`` of."""
    out = []
    for k, idx in spans.items():
        if not idx:
            continue
        got = sorted((pieces[i][1], pieces[i][2], DTYPE_SIZES.get(dtypes[i], 0)) for i in idx)
        end = 0
        for off, n, size in got:
            if size == 0 or off % size or off < end:
                return None
            end = off + n
        lo = got[0][0] - got[0][0] % MIRROR_ALIGN
        if sum(n for _, n, _ in got) < MIRROR_COVER * (end - lo):
            return None
        out.append((k, lo, end))
    return out


def word_dtype(size: int) -> torch.dtype:
    """torch's integer dtype of words of ``size`` bytes (8, 4, 2 or 1)."""
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size]


def pack_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat ``uint8`` buffer holding ``tensors`` at ``bucket_layout`` offsets (a copy)."""
    import torch

    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    shapes = [tuple(t.shape) for t in tensors]
    offsets, total = bucket_layout(dtypes, shapes)
    flat = torch.zeros(total, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    for view, t in zip(_views(flat, dtypes, shapes, offsets), tensors, strict=True):
        view.copy_(t)
    return flat


def unpack_bucket(dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: str = "cpu",
                  flat: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(flat, views)``: a bucket buffer (new unless given) and each tensor's view into it."""
    import torch

    offsets, total = bucket_layout(dtypes, shapes)
    if flat is None:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    elif flat.numel() != total or flat.dtype != torch.uint8:
        raise WeightMismatch(f"bucket buffer is {flat.dtype}[{flat.numel()}], layout needs uint8[{total}]")
    return flat, _views(flat, dtypes, shapes, offsets)


def as_tensor(a: Any) -> torch.Tensor:
    """A torch tensor for an array from the wire (numpy arrays are wrapped, not copied)."""
    import warnings

    import torch

    if isinstance(a, torch.Tensor):
        return a
    with warnings.catch_warnings():  # zero-copy wire buffers are read-only; we only read them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


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
