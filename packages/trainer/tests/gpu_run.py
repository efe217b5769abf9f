"""Run a trainer script on the GPU machine, which has no HF ``datasets`` package (PLATFORM.md):
jsonl files are read with the json module instead; everything else is the real code.

    torchrun --nproc_per_node 2 packages/trainer/tests/gpu_run.py SCRIPT.py ARGS...
"""

from __future__ import annotations

import importlib.util
import json
import runpy
import sys
from pathlib import Path


def _read_jsonl(file: Path) -> list:
    from treadle.trainer.data.sources import Row

    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    keys = {k for r in rows for k in r}
    return [Row(data={k: r.get(k) for k in keys}, file=str(file), index=i) for i, r in enumerate(rows)]


if __name__ == "__main__":
    if importlib.util.find_spec("datasets") is None:
        import treadle.trainer.data.sources as sources

        sources.read_file = _read_jsonl
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
