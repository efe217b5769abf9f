"""Tokenised datasets on disk, so that one process per host tokenises and the others read.

``fingerprint`` names a cache file by everything the samples depend on: the data files (path,
size, modification time), the tokenizer (its serialised vocabulary, rules, special tokens and
chat template), the recipe's data settings, and the source of the code that turns rows into
samples. ``save`` writes the samples of every split as flat numpy arrays in one ``.npz`` file
(no pickle: ``load`` refuses object arrays), atomically (temporary name, then rename), so a
reader never sees half a file and a file left by an earlier run with the same fingerprint is
simply reused.

Not here: who writes and who waits (``trainers.build.datasets``), tokenising (``formatting``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from treadle.trainer.data.samples import Sample, TokenSeq

FORMAT = 2  # bump when the file layout changes


def _source_digest() -> str:
    """The code that turns rows into samples: a change to it must not reuse old caches."""
    from treadle.trainer.data import formatting, samples, sources, steps  # noqa: PLC0415

    h = hashlib.sha256()
    for module in (formatting, samples, sources, steps):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """The tokenizer's behaviour: its serialised pipeline (fast tokenizers) or vocabulary, special
    tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [type(tokenizer).__name__, getattr(tokenizer, "chat_template", None), tokenizer.eos_token_id,
             tokenizer.pad_token_id, tokenizer.bos_token_id]
    return hashlib.sha256((body + json.dumps(extra, default=str)).encode()).hexdigest()


def file_stamp(spec: str, files: Sequence[Path] | None) -> list[Any]:
    """What identifies a dataset's contents cheaply: each file's resolved path, size and
    modification time (a hub name stands for itself)."""
    if files is None:
        return [spec]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def fingerprint(*, settings: Mapping[str, Any], tokenizer: Any, stamps: Sequence[Any]) -> str:
    """A hex digest naming the samples built from these data files, tokenizer and settings."""
    payload = json.dumps({"format": FORMAT, "code": _source_digest(), "tokenizer": tokenizer_digest(tokenizer),
                          "files": list(stamps), "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _flatten(prefix: str, samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    seqs = [q for s in samples for q in s.seqs]
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt)) if seqs else (lambda xs, dt: np.zeros(0, dt))
    return {
        f"{prefix}.ids": cat([q.ids for q in seqs], np.int64),
        f"{prefix}.target": cat([q.target for q in seqs], bool),
        f"{prefix}.lengths": np.array([len(q.ids) for q in seqs], dtype=np.int64),
        f"{prefix}.per_sample": np.array([len(s.seqs) for s in samples], dtype=np.int64),
        f"{prefix}.index": np.array([s.index for s in samples], dtype=np.int64),
        f"{prefix}.margin": np.array([s.margin for s in samples], dtype=np.float64),
        f"{prefix}.desirable": np.array([s.desirable for s in samples], dtype=bool),
        f"{prefix}.steps": np.array([len(s.step_labels) for s in samples], dtype=np.int64),
        f"{prefix}.step_labels": np.array([y for s in samples for y in s.step_labels], dtype=np.float64),
    }


def _unflatten(prefix: str, z: Mapping[str, np.ndarray]) -> list[Sample]:
    ids, target = z[f"{prefix}.ids"], z[f"{prefix}.target"]
    bounds = np.concatenate([[0], np.cumsum(z[f"{prefix}.lengths"])])
    seqs = [TokenSeq(ids=ids[a:b], target=target[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    starts = np.concatenate([[0], np.cumsum(z[f"{prefix}.per_sample"])])
    labels = z[f"{prefix}.step_labels"].tolist()
    steps = np.concatenate([[0], np.cumsum(z[f"{prefix}.steps"])]).tolist()
    return [Sample(seqs=tuple(seqs[a:b]), index=int(i), margin=float(m), desirable=bool(d),
                   step_labels=tuple(labels[u:v]))
            for a, b, i, m, d, u, v in zip(starts[:-1], starts[1:], z[f"{prefix}.index"], z[f"{prefix}.margin"],
                                           z[f"{prefix}.desirable"], steps[:-1], steps[1:], strict=True)]


def save(path: Path, splits: Mapping[str, Sequence[Sample]], dropped: int) -> Path:
    """Write ``splits`` (name -> samples) and the count of dropped rows to ``path``, atomically."""
    arrays = {k: v for name, samples in splits.items() for k, v in _flatten(name, samples).items()}
    arrays["dropped"] = np.array(dropped, dtype=np.int64)
    arrays["splits"] = np.array(list(splits), dtype=np.str_)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # atomic: readers see the old state or the whole file
    return path


def load(path: Path) -> tuple[dict[str, list[Sample]], int]:
    """(split name -> samples, dropped rows) from a file ``save`` wrote."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    splits = {str(name): _unflatten(str(name), arrays) for name in arrays["splits"]}
    return splits, int(arrays["dropped"])
