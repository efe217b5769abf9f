"""Rows of training data from local files and folders (or HF hub names), mixed by probability.

A dataset spec is a path or a hub name. A file (``.json``, ``.jsonl``, ``.parquet``, ``.csv``,
``.arrow``) is read whole; a folder contributes the files of the requested split (names
starting with the split, e.g. ``train.jsonl``, ``test-00001.parquet``), or every data file when
the split is ``train`` and no file name mentions a split. A folder written by ``datasets``'
``save_to_disk`` is read with ``load_from_disk``: a ``DatasetDict``'s split by name, a
``Dataset`` (which has no splits) as ``train``. Anything else goes to
``datasets.load_dataset(name, split=...)`` (the hub; offline machines fail there, loudly).
Each row remembers its file and row number so a malformed one is reported as
``data/x.jsonl row 17: key 'output': missing``.

Not here: tokenisation (``formatting``) and the per-step order (``order``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from treadle.common.config import ConfigError

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
SPLIT_NAMES = ("train", "test", "validation", "valid", "eval", "dev")


class DataError(ConfigError):
    """A malformed dataset or row; the message names the file, the row and the key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One row of a dataset, with where it came from."""

    data: Mapping[str, Any]
    """The row's columns."""
    file: str
    """File (or hub dataset name) the row came from."""
    index: int
    """Row number within that file, from 0."""

    def error(self, key: str | None, problem: str) -> DataError:
        """A ``DataError`` naming this row's file, row number and ``key``."""
        where = f"{self.file} row {self.index}" + (f": key {key!r}" if key else "")
        return DataError(f"{where}: {problem}")

    def get(self, key: str, kinds: type | tuple[type, ...] = str) -> Any:
        """``data[key]``, checked to be present, non-empty and of ``kinds``; DataError otherwise."""
        value = self.data.get(key)
        if value is None:  # datasets fills a key absent from some rows with null
            present = [k for k, v in self.data.items() if v is not None]
            raise self.error(key, f"missing or null (columns here: {', '.join(map(str, present)) or 'none'})")
        if not isinstance(value, kinds) or (isinstance(value, (str, list)) and not value):
            want = kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
            raise self.error(key, f"expected a non-empty {want}, got {_short(value)}")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def split_files(path: Path, split: str) -> list[Path]:
    """The data files of ``split`` in folder ``path`` (see the module docstring); sorted."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS)
    named = [p for p in files if p.name.lower().startswith(split.lower())]
    if named:
        return named
    if split == "train" and not any(p.name.lower().startswith(SPLIT_NAMES) for p in files):
        return files
    raise DataError(f"{path}: no data file for split {split!r} (files: {', '.join(p.name for p in files) or 'none'})")


def saved_split(path: Path, split: str) -> Path | None:
    """The folder holding ``split`` when ``path`` was written by ``save_to_disk`` (a
    ``DatasetDict``: its split's folder; a ``Dataset``: ``path`` itself, for ``train`` only);
    None when it was not."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise DataError(f"{path}: a saved DatasetDict without split {split!r} (splits: {', '.join(splits) or 'none'})")
        return path / split
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        if split != "train":
            raise DataError(f"{path}: a saved Dataset has no splits, so it reads as 'train' only; got split {split!r}")
        return path
    return None


def read_saved(folder: Path) -> list[Row]:
    """Every row of one ``save_to_disk`` folder of a ``Dataset``."""
    import datasets  # noqa: PLC0415  (heavy)

    try:
        table = datasets.load_from_disk(str(folder))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{folder}: cannot read the saved dataset ({type(e).__name__}: {e})") from None
    return [Row(data=r, file=str(folder), index=i) for i, r in enumerate(table)]


def _find_bad_json_line(file: Path) -> DataError | None:
    with file.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                if not isinstance(json.loads(line), dict):
                    return DataError(f"{file} row {i}: expected a JSON object per line")
            except json.JSONDecodeError as e:
                return DataError(f"{file} row {i}: not valid JSON ({e.msg})")
    return None


def read_file(file: Path) -> list[Row]:
    """Every row of one data file."""
    import datasets  # noqa: PLC0415  (heavy)

    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(BUILDERS[file.suffix], data_files=str(file), split="train")
    except Exception as e:  # noqa: BLE001  (datasets raises many kinds; name the file instead)
        bad = _find_bad_json_line(file) if file.suffix == ".jsonl" else None
        raise (bad or DataError(f"{file}: cannot read it ({type(e).__name__}: {e})")) from None
    return [Row(data=r, file=str(file), index=i) for i, r in enumerate(table)]


def data_files(spec: str, split: str = "train") -> list[Path] | None:
    """The local files ``load_rows(spec, split)`` reads; None when ``spec`` is a hub name."""
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        saved = saved_split(path, split)
        if saved is not None:
            return sorted(p for p in saved.iterdir() if p.is_file())
        return split_files(path, split)
    return None


def load_rows(spec: str, split: str = "train") -> list[Row]:
    """Rows of one dataset spec (file, folder or hub name) and split."""
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix not in BUILDERS:
            raise DataError(f"{path}: unknown data file type {path.suffix!r} (known: {', '.join(BUILDERS)})")
        return read_file(path)
    if path.is_dir():
        saved = saved_split(path, split)
        if saved is not None:
            return read_saved(saved)
        return [row for f in split_files(path, split) for row in read_file(f)]
    import datasets  # noqa: PLC0415

    try:
        table = datasets.load_dataset(spec, split=split)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{spec}: not a local file or folder, and the hub load failed ({type(e).__name__}: {e})") from None
    return [Row(data=r, file=spec, index=i) for i, r in enumerate(table)]


def mix(datasets: Sequence[Sequence[Row]], probs: Sequence[float], max_samples: int, seed: int) -> list[Row]:
    """Interleave datasets: each drawn row comes from dataset i with probability p_i.

    Draws ``min(max_samples, total rows)`` rows; each dataset is read in order and starts over
    when exhausted (so a small, highly weighted dataset repeats). One dataset: its first
    ``max_samples`` rows, in order. Deterministic in ``seed``.
    """
    if len(datasets) == 1:
        return list(datasets[0][:max_samples])
    for rows, p in zip(datasets, probs, strict=True):
        if p > 0 and not rows:
            raise DataError("a dataset with a non-zero mixing probability has no rows")
    n = min(max_samples, sum(len(rows) for rows in datasets))
    choice = np.random.default_rng(seed).choice(len(datasets), size=n, p=np.asarray(probs) / sum(probs))
    cursors = [0] * len(datasets)
    out = []
    for i in choice.tolist():
        rows = datasets[i]
        out.append(rows[cursors[i] % len(rows)])
        cursors[i] += 1
    return out


def load_mixture(specs: Sequence[str], probs: Sequence[float], split: str, max_samples: int, seed: int) -> list[Row]:
    """``mix`` of ``load_rows(spec, split)`` for every spec."""
    if not specs:
        raise DataError("no dataset given")
    return mix([load_rows(s, split) for s in specs], probs, max_samples, seed)
