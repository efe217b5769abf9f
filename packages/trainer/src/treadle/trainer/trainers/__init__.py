"""Trainers, one module per recipe: ``sft``, ``kd``, ``rm``, ``prm``, ``dpo``, ``kto``, ``ppo`` (RL, with ``ppo_build``); ``base`` holds the loop
they share and ``build`` the set-up (process group, data, model, engine, logger).

``RECIPES`` maps a ``treadle-train`` command to its ``run(config)`` (imported lazily by the CLI).
"""

from __future__ import annotations

RECIPES: dict[str, str] = {
    "sft": "treadle.trainer.trainers.sft",
    "kd": "treadle.trainer.trainers.kd",
    "rm": "treadle.trainer.trainers.rm",
    "prm": "treadle.trainer.trainers.prm",
    "dpo": "treadle.trainer.trainers.dpo",
    "kto": "treadle.trainer.trainers.kto",
    "ppo": "treadle.trainer.trainers.ppo",
    "critic": "treadle.trainer.trainers.critic",
}
"""Command -> module defining ``run(cfg)``."""
