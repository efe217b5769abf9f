"""OpenRLHF's SFT / RM / DPO example scripts parse unchanged into treadle's configs (issue 34, item 1).

OpenRLHF's cli code and scripts for these commands spell the trained model's group ``--model.*``
(``--model.model_name_or_path``, ``--model.beta``, ...); treadle's is ``--actor.*``, the README's
spelling, and both are accepted (aliases on the fields, ``config/model.py``). PPO keeps
``--actor.*`` only, as OpenRLHF's PPO does, and refuses ``--model.*`` naming the flag to use.

Each script below is its argument list written by hand from OpenRLHF's ``examples/scripts``
(``train_sft.sh``, ``train_sft_mixtral_lora.sh``, ``train_rm.sh``, ``train_dpo_llama.sh``), one
row per flag with the config field it sets and the value it must have, in the script's order.
Two substitutions, so that the same lines can start on CPU: the model path is the tiny test
model's (``TINY``, filled in from the ``tiny`` fixture), and ``--ds.attn_implementation
flash_attention_2`` is ``sdpa`` (flash-attn needs CUDA). The datasets keep the scripts' Hub names:
parsing does not open them.

``OPENRLHF_FLAGS`` lists every flag of OpenRLHF's ``train_sft`` / ``train_rm`` / ``train_dpo``
parsers (written by hand from its ``openrlhf/cli``): each is a flag of the treadle command or is
refused naming itself.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest

from treadle.common.config import ConfigError
from treadle.trainer.config import command_flags, parse_command

TINY = "<tiny model>"
"""Where the scripts name a model; replaced by the tiny test model's folder."""

Row = tuple[list[str], str, Any]
"""(the flag and its values as the script gives them, the config field, the value it must have)."""

TRAIN_SFT_SH: list[Row] = [
    (["--data.max_len", "2048"], "data.max_len", 2048),
    (["--data.dataset", "Open-Orca/OpenOrca"], "data.dataset", "Open-Orca/OpenOrca"),
    (["--data.input_key", "question"], "data.input_key", "question"),
    (["--data.output_key", "response"], "data.output_key", "response"),
    (["--train.batch_size", "256"], "train.batch_size", 256),
    (["--train.micro_batch_size", "2"], "train.micro_batch_size", 2),
    (["--data.max_samples", "500000"], "data.max_samples", 500000),
    (["--model.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # meta-llama/Meta-Llama-3-8B
    (["--ckpt.output_dir", "./checkpoint/llama3-8b-sft"], "ckpt.output_dir", "./checkpoint/llama3-8b-sft"),
    (["--ckpt.save_steps", "-1"], "ckpt.save_steps", -1),
    (["--logger.logging_steps", "1"], "logger.logging_steps", 1),
    (["--eval.steps", "-1"], "eval.steps", -1),
    (["--ds.zero_stage", "2"], "ds.zero_stage", 2),
    (["--train.max_epochs", "1"], "train.max_epochs", 1),
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--ds.attn_implementation", "sdpa"], "ds.attn_implementation", "sdpa"),  # flash_attention_2
    (["--adam.lr", "5e-6"], "adam.lr", 5e-6),
    (["--ckpt.load_enable"], "ckpt.load_enable", True),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    (["--model.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
]

TRAIN_SFT_MIXTRAL_LORA_SH: list[Row] = [
    (["--data.max_len", "2048"], "data.max_len", 2048),
    (["--data.dataset", "Open-Orca/OpenOrca"], "data.dataset", "Open-Orca/OpenOrca"),
    (["--data.input_key", "question"], "data.input_key", "question"),
    (["--data.output_key", "response"], "data.output_key", "response"),
    (["--train.batch_size", "128"], "train.batch_size", 128),
    (["--train.micro_batch_size", "4"], "train.micro_batch_size", 4),
    (["--data.max_samples", "500000"], "data.max_samples", 500000),
    (["--model.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # mistralai/Mixtral-8x7B-v0.1
    (["--ckpt.output_dir", "./checkpoint/mixtral-sft-lora"], "ckpt.output_dir", "./checkpoint/mixtral-sft-lora"),
    (["--ckpt.save_steps", "-1"], "ckpt.save_steps", -1),
    (["--logger.logging_steps", "1"], "logger.logging_steps", 1),
    (["--eval.steps", "-1"], "eval.steps", -1),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--train.max_epochs", "1"], "train.max_epochs", 1),
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--model.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
    (["--ds.attn_implementation", "sdpa"], "ds.attn_implementation", "sdpa"),  # flash_attention_2
    (["--adam.lr", "5e-6"], "adam.lr", 5e-6),
    (["--ds.lora.rank", "64"], "ds.lora.rank", 64),
    (["--ds.lora.alpha", "64"], "ds.lora.alpha", 64),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    (["--model.aux_loss_coef", "0.001"], "actor.aux_loss_coef", 0.001),
]

TRAIN_RM_SH: list[Row] = [
    (["--ckpt.output_dir", "./checkpoint/llama3-8b-rm"], "ckpt.output_dir", "./checkpoint/llama3-8b-rm"),
    (["--ckpt.save_steps", "-1"], "ckpt.save_steps", -1),
    (["--logger.logging_steps", "1"], "logger.logging_steps", 1),
    (["--eval.steps", "-1"], "eval.steps", -1),
    (["--train.batch_size", "256"], "train.batch_size", 256),
    (["--train.micro_batch_size", "1"], "train.micro_batch_size", 1),
    (["--model.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # OpenRLHF/Llama-3-8b-sft-mixture
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--train.max_epochs", "1"], "train.max_epochs", 1),
    (["--data.max_len", "8192"], "data.max_len", 8192),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--adam.lr", "9e-6"], "adam.lr", 9e-6),
    (["--data.dataset", "OpenRLHF/preference_dataset_mixture2_and_safe_pku"], "data.dataset",
     "OpenRLHF/preference_dataset_mixture2_and_safe_pku"),
    (["--data.apply_chat_template"], "data.apply_chat_template", True),
    (["--data.chosen_key", "chosen"], "data.chosen_key", "chosen"),
    (["--data.rejected_key", "rejected"], "data.rejected_key", "rejected"),
    (["--ds.attn_implementation", "sdpa"], "ds.attn_implementation", "sdpa"),  # flash_attention_2
    (["--ckpt.load_enable"], "ckpt.load_enable", True),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    (["--model.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
]

TRAIN_DPO_LLAMA_SH: list[Row] = [
    (["--ckpt.output_dir", "./checkpoint/llama3-8b-dpo"], "ckpt.output_dir", "./checkpoint/llama3-8b-dpo"),
    (["--ckpt.save_steps", "-1"], "ckpt.save_steps", -1),
    (["--logger.logging_steps", "1"], "logger.logging_steps", 1),
    (["--eval.steps", "-1"], "eval.steps", -1),
    (["--train.batch_size", "256"], "train.batch_size", 256),
    (["--train.micro_batch_size", "1"], "train.micro_batch_size", 1),
    (["--model.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # OpenRLHF/Llama-3-8b-sft-mixture
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--train.max_epochs", "1"], "train.max_epochs", 1),
    (["--data.max_len", "8192"], "data.max_len", 8192),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--adam.lr", "5e-7"], "adam.lr", 5e-7),
    (["--model.beta", "0.1"], "actor.beta", 0.1),
    (["--data.dataset", "OpenRLHF/preference_dataset_mixture2_and_safe_pku"], "data.dataset",
     "OpenRLHF/preference_dataset_mixture2_and_safe_pku"),
    (["--data.apply_chat_template"], "data.apply_chat_template", True),
    (["--data.chosen_key", "chosen"], "data.chosen_key", "chosen"),
    (["--data.rejected_key", "rejected"], "data.rejected_key", "rejected"),
    (["--ds.attn_implementation", "sdpa"], "ds.attn_implementation", "sdpa"),  # flash_attention_2
    (["--ckpt.load_enable"], "ckpt.load_enable", True),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    (["--model.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
]

SCRIPTS: dict[str, tuple[str, list[Row]]] = {
    "train_sft.sh": ("sft", TRAIN_SFT_SH),
    "train_sft_mixtral_lora.sh": ("sft", TRAIN_SFT_MIXTRAL_LORA_SH),
    "train_rm.sh": ("rm", TRAIN_RM_SH),
    "train_dpo_llama.sh": ("dpo", TRAIN_DPO_LLAMA_SH),
}

DPO_COMMENTED: list[Row] = [  # the options train_dpo_llama.sh lists in its comments, each added alone
    (["--logger.wandb.key", "{wandb_token}"], "logger.wandb.key", "{wandb_token}"),
    (["--model.ipo_enable"], "actor.loss_type", "ipo"),  # [for IPO]
    (["--model.label_smoothing", "0.1"], "actor.label_smoothing", 0.1),  # [for cDPO]
    (["--ref.offload"], "ref.offload", True),
    (["--model.nll_loss_coef", "0.2"], "actor.nll_loss_coef", 0.2),  # the script gives no value
]

MODEL_GROUP: list[tuple[str, Row]] = [  # every --model.* flag of OpenRLHF's train_sft / train_rm / train_dpo
    ("sft", (["--model.model_name_or_path", TINY], "actor.model_name_or_path", TINY)),
    ("sft", (["--model.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True)),
    ("sft", (["--model.gradient_checkpointing_reentrant"], "actor.gradient_checkpointing_reentrant", True)),
    ("sft", (["--model.aux_loss_coef", "0.01"], "actor.aux_loss_coef", 0.01)),
    ("sft", (["--model.pretrain_mode_enable"], "actor.pretrain_mode_enable", True)),
    ("rm", (["--model.model_name_or_path", TINY], "actor.model_name_or_path", TINY)),
    ("rm", (["--model.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True)),
    ("rm", (["--model.gradient_checkpointing_reentrant"], "actor.gradient_checkpointing_reentrant", True)),
    ("rm", (["--model.aux_loss_coef", "0.01"], "actor.aux_loss_coef", 0.01)),
    ("rm", (["--model.compute_fp32_loss_enable"], "actor.compute_fp32_loss_enable", True)),
    ("rm", (["--model.margin_loss_enable"], "actor.margin_loss_enable", True)),
    ("rm", (["--model.loss_type", "logexp"], "actor.loss_type", "logexp")),
    ("dpo", (["--model.model_name_or_path", TINY], "actor.model_name_or_path", TINY)),
    ("dpo", (["--model.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True)),
    ("dpo", (["--model.gradient_checkpointing_reentrant"], "actor.gradient_checkpointing_reentrant", True)),
    ("dpo", (["--model.beta", "0.3"], "actor.beta", 0.3)),
    ("dpo", (["--model.ipo_enable"], "actor.loss_type", "ipo")),
    ("dpo", (["--model.label_smoothing", "0.1"], "actor.label_smoothing", 0.1)),
    ("dpo", (["--model.aux_loss_coef", "0.01"], "actor.aux_loss_coef", 0.01)),
    ("dpo", (["--model.nll_loss_coef", "0.2"], "actor.nll_loss_coef", 0.2)),
]

_SHARED_FLAGS = [
    "--ckpt.output_dir", "--ckpt.save_steps", "--ckpt.save_hf", "--ckpt.disable_ds", "--logger.logging_steps",
    "--eval.steps", "--ckpt.path", "--ckpt.max_num", "--ckpt.max_mem", "--ckpt.load_enable",
    "--ds.use_universal_ckpt", "--train.micro_batch_size", "--train.batch_size",
    "--model.gradient_checkpointing_enable", "--ds.deepcompile", "--train.seed", "--train.full_determinism_enable",
    "--local_rank", "--ds.zero_stage", "--ds.param_dtype", "--ds.zpg", "--ds.adam_offload",
    "--ds.attn_implementation", "--ds.experts_implementation", "--ds.grad_accum_dtype", "--ds.overlap_comm",
    "--model.gradient_checkpointing_reentrant", "--data.disable_fast_tokenizer", "--data.dataloader_num_workers",
    "--ds.tensor_parallel_size", "--train.max_epochs", "--model.aux_loss_coef", "--model.model_name_or_path",
    "--optim", "--muon.lr", "--muon.momentum", "--muon.ns_steps", "--muon.nesterov", "--muon.no_nesterov",
    "--adam.lr", "--adam.betas", "--adam.eps", "--adam.weight_decay", "--lr_scheduler", "--lr_warmup_ratio",
    "--min_lr_ratio", "--max_norm", "--ds.ring_attn_size", "--ds.ring_attn_head_stride", "--ds.lora.rank",
    "--ds.lora.alpha", "--ds.lora.target_modules", "--ds.lora.dropout", "--ds.packing_samples", "--data.dataset",
    "--data.dataset_probs", "--eval.dataset", "--data.dataset_split", "--eval.split", "--data.max_samples",
    "--data.input_template", "--data.apply_chat_template", "--data.tokenizer_chat_template", "--data.max_len",
    "--logger.wandb.key", "--logger.wandb.org", "--logger.wandb.group", "--logger.wandb.project",
    "--logger.wandb.run_name", "--logger.tensorboard_dir", "--use_ms"
]

OPENRLHF_FLAGS: dict[str, list[str]] = {
    "sft": [*_SHARED_FLAGS, "--ds.use_liger_kernel", "--ds.load_in_4bit", "--model.pretrain_mode_enable",
            "--data.multiturn", "--data.input_key", "--data.output_key"],
    "rm": [*_SHARED_FLAGS, "--ds.value_head_prefix", "--model.compute_fp32_loss_enable",
           "--model.margin_loss_enable", "--model.loss_type", "--data.prompt_key", "--data.chosen_key",
           "--data.rejected_key"],
    "dpo": [*_SHARED_FLAGS, "--ds.use_liger_kernel", "--ref.offload", "--model.beta", "--model.ipo_enable",
            "--model.label_smoothing", "--model.nll_loss_coef", "--ref.model_name_or_path", "--data.prompt_key",
            "--data.chosen_key", "--data.rejected_key"],
}
"""Every flag of OpenRLHF's ``train_sft`` / ``train_rm`` / ``train_dpo`` argument parsers."""

REFUSED = {"--use_ms": "ModelScope is not supported"}
"""Those of ``OPENRLHF_FLAGS`` treadle refuses, and the reason it gives."""


def argv(rows: list[Row], model: str) -> list[str]:
    """The script's arguments, with ``model`` where it names ``TINY``."""
    return [model if word == TINY else word for flags, _, _ in rows for word in flags]


def field(cfg: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), cfg)


def check(cfg: Any, rows: list[Row], model: str) -> None:
    for flags, path, value in rows:
        assert field(cfg, path) == (model if value == TINY else value), (flags, path)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_openrlhfs_script_parses_with_every_value_in_place(script: str, tiny: Path) -> None:
    command, rows = SCRIPTS[script]
    cfg = parse_command(command, argv(rows, str(tiny)))
    check(cfg, rows, str(tiny))


def test_the_mixtral_scripts_moe_loss_is_refused_by_name_before_anything_loads(tiny: Path) -> None:
    """train_sft_mixtral_lora.sh's ``--model.aux_loss_coef 0.001`` parses, and the run stops at
    start-up (the MoE load-balancing loss is not implemented); without it the script runs."""
    from treadle.trainer.trainers.build import _refuse_unavailable

    cfg = parse_command("sft", argv(TRAIN_SFT_MIXTRAL_LORA_SH, str(tiny)))
    with pytest.raises(ConfigError, match=r"^--actor\.aux_loss_coef > 0 \(MoE load balancing\): not available"):
        _refuse_unavailable(cfg, ring_supported=True)
    for script in ("train_sft.sh", "train_rm.sh", "train_dpo_llama.sh"):
        command, rows = SCRIPTS[script]
        _refuse_unavailable(parse_command(command, argv(rows, str(tiny))), ring_supported=True)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_model_and_actor_spell_the_same_config(script: str) -> None:
    """The README's ``--actor.*`` keeps working: the same line with ``--actor.`` gives the same config."""
    command, rows = SCRIPTS[script]
    line = argv(rows, "m")
    actor = [w.replace("--model.", "--actor.", 1) if w.startswith("--model.") else w for w in line]
    assert actor != line and parse_command(command, actor) == parse_command(command, line)


@pytest.mark.parametrize("row", DPO_COMMENTED, ids=lambda row: row[0][0])
def test_the_dpo_scripts_commented_options_parse(row: Row) -> None:
    cfg = parse_command("dpo", [*argv(TRAIN_DPO_LLAMA_SH, "m"), *row[0]])
    check(cfg, [row], "m")
    assert cfg.actor.beta == 0.1  # the script's own values stay


@pytest.mark.parametrize(("command", "row"), MODEL_GROUP, ids=lambda x: x if isinstance(x, str) else x[0][0])
def test_every_model_flag_of_openrlhf_sets_its_treadle_field(command: str, row: Row) -> None:
    base = ["--model.model_name_or_path", "m", "--data.dataset", "d"]
    cfg = parse_command(command, [*base, *argv([row], "m")])
    check(cfg, [row], "m")
    assert row[0][0] in OPENRLHF_FLAGS[command]


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto"])
def test_every_field_of_the_trained_model_has_a_model_spelling(command: str) -> None:
    """The whole group, treadle's own fields too (``--model.loss_agg_mode``; KTO, which OpenRLHF
    no longer has, shares the group): ``--model.X`` is ``--actor.X`` in every offline command."""
    flags = set(command_flags(command))
    cls = type(parse_command(command, ["--actor.model_name_or_path", "m", "--data.dataset", "d"]).actor)
    for f in dataclasses.fields(cls):
        assert {f"--model.{f.name}", f"--actor.{f.name}"} <= flags, f.name


@pytest.mark.parametrize("command", list(OPENRLHF_FLAGS))
def test_every_flag_of_openrlhfs_parser_is_accepted_or_refused_by_name(command: str) -> None:
    flags = set(command_flags(command))
    for flag in OPENRLHF_FLAGS[command]:
        if flag in REFUSED:
            assert flag not in flags
            with pytest.raises(ConfigError, match=rf"^{flag}: {REFUSED[flag]}"):
                parse_command(command, ["--model.model_name_or_path", "m", "--data.dataset", "d", flag])
        else:
            assert flag in flags, f"{command}: {flag}"


def test_ipo_enable_is_a_switch_for_the_ipo_loss() -> None:
    base = ["--model.model_name_or_path", "m", "--data.dataset", "d"]
    assert parse_command("dpo", base).actor.loss_type == "sigmoid"
    assert parse_command("dpo", [*base, "--model.ipo_enable"]) == parse_command("dpo", [*base, "--actor.loss_type", "ipo"])
    assert parse_command("dpo", [*base, "--model.ipo-enable"]).actor.loss_type == "ipo"  # as tyro takes --a.b-c
    with pytest.raises(ConfigError, match=r"--model\.ipo_enable is a switch \(it means --actor\.loss_type ipo\)"):
        parse_command("dpo", [*base, "--model.ipo_enable=True"])
    # IPO ignores cDPO's label smoothing in OpenRLHF; treadle refuses the pair, naming the switch
    with pytest.raises(ConfigError, match=r"--actor\.label_smoothing \(cDPO\) applies to --actor\.loss_type sigmoid, "
                                          r"not ipo \(--model\.ipo_enable\)"):
        parse_command("dpo", [*base, "--model.ipo_enable", "--model.label_smoothing", "0.1"])


@pytest.mark.parametrize("flag", ["--model.model_name_or_path", "--model.gradient_checkpointing_enable",
                                  "--model.gradient_checkpointing_reentrant", "--model.aux_loss_coef"])
def test_ppo_keeps_actor_and_refuses_the_model_spelling_naming_it(flag: str) -> None:
    with pytest.raises(ConfigError, match=rf"{flag} was renamed: use --actor\.{flag.split('.')[1]} instead"):
        parse_command("ppo", [flag, "1"])
    assert flag not in command_flags("ppo")


def test_validation_messages_name_the_actor_flag_of_a_model_flag() -> None:
    with pytest.raises(ConfigError, match=r"--actor\.beta must be > 0, got 0\.0"):
        parse_command("dpo", ["--model.model_name_or_path", "m", "--data.dataset", "d", "--model.beta", "0"])
    with pytest.raises(ConfigError, match=r"--actor\.model_name_or_path is required"):
        parse_command("sft", ["--data.dataset", "d"])
