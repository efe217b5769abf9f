"""Trainers, one module per recipe: ``sft``, ``rm``, ``dpo``, ``kto``; ``base`` holds the loop
they share and ``build`` the set-up (process group, data, model, engine, logger).

``RECIPES`` maps a ``treadle-train`` command to its ``run(config)`` (imported lazily by the CLI).
"""

from __future__ import annotations

RECIPES: dict[str, str] = {
    "sft": "treadle.trainer.trainers.sft",
    "rm": "treadle.trainer.trainers.rm",
    "dpo": "treadle.trainer.trainers.dpo",
    "kto": "treadle.trainer.trainers.kto",
}
"""Command -> module defining ``run(cfg)``."""
