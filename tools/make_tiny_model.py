"""Write a tiny Qwen2-architecture model and its tokenizer into a folder (see tools/tiny_model.py).

    .venv/bin/python tools/make_tiny_model.py --preset tiny --out .cache/models/tiny --seed 0

Offline and deterministic: the same preset and seed give byte-identical files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tyro
from tiny_model import PRESETS, PresetName, build


@dataclass(frozen=True, slots=True, kw_only=True)
class Args:
    """Build a randomly initialised tiny model for tests and demos."""

    preset: PresetName = "tiny"  # model size; see PRESETS in tools/tiny_model.py
    out: Path  # folder to write (created; existing files overwritten)
    seed: int = 0  # torch seed of the weight initialisation


def main() -> None:
    args = tyro.cli(Args)
    from transformers.utils import logging

    logging.disable_progress_bar()  # one "Writing model shards" bar per build is noise here
    info = build(args.preset, args.out, args.seed)
    spec = PRESETS[args.preset]
    print(f"{info.out}: preset={info.preset} seed={info.seed} parameters={info.num_parameters:,} "
          f"vocab={info.vocab_size} layers={spec.num_hidden_layers} hidden={spec.hidden_size} "
          f"tied={spec.tie_word_embeddings} in {info.seconds:.1f}s")


if __name__ == "__main__":
    main()
