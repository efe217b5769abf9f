"""OpenRLHF's RL example scripts, flag by flag, against ``treadle-train ppo``'s config (issue 34).

Each table below is the argument list of one of OpenRLHF's ``examples/scripts`` (its 0.11.0
``train_ppo_ray_hybrid_engine.sh``, ``train_dapo_ray_hybrid_engine.sh``,
``train_prorlv2_math_hybrid_engine.sh``, ``train_reinforce_baseline_hybrid_engine.sh``,
``train_reinforce_baseline_ray_agent_async.sh``, ``train_ppo_with_reward_fn.sh``,
``train_vlm_math_hybrid_engine.sh``, and the ``ray job submit`` flags of ``train_ppo_ray_slurm.sh``;
``train_nonrl_slurm.sh`` runs ``train_dpo_llama.sh``'s command under torchrun, parsed in
``test_openrlhf_offline_scripts.py``), written by hand in the script's order, one row per flag
with the config field it sets and the value it must have. All of them run ``python3 -m
openrlhf.cli.train_ppo_ray`` (directly or as a Ray job): treadle's ``python -m
treadle.integration.train_ppo_ray`` / ``treadle-train ppo`` take the same flags.

Substituted, so that the same lines can start on one CPU (each marked ``# was ...`` in place):

- model paths: the tiny test model (``TINY``);
- GPU counts: ``--*.num_gpus_per_node 1`` (2 where ``--ds.ring_attn_size 2`` needs two ranks),
  ``--vllm.num_engines`` / ``--vllm.tensor_parallel_size`` to match (``--train.colocate_all``
  needs engines x TP = the actor's GPUs);
- ``--ds.attn_implementation flash_attention_2``: ``sdpa`` (flash-attn needs CUDA);
- ``--vllm.sync_backend nccl``: dropped (NCCL needs CUDA; unset, colocated engines get gloo on
  CPU). On a GPU with ``--train.colocate_all`` it means CUDA IPC from every rank's GPU, as in
  OpenRLHF (``NCCL_WITH_COLOCATE_ALL``);
- ``--logger.wandb.key {wandb_token}``: dropped (a placeholder, no network here).

Datasets and reward / agent files keep the scripts' names: parsing opens none of them (the runs
by hand, in the closing note of issue 34, used small local files with the scripts' keys).

Where treadle refuses a flag a script passes whatever the machine, ``DIFFERS`` gives the flag,
the error it gets and the treadle spelling used instead, and a test checks the refusal (none now).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest

from treadle.common.config import ConfigError
from treadle.trainer.config import parse_command

TINY = "<tiny model>"
"""Where the scripts name a model; replaced by the tiny test model's folder."""

Row = tuple[list[str], str, Any]
"""(the flag and its values as the script gives them, the config field, the value it must have)."""

TRAIN_PPO_RAY_HYBRID_ENGINE_SH: list[Row] = [
    (["--ref.num_nodes", "1"], "ref.num_nodes", 1),
    (["--ref.num_gpus_per_node", "1"], "ref.num_gpus_per_node", 1),  # was 8
    (["--reward.num_nodes", "1"], "reward.num_nodes", 1),
    (["--reward.num_gpus_per_node", "1"], "reward.num_gpus_per_node", 1),  # was 8
    (["--critic.num_nodes", "1"], "critic.num_nodes", 1),
    (["--critic.num_gpus_per_node", "1"], "critic.num_gpus_per_node", 1),  # was 8
    (["--actor.num_nodes", "1"], "actor.num_nodes", 1),
    (["--actor.num_gpus_per_node", "1"], "actor.num_gpus_per_node", 1),  # was 8
    (["--vllm.num_engines", "1"], "vllm.num_engines", 1),  # was 4
    (["--vllm.tensor_parallel_size", "1"], "vllm.tensor_parallel_size", 1),  # was 2
    (["--train.colocate_all"], "train.colocate_all", True),
    (["--vllm.gpu_memory_utilization", "0.5"], "vllm.gpu_memory_utilization", 0.5),
    (["--actor.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # was OpenRLHF/Llama-3-8b-sft-mixture
    (["--reward.model_name_or_path", TINY], "reward.model_name_or_path", TINY),  # was OpenRLHF/Llama-3-8b-rm-700k
    (["--ckpt.output_dir", "/openrlhf/examples/test_scripts/final/llama3-8b-rlhf"], "ckpt.output_dir",
     "/openrlhf/examples/test_scripts/final/llama3-8b-rlhf"),
    (["--ckpt.path", "/openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf"], "ckpt.path",
     "/openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf"),
    (["--ckpt.save_hf"], "ckpt.save_hf", True),
    (["--train.batch_size", "128"], "train.batch_size", 128),
    (["--rollout.batch_size", "1024"], "rollout.batch_size", 1024),
    (["--rollout.n_samples_per_prompt", "1"], "rollout.n_samples_per_prompt", 1),
    (["--train.max_epochs", "1"], "train.max_epochs", 1),
    (["--data.max_len", "2048"], "data.max_len", 2048),
    (["--data.max_samples", "100000"], "data.max_samples", 100000),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--actor.adam.lr", "5e-7"], "actor.adam.lr", 5e-7),
    (["--critic.adam.lr", "9e-6"], "critic.adam.lr", 9e-6),
    (["--algo.kl.init_coef", "0.01"], "algo.kl.init_coef", 0.01),
    (["--data.prompt_dataset", "OpenRLHF/prompt-collection-v0.1"], "data.prompt_dataset",
     "OpenRLHF/prompt-collection-v0.1"),
    (["--data.input_key", "context_messages"], "data.input_key", "context_messages"),
    (["--data.apply_chat_template"], "data.apply_chat_template", True),
    (["--reward.normalize_enable"], "reward.normalize_enable", True),
    (["--actor.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    # --vllm.sync_backend nccl: dropped (CUDA)
    (["--vllm.enforce_eager"], "vllm.enforce_eager", True),
    (["--vllm.enable_sleep"], "vllm.enable_sleep", True),
    (["--ds.enable_sleep"], "ds.enable_sleep", True),
    (["--train.dynamic_batch_enable"], "train.dynamic_batch_enable", True),
    (["--train.max_tokens_per_gpu", "16384"], "train.max_tokens_per_gpu", 16384),
    (["--algo.advantage.is_correction_enable"], "algo.advantage.is_correction_level", "token"),
]

TRAIN_DAPO_RAY_HYBRID_ENGINE_SH: list[Row] = [
    (["--ref.num_nodes", "1"], "ref.num_nodes", 1),
    (["--ref.num_gpus_per_node", "1"], "ref.num_gpus_per_node", 1),  # was 8
    (["--actor.num_nodes", "1"], "actor.num_nodes", 1),
    (["--actor.num_gpus_per_node", "1"], "actor.num_gpus_per_node", 1),  # was 8
    (["--vllm.num_engines", "1"], "vllm.num_engines", 1),  # was 4
    (["--vllm.tensor_parallel_size", "1"], "vllm.tensor_parallel_size", 1),  # was 2
    (["--train.colocate_all"], "train.colocate_all", True),
    (["--vllm.gpu_memory_utilization", "0.6"], "vllm.gpu_memory_utilization", 0.6),
    (["--algo.kl.init_coef", "1e-3"], "algo.kl.init_coef", 1e-3),
    (["--algo.advantage.gamma", "1.0"], "algo.advantage.gamma", 1.0),
    (["--algo.kl.use_loss"], "algo.kl.use_loss", True),
    (["--algo.kl.estimator", "k3"], "algo.kl.estimator", "k3"),
    (["--algo.advantage.estimator", "group_norm"], "algo.advantage.estimator", "group_norm"),
    (["--algo.dynamic_filtering_enable"], "algo.dynamic_filtering_enable", True),
    (["--algo.dynamic_filtering_range", "0", "1"], "algo.dynamic_filtering_range", (0.0, 1.0)),
    (["--actor.eps_clip_low_high", "0.2", "0.27"], "actor.eps_clip_low_high", (0.2, 0.27)),
    (["--actor.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # was OpenRLHF/Llama-3-8b-sft-mixture
    (["--reward.remote_url", "/openrlhf/examples/python/reward_func.py"], "reward.remote_url",
     "/openrlhf/examples/python/reward_func.py"),
    (["--ckpt.output_dir", "/openrlhf/examples/test_scripts/final/llama3-8b-rlhf"], "ckpt.output_dir",
     "/openrlhf/examples/test_scripts/final/llama3-8b-rlhf"),
    (["--ckpt.path", "/openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf"], "ckpt.path",
     "/openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf"),
    (["--ckpt.save_steps", "20"], "ckpt.save_steps", 20),
    (["--ckpt.save_hf"], "ckpt.save_hf", True),
    (["--train.micro_batch_size", "8"], "train.micro_batch_size", 8),
    (["--train.batch_size", "128"], "train.batch_size", 128),
    (["--rollout.micro_batch_size", "16"], "rollout.micro_batch_size", 16),
    (["--rollout.batch_size", "128"], "rollout.batch_size", 128),
    (["--rollout.n_samples_per_prompt", "8"], "rollout.n_samples_per_prompt", 8),
    (["--train.max_epochs", "1"], "train.max_epochs", 1),
    (["--data.max_len", "2048"], "data.max_len", 2048),
    (["--data.max_samples", "20000"], "data.max_samples", 20000),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--actor.adam.lr", "5e-7"], "actor.adam.lr", 5e-7),
    (["--data.prompt_dataset", "OpenRLHF/prompt-collection-v0.1"], "data.prompt_dataset",
     "OpenRLHF/prompt-collection-v0.1"),
    (["--data.input_key", "context_messages"], "data.input_key", "context_messages"),
    (["--data.apply_chat_template"], "data.apply_chat_template", True),
    (["--actor.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    # --vllm.sync_backend nccl: dropped (CUDA)
    (["--vllm.enforce_eager"], "vllm.enforce_eager", True),
    (["--vllm.enable_sleep"], "vllm.enable_sleep", True),
    (["--ds.enable_sleep"], "ds.enable_sleep", True),
    (["--algo.advantage.is_correction_enable"], "algo.advantage.is_correction_level", "token"),
]

TRAIN_PRORLV2_MATH_HYBRID_ENGINE_SH: list[Row] = [
    (["--ref.num_nodes", "1"], "ref.num_nodes", 1),
    (["--ref.num_gpus_per_node", "1"], "ref.num_gpus_per_node", 1),  # was 8
    (["--actor.num_nodes", "1"], "actor.num_nodes", 1),
    (["--actor.num_gpus_per_node", "1"], "actor.num_gpus_per_node", 1),  # was 8
    (["--vllm.num_engines", "1"], "vllm.num_engines", 1),  # was 8
    (["--vllm.tensor_parallel_size", "1"], "vllm.tensor_parallel_size", 1),
    (["--train.colocate_all"], "train.colocate_all", True),
    (["--vllm.gpu_memory_utilization", "0.75"], "vllm.gpu_memory_utilization", 0.75),
    (["--algo.kl.init_coef", "1e-4"], "algo.kl.init_coef", 1e-4),
    (["--algo.advantage.gamma", "1.0"], "algo.advantage.gamma", 1.0),
    (["--algo.kl.use_loss"], "algo.kl.use_loss", True),
    (["--algo.kl.estimator", "k2"], "algo.kl.estimator", "k2"),
    (["--algo.advantage.estimator", "reinforce_baseline"], "algo.advantage.estimator", "reinforce_baseline"),
    (["--algo.dynamic_filtering_enable"], "algo.dynamic_filtering_enable", True),
    (["--algo.dynamic_filtering_range", "0", "1"], "algo.dynamic_filtering_range", (0.0, 1.0)),
    (["--actor.eps_clip_low_high", "0.2", "0.27"], "actor.eps_clip_low_high", (0.2, 0.27)),
    (["--actor.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # was deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
    (["--reward.remote_url", "/w/examples/python/math_reward_func.py"], "reward.remote_url",
     "/w/examples/python/math_reward_func.py"),  # ${WORK_DIR}/examples/python/math_reward_func.py
    (["--ckpt.output_dir", "/w/exp/DeepSeek-R1-Qwen-1.5B-PRORLV2"], "ckpt.output_dir",
     "/w/exp/DeepSeek-R1-Qwen-1.5B-PRORLV2"),
    (["--ckpt.path", "/w/exp/DeepSeek-R1-Qwen-1.5B-PRORLV2/ckpt"], "ckpt.path", "/w/exp/DeepSeek-R1-Qwen-1.5B-PRORLV2/ckpt"),
    (["--ckpt.save_steps", "5"], "ckpt.save_steps", 5),
    (["--ckpt.save_hf"], "ckpt.save_hf", True),
    (["--train.batch_size", "1024"], "train.batch_size", 1024),
    (["--rollout.batch_size", "512"], "rollout.batch_size", 512),
    (["--rollout.n_samples_per_prompt", "16"], "rollout.n_samples_per_prompt", 16),
    (["--train.dynamic_batch_enable"], "train.dynamic_batch_enable", True),
    (["--train.num_episodes", "100"], "train.num_episodes", 100),
    (["--data.max_len", "9216"], "data.max_len", 9216),
    (["--rollout.max_new_tokens", "8192"], "rollout.max_new_tokens", 8192),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--actor.adam.lr", "1e-6"], "actor.adam.lr", 1e-6),
    (["--data.prompt_dataset", "OpenRLHF/dapo-math-17k"], "data.prompt_dataset", "OpenRLHF/dapo-math-17k"),
    (["--data.input_key", "prompt"], "data.input_key", "prompt"),
    (["--data.label_key", "label"], "data.label_key", "label"),
    (["--eval.dataset", "OpenRLHF/aime-2024"], "eval.dataset", "OpenRLHF/aime-2024"),
    (["--eval.steps", "5"], "eval.steps", 5),
    (["--eval.temperature", "1.0"], "eval.temperature", 1.0),
    (["--eval.n_samples_per_prompt", "4"], "eval.n_samples_per_prompt", 4),
    (["--data.apply_chat_template"], "data.apply_chat_template", True),
    (["--actor.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    # --vllm.sync_backend nccl: dropped (CUDA)
    (["--vllm.enforce_eager"], "vllm.enforce_eager", True),
    (["--vllm.enable_sleep"], "vllm.enable_sleep", True),
    (["--ds.enable_sleep"], "ds.enable_sleep", True),
    (["--algo.advantage.is_correction_enable"], "algo.advantage.is_correction_level", "token"),
    (["--algo.advantage.is_correction_threshold", "0.5", "5.0"], "algo.advantage.is_correction_threshold", (0.5, 5.0)),
    (["--algo.advantage.is_correction_type", "icepop"], "algo.advantage.is_correction_mode", "mask"),
    (["--train.max_tokens_per_gpu", "32768"], "train.max_tokens_per_gpu", 32768),
    (["--reward.stop_properly_penalty_coef", "0.0"], "reward.stop_properly_penalty_coef", 0.0),
]


def _reinforce_baseline(*, agent_async: bool) -> list[Row]:
    """train_reinforce_baseline_hybrid_engine.sh and its _ray_agent_async twin: the same arrays
    (CKPT_ARGS, ROLLOUT_ARGS, ENGINE_ARGS, OPTIMIZER_ARGS, LOG_ARGS) but for ENGINE_ARGS' first two
    switches and --vllm.gpu_memory_utilization (0.7 / 0.95)."""
    save = "/w/exp/Qwen3-4B-Thinking"  # ${WORK_DIR}/exp/Qwen3-4B-Thinking
    ckpt = [
        (["--actor.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # was Qwen/Qwen3-4B-Thinking-2507
        (["--ckpt.load_enable"], "ckpt.load_enable", True),
        (["--ckpt.output_dir", save], "ckpt.output_dir", save),
        (["--ckpt.path", f"{save}/ckpt"], "ckpt.path", f"{save}/ckpt"),
        (["--ckpt.save_hf"], "ckpt.save_hf", True),
        (["--ckpt.max_num", "3"], "ckpt.max_num", 3),
        (["--ckpt.save_steps", "10"], "ckpt.save_steps", 10),
    ]
    rollout = [
        (["--train.agent_func_path", "examples/python/agent_func.py"], "train.agent_func_path",
         "examples/python/agent_func.py"),
        (["--data.prompt_dataset", "zhuzilin/dapo-math-17k"], "data.prompt_dataset", "zhuzilin/dapo-math-17k"),
        (["--data.input_key", "prompt"], "data.input_key", "prompt"),
        (["--data.label_key", "label"], "data.label_key", "label"),
        (["--data.max_len", "74240"], "data.max_len", 74240),
        (["--rollout.max_new_tokens", "64000"], "rollout.max_new_tokens", 64000),
        (["--data.apply_chat_template"], "data.apply_chat_template", True),
        (["--ds.packing_samples"], "ds.packing_samples", True),
        (["--rollout.batch_size", "128"], "rollout.batch_size", 128),
        (["--rollout.n_samples_per_prompt", "8"], "rollout.n_samples_per_prompt", 8),
        (["--train.batch_size", "1024"], "train.batch_size", 1024),
        (["--algo.dynamic_filtering_enable"], "algo.dynamic_filtering_enable", True),
        (["--algo.dynamic_filtering_range", "0.0", "1.0"], "algo.dynamic_filtering_range", (0.0, 1.0)),
        (["--train.dynamic_batch_enable"], "train.dynamic_batch_enable", True),
        (["--train.max_tokens_per_gpu", "16192"], "train.max_tokens_per_gpu", 16192),
        (["--rollout.max_tokens_per_gpu", "32768"], "rollout.max_tokens_per_gpu", 32768),
        (["--train.micro_batch_size", "1"], "train.micro_batch_size", 1),
        (["--rollout.micro_batch_size", "8"], "rollout.micro_batch_size", 8),
        (["--data.max_samples", "128000"], "data.max_samples", 128000),
        (["--train.max_epochs", "1"], "train.max_epochs", 1),
        (["--train.num_episodes", "1"], "train.num_episodes", 1),
    ]
    engine_async = [
        (["--train.async_enable"], "train.async_enable", True),
        (["--train.partial_rollout_enable"], "train.partial_rollout_enable", True),
    ]
    engine = [
        (["--ref.num_nodes", "1"], "ref.num_nodes", 1),
        (["--ref.num_gpus_per_node", "2"], "ref.num_gpus_per_node", 2),  # was 4 (ring attention: 2 ranks)
        (["--actor.num_nodes", "1"], "actor.num_nodes", 1),
        (["--actor.num_gpus_per_node", "2"], "actor.num_gpus_per_node", 2),  # was 4
        (["--vllm.num_engines", "2"], "vllm.num_engines", 2),
        (["--vllm.tensor_parallel_size", "1"], "vllm.tensor_parallel_size", 1),  # was 2
        (["--vllm.gpu_memory_utilization", "0.95" if agent_async else "0.7"], "vllm.gpu_memory_utilization",
         0.95 if agent_async else 0.7),
        (["--train.colocate_all"], "train.colocate_all", True),
        (["--ds.enable_sleep"], "ds.enable_sleep", True),
        # --vllm.sync_backend nccl: dropped (CUDA)
        (["--vllm.enforce_eager"], "vllm.enforce_eager", True),
        (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
        (["--actor.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
        (["--ds.ring_attn_size", "2"], "ds.ring_attn_size", 2),
        (["--ds.ring_attn_head_stride", "2"], "ds.ring_attn_head_stride", 2),
        (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    ]
    optimizer = [
        (["--algo.advantage.estimator", "reinforce_baseline"], "algo.advantage.estimator", "reinforce_baseline"),
        (["--actor.adam.lr", "5e-7"], "actor.adam.lr", 5e-7),
        (["--actor.entropy_coef", "0.0"], "actor.entropy_coef", 0.0),
        (["--algo.kl.init_coef", "1e-5"], "algo.kl.init_coef", 1e-5),
        (["--algo.kl.use_loss"], "algo.kl.use_loss", True),
        (["--algo.kl.estimator", "k2"], "algo.kl.estimator", "k2"),
        (["--algo.advantage.is_correction_enable"], "algo.advantage.is_correction_level", "token"),
        (["--algo.advantage.is_correction_type", "icepop"], "algo.advantage.is_correction_mode", "mask"),
    ]
    log = [
        (["--logger.tensorboard_dir", f"{save}/runs"], "logger.tensorboard_dir", f"{save}/runs"),
        (["--logger.logging_steps", "1"], "logger.logging_steps", 1),
        (["--eval.steps", "-1"], "eval.steps", -1),
    ]
    return [*ckpt, *rollout, *(engine_async if agent_async else []), *engine, *optimizer, *log]


TRAIN_PPO_WITH_REWARD_FN_SH: list[Row] = [
    (["--ref.num_nodes", "1"], "ref.num_nodes", 1),
    (["--ref.num_gpus_per_node", "1"], "ref.num_gpus_per_node", 1),  # was 2
    (["--critic.num_nodes", "1"], "critic.num_nodes", 1),
    (["--critic.num_gpus_per_node", "1"], "critic.num_gpus_per_node", 1),  # was 2
    (["--actor.num_nodes", "1"], "actor.num_nodes", 1),
    (["--actor.num_gpus_per_node", "1"], "actor.num_gpus_per_node", 1),  # was 2
    (["--vllm.num_engines", "1"], "vllm.num_engines", 1),  # was 2
    (["--vllm.tensor_parallel_size", "1"], "vllm.tensor_parallel_size", 1),  # was 2
    (["--train.colocate_actor_ref"], "train.colocate_actor_ref", True),
    (["--actor.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # was OpenRLHF/Llama-3-8b-sft-mixture
    (["--reward.remote_url", "/openrlhf/examples/python/reward_func.py"], "reward.remote_url",
     "/openrlhf/examples/python/reward_func.py"),
    (["--ckpt.output_dir", "/openrlhf/examples/checkpoint/llama3-8b-rlhf"], "ckpt.output_dir",
     "/openrlhf/examples/checkpoint/llama3-8b-rlhf"),
    (["--train.micro_batch_size", "8"], "train.micro_batch_size", 8),
    (["--train.batch_size", "128"], "train.batch_size", 128),
    (["--rollout.micro_batch_size", "16"], "rollout.micro_batch_size", 16),
    (["--rollout.batch_size", "1024"], "rollout.batch_size", 1024),
    (["--data.max_samples", "100000"], "data.max_samples", 100000),
    (["--train.max_epochs", "1"], "train.max_epochs", 1),
    (["--data.max_len", "2048"], "data.max_len", 2048),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--actor.adam.lr", "5e-7"], "actor.adam.lr", 5e-7),
    (["--critic.adam.lr", "9e-6"], "critic.adam.lr", 9e-6),
    (["--algo.kl.init_coef", "0.01"], "algo.kl.init_coef", 0.01),
    (["--data.prompt_dataset", "OpenRLHF/prompt-collection-v0.1"], "data.prompt_dataset",
     "OpenRLHF/prompt-collection-v0.1"),
    (["--data.input_key", "context_messages"], "data.input_key", "context_messages"),
    (["--data.apply_chat_template"], "data.apply_chat_template", True),
    (["--reward.normalize_enable"], "reward.normalize_enable", True),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    (["--ds.adam_offload"], "ds.adam_offload", True),
    (["--ds.attn_implementation", "sdpa"], "ds.attn_implementation", "sdpa"),  # was flash_attention_2
    (["--actor.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
    # --logger.wandb.key {wandb_token}: dropped (a placeholder; no network)
]

TRAIN_PPO_RAY_SLURM_SH: list[Row] = [  # the flags of its `ray job submit -- python3 -m openrlhf.cli.train_ppo_ray`
    (["--ref.num_nodes", "1"], "ref.num_nodes", 1),
    (["--ref.num_gpus_per_node", "1"], "ref.num_gpus_per_node", 1),  # was 4
    (["--reward.num_nodes", "1"], "reward.num_nodes", 1),
    (["--reward.num_gpus_per_node", "1"], "reward.num_gpus_per_node", 1),  # was 4
    (["--critic.num_nodes", "1"], "critic.num_nodes", 1),
    (["--critic.num_gpus_per_node", "1"], "critic.num_gpus_per_node", 1),  # was 4
    (["--actor.num_nodes", "1"], "actor.num_nodes", 1),
    (["--actor.num_gpus_per_node", "1"], "actor.num_gpus_per_node", 1),  # was 4
    (["--vllm.num_engines", "1"], "vllm.num_engines", 1),  # was 4
    (["--vllm.tensor_parallel_size", "1"], "vllm.tensor_parallel_size", 1),  # was 2
    (["--train.colocate_critic_reward"], "train.colocate_critic_reward", True),
    (["--train.colocate_actor_ref"], "train.colocate_actor_ref", True),
    (["--actor.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # was OpenRLHF/Llama-3-8b-sft-mixture
    (["--reward.model_name_or_path", TINY], "reward.model_name_or_path", TINY),  # was OpenRLHF/Llama-3-8b-rm-mixture
    (["--ckpt.output_dir", "/openrlhf/examples/checkpoint/llama3-8b-rlhf"], "ckpt.output_dir",
     "/openrlhf/examples/checkpoint/llama3-8b-rlhf"),
    (["--train.micro_batch_size", "8"], "train.micro_batch_size", 8),
    (["--train.batch_size", "128"], "train.batch_size", 128),
    (["--rollout.micro_batch_size", "16"], "rollout.micro_batch_size", 16),
    (["--rollout.batch_size", "1024"], "rollout.batch_size", 1024),
    (["--data.max_samples", "100000"], "data.max_samples", 100000),
    (["--train.max_epochs", "1"], "train.max_epochs", 1),
    (["--data.max_len", "2048"], "data.max_len", 2048),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--actor.adam.lr", "5e-7"], "actor.adam.lr", 5e-7),
    (["--critic.adam.lr", "9e-6"], "critic.adam.lr", 9e-6),
    (["--algo.kl.init_coef", "0.01"], "algo.kl.init_coef", 0.01),
    (["--data.prompt_dataset", "OpenRLHF/prompt-collection-v0.1"], "data.prompt_dataset",
     "OpenRLHF/prompt-collection-v0.1"),
    (["--data.input_key", "context_messages"], "data.input_key", "context_messages"),
    (["--data.apply_chat_template"], "data.apply_chat_template", True),
    (["--reward.normalize_enable"], "reward.normalize_enable", True),
    (["--ds.adam_offload"], "ds.adam_offload", True),
    (["--ds.packing_samples"], "ds.packing_samples", True),
    # --vllm.sync_backend nccl: dropped (CUDA); without --train.colocate_all treadle takes it on a GPU
    (["--actor.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
    # --logger.wandb.key {wandb_token}: dropped (a placeholder; no network)
]

TRAIN_VLM_MATH_HYBRID_ENGINE_SH: list[Row] = [  # refused: VLM (VLM_FLAGS), and KL_LOSS_WITHOUT_COEF
    (["--ref.num_nodes", "1"], "ref.num_nodes", 1),
    (["--ref.num_gpus_per_node", "1"], "ref.num_gpus_per_node", 1),  # was 4
    (["--actor.num_nodes", "1"], "actor.num_nodes", 1),
    (["--actor.num_gpus_per_node", "1"], "actor.num_gpus_per_node", 1),  # was 4
    (["--vllm.num_engines", "1"], "vllm.num_engines", 1),  # was 4
    (["--vllm.tensor_parallel_size", "1"], "vllm.tensor_parallel_size", 1),
    (["--train.colocate_all"], "train.colocate_all", True),
    (["--vllm.gpu_memory_utilization", "0.7"], "vllm.gpu_memory_utilization", 0.7),
    (["--algo.kl.init_coef", "0"], "algo.kl.init_coef", 0.0),
    (["--algo.advantage.gamma", "1.0"], "algo.advantage.gamma", 1.0),
    (["--algo.kl.use_loss"], "algo.kl.use_loss", True),
    (["--algo.kl.estimator", "k2"], "algo.kl.estimator", "k2"),
    (["--algo.advantage.estimator", "reinforce_baseline"], "algo.advantage.estimator", "reinforce_baseline"),
    (["--actor.model_name_or_path", TINY], "actor.model_name_or_path", TINY),  # was Qwen/Qwen3.5-2B
    (["--reward.remote_url", "/w/examples/python/math_reward_func.py"], "reward.remote_url",
     "/w/examples/python/math_reward_func.py"),
    (["--ckpt.output_dir", "/w/exp/Qwen3.5-2B-VLM-RLHF"], "ckpt.output_dir", "/w/exp/Qwen3.5-2B-VLM-RLHF"),
    (["--ckpt.path", "/w/exp/Qwen3.5-2B-VLM-RLHF/ckpt"], "ckpt.path", "/w/exp/Qwen3.5-2B-VLM-RLHF/ckpt"),
    (["--ckpt.save_hf"], "ckpt.save_hf", True),
    (["--ckpt.save_steps", "5"], "ckpt.save_steps", 5),
    (["--eval.steps", "-1"], "eval.steps", -1),
    (["--train.micro_batch_size", "1"], "train.micro_batch_size", 1),
    (["--rollout.micro_batch_size", "1"], "rollout.micro_batch_size", 1),
    (["--train.batch_size", "1024"], "train.batch_size", 1024),
    (["--rollout.batch_size", "128"], "rollout.batch_size", 128),
    (["--rollout.n_samples_per_prompt", "8"], "rollout.n_samples_per_prompt", 8),
    (["--train.num_episodes", "100"], "train.num_episodes", 100),
    (["--data.max_len", "4096"], "data.max_len", 4096),
    (["--rollout.max_new_tokens", "2048"], "rollout.max_new_tokens", 2048),
    (["--ds.zero_stage", "3"], "ds.zero_stage", 3),
    (["--ds.param_dtype", "bf16"], "ds.param_dtype", "bf16"),
    (["--actor.adam.lr", "2e-6"], "actor.adam.lr", 2e-6),
    (["--data.prompt_dataset", "hiyouga/geometry3k"], "data.prompt_dataset", "hiyouga/geometry3k"),
    (["--data.input_key", "prompt"], "data.input_key", "prompt"),
    (["--data.label_key", "label"], "data.label_key", "label"),
    # --data.image_key images --data.max_images_per_prompt 1 --actor.freeze_visual_encoder: VLM_FLAGS
    (["--data.apply_chat_template"], "data.apply_chat_template", True),
    (["--actor.gradient_checkpointing_enable"], "actor.gradient_checkpointing_enable", True),
    (["--ds.attn_implementation", "eager"], "ds.attn_implementation", "eager"),
    # --vllm.sync_backend nccl: dropped (CUDA)
    (["--vllm.enforce_eager"], "vllm.enforce_eager", True),
    (["--vllm.enable_sleep"], "vllm.enable_sleep", True),
    (["--ds.enable_sleep"], "ds.enable_sleep", True),
]

VLM_FLAGS = [["--data.image_key", "images"], ["--data.max_images_per_prompt", "1"], ["--actor.freeze_visual_encoder"]]
"""train_vlm_math_hybrid_engine.sh's image flags, each refused by name (text-only models)."""

KL_LOSS_WITHOUT_COEF = (["--algo.kl.use_loss"], r"^--algo\.kl\.use_loss with --algo\.kl\.init_coef 0 adds nothing")
"""The VLM script's ``--algo.kl.init_coef 0 --algo.kl.use_loss``: OpenRLHF computes a KL loss term
and multiplies it by 0; treadle refuses the pair naming it (``config/algo.py``)."""

SCRIPTS: dict[str, list[Row]] = {
    "train_ppo_ray_hybrid_engine.sh": TRAIN_PPO_RAY_HYBRID_ENGINE_SH,
    "train_dapo_ray_hybrid_engine.sh": TRAIN_DAPO_RAY_HYBRID_ENGINE_SH,
    "train_prorlv2_math_hybrid_engine.sh": TRAIN_PRORLV2_MATH_HYBRID_ENGINE_SH,
    "train_reinforce_baseline_hybrid_engine.sh": _reinforce_baseline(agent_async=False),
    "train_reinforce_baseline_ray_agent_async.sh": _reinforce_baseline(agent_async=True),
    "train_ppo_with_reward_fn.sh": TRAIN_PPO_WITH_REWARD_FN_SH,
    "train_ppo_ray_slurm.sh": TRAIN_PPO_RAY_SLURM_SH,
}
"""The text-only scripts (the VLM one has tests of its own)."""

NCCL_WITH_COLOCATE_ALL = ["--vllm.sync_backend", "nccl"]
"""What every hybrid-engine script passes with ``--train.colocate_all`` (OpenRLHF's default value:
CUDA IPC there, in treadle too); dropped above, as it needs CUDA."""

DIFFERS: dict[str, tuple[str, list[str]]] = {}
"""Flags of the scripts that treadle refuses whatever the machine: the error, and the treadle spelling
the tables are checked with. None now: OpenRLHF 0.11's ``--algo.advantage.is_correction_enable`` /
``--algo.advantage.is_correction_type`` were refused as renamed until they became aliases of the level /
mode pair (tis = token + clip, icepop = token + mask, seq-mask-tis = seq + mask, gating ratio)."""


def argv(rows: list[Row], model: str, *, treadle_spelling: bool) -> list[str]:
    """The script's arguments, with ``model`` where it names ``TINY``; ``treadle_spelling``: the
    flags of ``DIFFERS`` as treadle spells them (else as the script does)."""
    words: list[str] = []
    for flags, _, _ in rows:
        if treadle_spelling and flags[0] in DIFFERS:
            flags = DIFFERS[flags[0]][1]
        words += [model if w == TINY else w for w in flags]
    if treadle_spelling:  # icepop's mode comes after the switch's clip, as the script's type after its enable
        words = _last_mode_wins(words)
    return words


def _last_mode_wins(words: list[str]) -> list[str]:
    modes = [i for i, w in enumerate(words) if w == "--algo.advantage.is_correction_mode"]
    for i in reversed(modes[:-1]):
        del words[i:i + 2]
    return words


def field(cfg: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), cfg)


def check(cfg: Any, rows: list[Row], model: str) -> None:
    for flags, path, value in rows:
        assert field(cfg, path) == (model if value == TINY else value), (flags, path)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_scripts_flags_parse_with_every_value_in_place(script: str, tiny: Path) -> None:
    rows = SCRIPTS[script]
    cfg = parse_command("ppo", argv(rows, str(tiny), treadle_spelling=True))
    check(cfg, rows, str(tiny))


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_as_openrlhf_spells_them_the_first_flag_treadle_refuses_is_named(script: str) -> None:
    rows = SCRIPTS[script]
    first = next((flags[0] for flags, _, _ in rows if flags[0] in DIFFERS), None)
    line = argv(rows, "m", treadle_spelling=False)
    if first is None:
        parse_command("ppo", line)
        return
    with pytest.raises(ConfigError, match=f"^{DIFFERS[first][0]}$"):
        parse_command("ppo", line)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if any(f[0] == "--train.colocate_all" for f, _, _ in SCRIPTS[s])])
def test_the_hybrid_engine_scripts_nccl_sync_means_cuda_ipc_with_colocate_all(script: str) -> None:
    from treadle.trainer.trainers.ppo_build import ipc_every_rank, sync_route

    line = [*argv(SCRIPTS[script], "m", treadle_spelling=True), *NCCL_WITH_COLOCATE_ALL]
    cfg = parse_command("ppo", line)
    if "--train.async_enable" in line:  # async: engines get GPUs of their own, nccl is theirs
        assert sync_route(cfg, cuda=True) == ("collective", "nccl")
        return
    assert sync_route(cfg, cuda=True) == ("cuda_ipc", "nccl") and ipc_every_rank(cfg, "cuda_ipc")


@pytest.mark.parametrize("flags", VLM_FLAGS, ids=lambda f: f[0])
def test_the_vlm_scripts_image_flags_are_refused_by_name(flags: list[str]) -> None:
    line = [*argv(TRAIN_VLM_MATH_HYBRID_ENGINE_SH, "m", treadle_spelling=True), *flags]
    with pytest.raises(ConfigError, match=rf"^{re.escape(flags[0])}: .*not supported"):
        parse_command("ppo", line)


def test_the_vlm_scripts_text_flags_parse_but_for_a_kl_loss_of_weight_zero(tiny: Path) -> None:
    rows = TRAIN_VLM_MATH_HYBRID_ENGINE_SH
    with pytest.raises(ConfigError, match=KL_LOSS_WITHOUT_COEF[1]):
        parse_command("ppo", argv(rows, str(tiny), treadle_spelling=True))
    rest = [row for row in rows if row[0] != KL_LOSS_WITHOUT_COEF[0]]
    assert len(rest) == len(rows) - 1
    check(parse_command("ppo", argv(rest, str(tiny), treadle_spelling=True)), rest, str(tiny))


def test_the_slurm_scripts_nccl_sync_parses_where_the_engines_have_gpus_of_their_own() -> None:
    cfg = parse_command("ppo", [*argv(TRAIN_PPO_RAY_SLURM_SH, "m", treadle_spelling=True), *NCCL_WITH_COLOCATE_ALL])
    assert cfg.vllm.sync_backend == "nccl" and not cfg.engines_colocated
    assert cfg.critic_model_name_or_path == "m"  # gae without --critic.model_name_or_path: from the reward model


def test_the_reinforce_scripts_differ_only_in_the_async_switches() -> None:
    sync, agent_async = (argv(SCRIPTS[s], "m", treadle_spelling=True) for s in
                         ("train_reinforce_baseline_hybrid_engine.sh", "train_reinforce_baseline_ray_agent_async.sh"))
    a, b = parse_command("ppo", sync), parse_command("ppo", agent_async)
    assert (a.train.async_enable, b.train.async_enable, b.train.partial_rollout_enable) == (False, True, True)
    assert a.engines_colocated and not b.engines_colocated  # OpenRLHF: async "only colocates DeepSpeed models"


@pytest.mark.parametrize("extra, level, mode", [
    ([], "token", "clip"),  # OpenRLHF's default type: tis
    (["--algo.advantage.is_correction_type", "tis"], "token", "clip"),
    (["--algo.advantage.is_correction_type", "icepop"], "token", "mask"),
    (["--algo.advantage.is_correction_type", "seq-mask-tis"], "seq", "mask"),
])
def test_openrlhfs_is_correction_switch_and_type_set_the_level_and_mode(extra, level, mode) -> None:
    line = [*argv(TRAIN_PPO_RAY_HYBRID_ENGINE_SH, "m", treadle_spelling=False), *extra]
    adv = parse_command("ppo", line).algo.advantage
    assert (adv.is_correction_level, adv.is_correction_mode, adv.is_correction_gating) == (level, mode, "ratio")


def test_the_is_correction_type_alone_or_beside_a_level_is_refused() -> None:
    base = [w for w in argv(TRAIN_PPO_RAY_HYBRID_ENGINE_SH, "m", treadle_spelling=False)
            if w != "--algo.advantage.is_correction_enable"]
    with pytest.raises(ConfigError, match="--algo.advantage.is_correction_type icepop does nothing without --algo.advantage.is_correction_enable"):
        parse_command("ppo", [*base, "--algo.advantage.is_correction_type", "icepop"])
    with pytest.raises(ConfigError, match="two spellings of one setting"):
        parse_command("ppo", [*base, "--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_level", "seq"])
