"""One function over every row, in worker processes (``--data.dataloader_num_workers``), in order.

``map_rows(fn, rows, workers=N)`` returns ``[fn(r) for r in rows]`` whatever N is: the rows are
cut into contiguous chunks, ``N`` processes each take chunks in turn, and the results come back
in row order, so the samples (and their cache file) are the same for 0, 1 or 16 workers. ``0``
runs ``fn`` in this process, as a torch DataLoader's ``num_workers=0`` does. A progress bar
counts rows as chunks finish. An error raised by ``fn`` on a row (a ``DataError`` naming the
file, row and key) is raised here, the first in row order, and the workers are stopped.

Workers are spawned, not forked: the trainer that calls this has joined a process group and
runs threads (gloo, tokenizers), and a forked copy of a threaded process can deadlock. ``fn``
therefore has to pickle (a module-level function, or a ``functools.partial`` of one with a
tokenizer: HF tokenizers pickle); it is sent once to each worker, then only rows and results
travel. Each worker starts a Python and imports the tokenizer's library (1.5 s on an idle core),
which pays off on datasets of tens of thousands of rows where cores are free: 100k text rows
of the tiny tokenizer took 52.6 s in-process and 10.7 s with 14 workers on a 16-core host (this
process, collecting the results, is then the bottleneck); on 2 busy cores workers are slower.
A spawned worker imports the caller's ``__main__`` module, as multiprocessing's spawn always
does: the CLIs guard theirs; a script driving the trainers itself needs
``if __name__ == "__main__":``.

Not here: what ``fn`` computes (``formatting``), which process calls this (``trainers.build``).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from treadle.trainer.data.sources import Row

T = TypeVar("T")
CHUNKS_PER_WORKER = 8  # enough chunks to balance workers and move the bar; few enough to keep overhead low
MAX_CHUNK = 512  # rows

_fn: Callable[[Row], Any] | None = None  # a worker's function, set once by _install


def _install(fn: Callable[[Row], Any]) -> None:
    global _fn  # noqa: PLW0603  (per worker process, set by the pool initializer)
    _fn = fn


def _apply(chunk: Sequence[Row]) -> list[Any]:
    assert _fn is not None, "a worker without its function"
    return [_fn(r) for r in chunk]


def chunk_size(num_rows: int, workers: int) -> int:
    """Rows per chunk: about ``CHUNKS_PER_WORKER`` chunks per worker, at most ``MAX_CHUNK`` rows."""
    return max(1, min(MAX_CHUNK, -(-num_rows // (max(workers, 1) * CHUNKS_PER_WORKER))))


def map_rows(fn: Callable[[Row], T], rows: Sequence[Row], *, workers: int, desc: str = "tokenise",
             progress: bool = True) -> list[T]:
    """``[fn(r) for r in rows]``, computed by ``workers`` spawned processes (0: this process)."""
    from tqdm.auto import tqdm  # noqa: PLC0415  (only where data is tokenised)

    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    size = chunk_size(len(rows), workers)
    chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
    out: list[T] = []
    label = f"{desc} ({workers} worker{'s' if workers != 1 else ''})" if workers else desc
    with tqdm(total=len(rows), desc=label, unit="row", disable=not progress or not rows) as bar:
        if not workers:
            for chunk in chunks:
                out.extend(fn(r) for r in chunk)
                bar.update(len(chunk))
            return out
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(workers, len(chunks)) or 1, initializer=_install, initargs=(fn,)) as pool:
            for part in pool.imap(_apply, chunks):
                out.extend(part)
                bar.update(len(part))
    return out
