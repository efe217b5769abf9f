"""Typed configuration of the training commands and their command lines (no torch, no deepspeed).

``parse_sft(argv)``, ``parse_kd(argv)``, ``parse_rm(argv)``, ``parse_prm(argv)``, ``parse_dpo(argv)``, ``parse_kto(argv)`` and
``parse_ppo(argv)`` return a validated, frozen ``SFTConfig`` / ``KDConfig`` / ``RMConfig`` / ``PRMConfig`` / ``DPOConfig`` /
``KTOConfig`` / ``PPOConfig`` from OpenRLHF-style dotted flags
(``--actor.model_name_or_path X --ds.zero_stage 3 --train.colocate_all``), a ``--config``
YAML file of defaults, or both. Groups live in one module per concern: ``model`` (actor,
critic, ref, reward), ``optim``, ``deepspeed`` (``ds``), ``data``, ``train``, ``rollout`` (+
``vllm``), ``algo`` (advantage / IS correction / KL), ``ckpt``, ``logger``, ``eval``;
``commands`` composes them (``prm``: the PRM command's config and data; ``kd``: distillation's; ``teacher``: the
teacher of ``kd`` and of PPO's on-policy distillation); ``renamed`` lists retired flags.

``python -m treadle.trainer.config --dump-flags`` prints every command's flag set (the pinned
snapshot); ``python -m treadle.trainer.config ppo ARGS...`` prints the resolved config as YAML.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from treadle.common.config import ConfigError, dump_yaml, flag_names, load_yaml, parse
from treadle.trainer.config.algo import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS, AdvantageEstimator
from treadle.trainer.config.commands import DPOConfig, KTOConfig, PPOConfig, RMConfig, SFTConfig
from treadle.trainer.config.critic import CriticServeConfig
from treadle.trainer.config.kd import KDConfig
from treadle.trainer.config.prm import PRMConfig
from treadle.trainer.config.renamed import (
    RENAMED_DPO,
    RENAMED_KD,
    RENAMED_KTO,
    RENAMED_PPO,
    RENAMED_PRM,
    RENAMED_RM,
    RENAMED_SFT,
)

COMMANDS: Mapping[str, tuple[type, Mapping[str, str]]] = MappingProxyType({
    "sft": (SFTConfig, RENAMED_SFT),
    "kd": (KDConfig, RENAMED_KD),
    "rm": (RMConfig, RENAMED_RM),
    "prm": (PRMConfig, RENAMED_PRM),
    "dpo": (DPOConfig, RENAMED_DPO),
    "kto": (KTOConfig, RENAMED_KTO),
    "ppo": (PPOConfig, RENAMED_PPO),
    "critic": (CriticServeConfig, MappingProxyType({})),
})
"""Command name -> (config class, retired flags)."""


def parse_command(command: str, argv: Sequence[str] | None = None) -> Any:
    """The validated config of ``command`` ("sft", "kd", "rm", "prm", "dpo", "kto", "ppo") from ``argv`` (``sys.argv[1:]`` if None)."""
    cls, renamed = COMMANDS[command]
    return parse(cls, argv, prog=f"treadle-train {command}", renamed=renamed)


def parse_sft(argv: Sequence[str] | None = None) -> SFTConfig:
    """``SFTConfig`` from the command line of ``treadle-train sft``."""
    return parse_command("sft", argv)


def parse_kd(argv: Sequence[str] | None = None) -> KDConfig:
    """``KDConfig`` from the command line of ``treadle-train kd``."""
    return parse_command("kd", argv)


def parse_rm(argv: Sequence[str] | None = None) -> RMConfig:
    """``RMConfig`` from the command line of ``treadle-train rm``."""
    return parse_command("rm", argv)


def parse_prm(argv: Sequence[str] | None = None) -> PRMConfig:
    """``PRMConfig`` from the command line of ``treadle-train prm``."""
    return parse_command("prm", argv)


def parse_dpo(argv: Sequence[str] | None = None) -> DPOConfig:
    """``DPOConfig`` from the command line of ``treadle-train dpo``."""
    return parse_command("dpo", argv)


def parse_kto(argv: Sequence[str] | None = None) -> KTOConfig:
    """``KTOConfig`` from the command line of ``treadle-train kto``."""
    return parse_command("kto", argv)


def parse_ppo(argv: Sequence[str] | None = None) -> PPOConfig:
    """``PPOConfig`` from the command line of ``treadle-train ppo``."""
    return parse_command("ppo", argv)


def command_flags(command: str) -> list[str]:
    """Sorted option strings that ``command`` accepts (retired names excluded: they only raise)."""
    return flag_names(COMMANDS[command][0])


def flags_snapshot(commands: Sequence[str] | None = None) -> str:
    """The pinned text: ``[command]`` then one flag per line, for each command (all by default)."""
    names = list(COMMANDS) if commands is None else list(commands)
    return "\n".join(f"[{name}]\n" + "\n".join(command_flags(name)) + "\n" for name in names)


__all__ = [
    "ADVANTAGE_ESTIMATORS", "COMMANDS", "GROUP_ESTIMATORS", "AdvantageEstimator", "ConfigError",
    "DPOConfig", "KDConfig", "KTOConfig", "PPOConfig", "PRMConfig", "RMConfig", "SFTConfig", "command_flags", "dump_yaml",
    "flags_snapshot", "load_yaml", "parse_command", "parse_dpo", "parse_kd", "parse_kto", "parse_ppo", "parse_prm", "parse_rm",
    "parse_sft",
]
