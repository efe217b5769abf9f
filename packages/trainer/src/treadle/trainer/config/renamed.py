"""Retired flag names -> their dotted replacements, per command.

OpenRLHF moved from flat flags (``--pretrain``, ``--zero_stage``, ``--actor_learning_rate``) to
dotted groups; users' scripts still carry the old spellings. ``parse`` turns each of them into
an error naming the new flag (never a silent rewrite, since several changed meaning or split,
e.g. ``--bf16`` became ``--ds.param_dtype bf16``). A value may list several flags (``a / b``)
when one old flag split into several. ``--value_prefix_head`` is the spelling in the README's
prose (the real old flag was ``--value_head_prefix``).

OpenRLHF flags of features treadle does not have at all (vision-language models, ModelScope) map
to the reason instead of a replacement: using one is an error saying so, where tyro would only
say "Unrecognized options".

Not here: spellings that are still accepted (``--prompt_max_len``, ``--generate_max_len``,
``--chosen_key``, ``--rejected_key``, and the ``--model.*`` group of OpenRLHF's SFT / RM / DPO
commands, which is treadle's ``--actor.*`` there): those are aliases declared on their fields
(``config.model``). PPO refuses ``--model.*`` naming its ``--actor.*`` flag: OpenRLHF's PPO
spells its policy ``--actor.*`` as treadle does.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

_VISION = "vision-language models are not supported (text-only models and prompts)"
_UNSUPPORTED: dict[str, str] = {
    "--data.image_key": _VISION,
    "--data.max_images_per_prompt": _VISION,
    "--actor.freeze_visual_encoder": _VISION,
    "--use_ms": "ModelScope is not supported: models and datasets load from the Hugging Face hub or local paths",
}
"""OpenRLHF flags refused outright -> why (no flag replaces them)."""

_SHARED: dict[str, str] = {
    **_UNSUPPORTED,
    # models
    "--pretrain": "--actor.model_name_or_path",
    "--gradient_checkpointing": "--actor.gradient_checkpointing_enable",
    "--gradient_checkpointing_use_reentrant": "--actor.gradient_checkpointing_reentrant",
    "--aux_loss_coef": "--actor.aux_loss_coef",
    # checkpoints, logging, eval
    "--save_path": "--ckpt.output_dir",
    "--ckpt_path": "--ckpt.path",
    "--save_steps": "--ckpt.save_steps",
    "--max_ckpt_num": "--ckpt.max_num",
    "--max_ckpt_mem": "--ckpt.max_mem",
    "--load_checkpoint": "--ckpt.load_enable",
    "--save_hf_ckpt": "--ckpt.save_hf",
    "--disable_ds_ckpt": "--ckpt.disable_ds",
    "--logging_steps": "--logger.logging_steps",
    "--use_wandb": "--logger.wandb.key",
    "--wandb_org": "--logger.wandb.org",
    "--wandb_group": "--logger.wandb.group",
    "--wandb_project": "--logger.wandb.project",
    "--wandb_run_name": "--logger.wandb.run_name",
    "--use_tensorboard": "--logger.tensorboard_dir",
    "--eval_steps": "--eval.steps",
    "--eval_dataset": "--eval.dataset",
    "--eval_split": "--eval.split",
    # DeepSpeed and friends
    "--zero_stage": "--ds.zero_stage",
    "--bf16": "--ds.param_dtype",
    "--flash_attn": "--ds.attn_implementation",
    "--attn_implementation": "--ds.attn_implementation",
    "--adam_offload": "--ds.adam_offload",
    "--zpg": "--ds.zpg",
    "--overlap_comm": "--ds.overlap_comm",
    "--grad_accum_dtype": "--ds.grad_accum_dtype",
    "--use_liger_kernel": "--ds.use_liger_kernel",
    "--deepcompile": "--ds.deepcompile",
    "--packing_samples": "--ds.packing_samples",
    "--ring_attn_size": "--ds.ring_attn_size",
    "--ring_head_stride": "--ds.ring_attn_head_stride",
    "--ds_tensor_parallel_size": "--ds.tensor_parallel_size",
    "--use_ds_universal_ckpt": "--ds.use_universal_ckpt",
    "--load_in_4bit": "--ds.load_in_4bit",
    "--lora_rank": "--ds.lora.rank",
    "--lora_alpha": "--ds.lora.alpha",
    "--lora_dropout": "--ds.lora.dropout",
    "--target_modules": "--ds.lora.target_modules",
    "--value_head_prefix": "--ds.value_head_prefix",
    "--value_prefix_head": "--ds.value_head_prefix",
    # loop
    "--micro_train_batch_size": "--train.micro_batch_size",
    "--train_batch_size": "--train.batch_size",
    "--max_epochs": "--train.max_epochs",
    "--seed": "--train.seed",
    "--full_determinism": "--train.full_determinism_enable",
    # data
    "--disable_fast_tokenizer": "--data.disable_fast_tokenizer",
    "--apply_chat_template": "--data.apply_chat_template",
    "--input_template": "--data.input_template",
    "--tokenizer_chat_template": "--data.tokenizer_chat_template",
    "--max_samples": "--data.max_samples",
    "--max_len": "--data.max_len",
}

_SUPERVISED: dict[str, str] = {
    "--learning_rate": "--adam.lr",
    "--adam_betas": "--adam.betas",
    "--l2": "--adam.weight_decay",
    "--dataset": "--data.dataset",
    "--dataset_probs": "--data.dataset_probs",
    "--train_split": "--data.dataset_split",
}

RENAMED_SFT: Mapping[str, str] = MappingProxyType({
    **_SHARED, **_SUPERVISED,
    "--input_key": "--data.input_key",
    "--output_key": "--data.output_key",
    "--multiturn": "--data.multiturn",
    "--pretrain_mode": "--actor.pretrain_mode_enable",
})

RENAMED_KD: Mapping[str, str] = MappingProxyType({
    **_SHARED, **_SUPERVISED,
    "--input_key": "--data.input_key",
    "--output_key": "--data.output_key",
    "--multiturn": "--data.multiturn",
    "--teacher_model": "--teacher.model_name_or_path",
    "--teacher_offload": "--teacher.offload",
    "--kd_coef": "--teacher.kd_coef",
})

RENAMED_RM: Mapping[str, str] = MappingProxyType({
    **_SHARED, **_SUPERVISED,
    "--prompt_key": "--data.prompt_key",
    "--loss": "--actor.loss_type",
    "--margin_loss": "--actor.margin_loss_enable",
    "--compute_fp32_loss": "--actor.compute_fp32_loss_enable",
})

RENAMED_PRM: Mapping[str, str] = MappingProxyType({
    **_SHARED, **_SUPERVISED,
    "--input_key": "--data.input_key",
    "--label_key": "--data.label_key",
    "--placeholder_token": "--data.placeholder_token",
    "--reward_tokens": "--data.reward_tokens",
})

_PREFERENCE: dict[str, str] = {
    "--beta": "--actor.beta",
    "--ref_offload": "--ref.offload",
}

RENAMED_DPO: Mapping[str, str] = MappingProxyType({
    **_SHARED, **_SUPERVISED, **_PREFERENCE,
    "--prompt_key": "--data.prompt_key",
    "--ipo": "--actor.loss_type",
    "--label_smoothing": "--actor.label_smoothing",
    "--nll_loss_coef": "--actor.nll_loss_coef",
})

RENAMED_KTO: Mapping[str, str] = MappingProxyType({
    **_SHARED, **_SUPERVISED, **_PREFERENCE,
    "--input_key": "--data.input_key",
    "--output_key": "--data.output_key",
    "--label_key": "--data.label_key",
    "--desirable_loss_weight": "--actor.desirable_weight",
    "--undesirable_loss_weight": "--actor.undesirable_weight",
})

_PLACEMENT = {
    f"--{role}_{what}": f"--{role}.{what}"
    for role in ("actor", "critic", "ref", "reward") for what in ("num_nodes", "num_gpus_per_node")
}

_OFFLINE_MODEL = {  # OpenRLHF's SFT / RM / DPO spelling of the policy's fields that PPO's actor has too
    f"--model.{name}": f"--actor.{name}" for name in (
        "model_name_or_path", "gradient_checkpointing_enable", "gradient_checkpointing_reentrant", "aux_loss_coef")
}

RENAMED_PPO: Mapping[str, str] = MappingProxyType({
    **_SHARED, **_PLACEMENT, **_OFFLINE_MODEL,
    "--reward_pretrain": "--reward.model_name_or_path",
    "--critic_pretrain": "--critic.model_name_or_path",
    "--remote_rm_url": "--reward.remote_url",
    "--ref_reward_offload": "--ref.offload / --reward.offload",
    "--actor_learning_rate": "--actor.adam.lr",
    "--critic_learning_rate": "--critic.adam.lr",
    "--adam_betas": "--actor.adam.betas / --critic.adam.betas",
    "--l2": "--actor.adam.weight_decay / --critic.adam.weight_decay",
    "--lr_scheduler": "--actor.lr_scheduler / --critic.lr_scheduler",
    "--lr_warmup_ratio": "--actor.lr_warmup_ratio / --critic.lr_warmup_ratio",
    "--max_norm": "--actor.max_norm / --critic.max_norm",
    "--prompt_data": "--data.prompt_dataset",
    "--prompt_data_probs": "--data.prompt_probs",
    "--prompt_split": "--data.prompt_split",
    "--input_key": "--data.input_key",
    "--label_key": "--data.label_key",
    "--rollout_batch_size": "--rollout.batch_size",
    "--micro_rollout_batch_size": "--rollout.micro_batch_size",
    "--vllm_generate_batch_size": "--rollout.vllm_generate_batch_size",
    "--n_samples_per_prompt": "--rollout.n_samples_per_prompt",
    "--temperature": "--rollout.temperature",
    "--top_p": "--rollout.top_p",
    "--rollout_max_tokens_per_gpu": "--rollout.max_tokens_per_gpu",
    "--num_episodes": "--train.num_episodes",
    "--colocate_all_models": "--train.colocate_all",
    "--colocate_actor_ref": "--train.colocate_actor_ref",
    "--colocate_critic_reward": "--train.colocate_critic_reward",
    "--async_train": "--train.async_enable",
    "--partial_rollout": "--train.partial_rollout_enable",
    "--use_dynamic_batch": "--train.dynamic_batch_enable",
    "--train_max_tokens_per_gpu": "--train.max_tokens_per_gpu",
    "--agent_func_path": "--train.agent_func_path",
    "--enable_ema": "--train.enable_ema",
    "--ema_beta": "--train.ema_beta",
    "--vllm_num_engines": "--vllm.num_engines",
    "--vllm_tensor_parallel_size": "--vllm.tensor_parallel_size",
    "--vllm_sync_backend": "--vllm.sync_backend",
    "--vllm_sync_with_ray": "--vllm.sync_with_ray",
    "--enable_prefix_caching": "--vllm.enable_prefix_caching",
    "--enforce_eager": "--vllm.enforce_eager",
    "--vllm_enable_sleep": "--vllm.enable_sleep",
    "--vllm_gpu_memory_utilization": "--vllm.gpu_memory_utilization",
    "--deepspeed_enable_sleep": "--ds.enable_sleep",
    "--advantage_estimator": "--algo.advantage.estimator",
    "--gamma": "--algo.advantage.gamma",
    "--lambd": "--algo.advantage.lambd",
    "--no_advantage_std_norm": "--algo.advantage.no_std_norm",
    "--enable_vllm_is_correction": "--algo.advantage.is_correction_level",
    "--vllm_is_truncated_threshold": "--algo.advantage.is_correction_threshold",
    "--init_kl_coef": "--algo.kl.init_coef",
    "--kl_target": "--algo.kl.target",
    "--kl_horizon": "--algo.kl.horizon",
    "--kl_estimator": "--algo.kl.estimator",
    "--use_kl_loss": "--algo.kl.use_loss",
    "--dynamic_filtering": "--algo.dynamic_filtering_enable",
    "--dynamic_filtering_reward_range": "--algo.dynamic_filtering_range",
    "--eps_clip": "--actor.eps_clip",
    "--eps_clip_low_high": "--actor.eps_clip_low_high",
    "--dual_clip": "--actor.dual_clip",
    "--policy_loss_type": "--actor.policy_loss_type",
    "--entropy_loss_coef": "--actor.entropy_coef",
    "--value_clip": "--critic.value_clip",
    "--freezing_actor_steps": "--critic.freezing_steps",
    "--save_value_network": "--critic.save_value_network",
    "--normalize_reward": "--reward.normalize_enable",
    "--reward_clip_range": "--reward.clip_range",
    "--overlong_buffer_len": "--reward.overlong_buffer_len",
    "--overlong_penalty_factor": "--reward.overlong_penalty_factor",
    "--stop_properly_penalty_coef": "--reward.stop_properly_penalty_coef",
    "--eval_temperature": "--eval.temperature",
    "--eval_n_samples_per_prompt": "--eval.n_samples_per_prompt",
})
