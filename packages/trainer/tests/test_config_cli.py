"""The training command lines: the feature spec's (OpenRLHF README) SFT, RM and PPO commands parse
unchanged into the typed configs; estimators, aliases, retired flags and invalid combinations;
and the full flag set of each command is pinned.

The pinned flag sets live in ``config_flags.txt`` next to this file. After an intended change
to the CLI, regenerate it (no environment variables or terminal settings involved) with::

    PYTHONPATH=packages/common/src:packages/trainer/src \\
        python -m treadle.trainer.config --dump-flags > packages/trainer/tests/config_flags.txt

(plain ``python -m treadle.trainer.config --dump-flags`` once the packages are installed), and
review the diff: every removed or renamed flag breaks someone's launch script.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from treadle.common.config import ConfigError, dump_yaml, load_yaml
from treadle.trainer.config import (
    ADVANTAGE_ESTIMATORS,
    COMMANDS,
    GROUP_ESTIMATORS,
    PPOConfig,
    command_flags,
    flags_snapshot,
    parse_ppo,
    parse_rm,
    parse_sft,
)
from treadle.trainer.config.__main__ import main as config_main

SNAPSHOT = Path(__file__).with_name("config_flags.txt")

# Copied verbatim from the seed (seeds/000_5836f313df81d42f.txt).
SEED_SFT = r"""
deepspeed --module openrlhf.cli.train_sft \
   --data.max_len 4096 \
   --data.dataset Open-Orca/OpenOrca \
   --data.input_key question \
   --data.output_key response \
   --data.input_template $'User: {}\nAssistant: ' \
   --train.batch_size 256 \
   --train.micro_batch_size 2 \
   --data.max_samples 500000 \
   --actor.model_name_or_path meta-llama/Meta-Llama-3-8B \
   --ckpt.output_dir ./checkpoint/llama3-8b-sft \
   --ckpt.save_steps -1 \
   --logger.logging_steps 1 \
   --eval.steps -1 \
   --ds.zero_stage 2 \
   --train.max_epochs 1 \
   --ds.packing_samples \
   --ds.param_dtype bf16 \
   --adam.lr 5e-6 \
   --actor.gradient_checkpointing_enable \
   --logger.wandb.key {wandb_token}
"""

SEED_RM = r"""
deepspeed --module openrlhf.cli.train_rm \
   --ckpt.output_dir ./checkpoint/llama3-8b-rm \
   --ckpt.save_steps -1 \
   --logger.logging_steps 1 \
   --eval.steps -1 \
   --train.batch_size 256 \
   --train.micro_batch_size 1 \
   --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --ds.param_dtype bf16 \
   --train.max_epochs 1 \
   --data.max_len 8192 \
   --ds.zero_stage 3 \
   --adam.lr 9e-6 \
   --data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku \
   --data.apply_chat_template \
   --chosen_key chosen \
   --rejected_key rejected \
   --ds.packing_samples \
   --actor.gradient_checkpointing_enable \
   --logger.wandb.key {wandb_token}
"""

SEED_PPO = r"""
ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "/openrlhf"}' \
   -- python3 -m openrlhf.cli.train_ppo_ray \
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 8 \
   --reward.num_nodes 1 \
   --reward.num_gpus_per_node 8 \
   --critic.num_nodes 1 \
   --critic.num_gpus_per_node 8 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 8 \
   --vllm.num_engines 4 \
   --vllm.tensor_parallel_size 2 \
   --train.colocate_all \
   --vllm.gpu_memory_utilization 0.5 \
   --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k \
   --ckpt.output_dir /openrlhf/examples/test_scripts/final/llama3-8b-rlhf \
   --ckpt.path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf \
   --ckpt.save_hf \
   --train.batch_size 128 \
   --rollout.batch_size 1024 \
   --train.dynamic_batch_enable \
   --rollout.n_samples_per_prompt 1 \
   --train.max_epochs 1 \
   --prompt_max_len 1024 \
   --data.max_samples 100000 \
   --generate_max_len 1024 \
   --ds.zero_stage 3 \
   --ds.param_dtype bf16 \
   --actor.adam.lr 5e-7 \
   --critic.adam.lr 9e-6 \
   --algo.kl.init_coef 0.01 \
   --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 \
   --data.input_key context_messages \
   --data.apply_chat_template \
   --reward.normalize_enable \
   --actor.gradient_checkpointing_enable \
   --ds.packing_samples \
   --vllm.sync_backend nccl \
   --vllm.enforce_eager \
   --vllm.enable_sleep \
   --ds.enable_sleep \
   --logger.wandb.key {wandb_token}
"""


def _ansi_c(match: re.Match[str]) -> str:
    """bash's $'...' quoting (only the escapes the seed uses), re-quoted for shlex."""
    text = match.group(1).replace("\\n", "\n").replace("\\t", "\t").replace("\\'", "'").replace("\\\\", "\\")
    return shlex.quote(text)


def seed_argv(command: str, module: str) -> list[str]:
    """The arguments after ``module`` exactly as bash would pass them."""
    words = shlex.split(re.sub(r"\$'((?:[^'\\]|\\.)*)'", _ansi_c, command.replace("\\\n", " ")))
    return words[words.index(module) + 1:]


def sft_argv() -> list[str]:
    return seed_argv(SEED_SFT, "openrlhf.cli.train_sft")


def rm_argv() -> list[str]:
    return seed_argv(SEED_RM, "openrlhf.cli.train_rm")


def ppo_seed_argv() -> list[str]:
    return seed_argv(SEED_PPO, "openrlhf.cli.train_ppo_ray")


def ppo_argv() -> list[str]:
    """The seed's PPO flags less ``--vllm.sync_backend nccl``, which treadle refuses with
    ``--train.colocate_all`` (OpenRLHF uses CUDA IPC there; ``test_seed_ppo_command``)."""
    argv = ppo_seed_argv()
    k = argv.index("--vllm.sync_backend")
    assert argv[k + 1] == "nccl"
    return argv[:k] + argv[k + 2:]


# ---------------------------------------------------------------------------------------------
# The seed's command lines


def test_seed_argv_is_what_bash_passes():
    argv = sft_argv()
    assert argv[argv.index("--data.input_template") + 1] == "User: {}\nAssistant: "
    assert argv[-2:] == ["--logger.wandb.key", "{wandb_token}"]
    assert ppo_seed_argv()[:2] == ["--ref.num_nodes", "1"]


def test_seed_sft_command():
    cfg = parse_sft(sft_argv())
    assert cfg.data.max_len == 4096
    assert cfg.data.dataset == "Open-Orca/OpenOrca"
    assert (cfg.data.input_key, cfg.data.output_key) == ("question", "response")
    assert cfg.data.input_template == "User: {}\nAssistant: "
    assert (cfg.train.batch_size, cfg.train.micro_batch_size, cfg.train.max_epochs) == (256, 2, 1)
    assert cfg.data.max_samples == 500000
    assert cfg.actor.model_name_or_path == "meta-llama/Meta-Llama-3-8B"
    assert cfg.ckpt.output_dir == "./checkpoint/llama3-8b-sft" and cfg.ckpt.save_steps == -1
    assert cfg.logger.logging_steps == 1 and cfg.eval.steps == -1
    assert cfg.ds.zero_stage == 2 and cfg.ds.packing_samples and cfg.ds.param_dtype == "bf16"
    assert cfg.adam.lr == 5e-6
    assert cfg.actor.gradient_checkpointing_enable is True
    assert cfg.logger.wandb.key == "{wandb_token}"
    assert cfg.local_rank == -1 and not cfg.actor.pretrain_mode_enable and not cfg.data.multiturn


def test_seed_sft_under_the_deepspeed_launcher():
    # `deepspeed --module ...` appends --local_rank=N to the module's arguments.
    assert parse_sft([*sft_argv(), "--local_rank=3"]).local_rank == 3


@pytest.mark.parametrize(("extra", "attr", "value"), [
    (["--data.apply_chat_template", "--data.input_template", "None"], "data.apply_chat_template", True),
    (["--ds.ring_attn_size", "2"], "ds.ring_attn_size", 2),
    (["--data.multiturn", "--data.apply_chat_template", "--data.input_template", "None"], "data.multiturn", True),
    (["--actor.pretrain_mode_enable"], "actor.pretrain_mode_enable", True),
])
def test_seed_sft_optional_switches(extra, attr, value):
    cfg = parse_sft([*sft_argv(), *extra])
    group, field = attr.split(".")
    assert getattr(getattr(cfg, group), field) == value


def test_seed_rm_command():
    cfg = parse_rm(rm_argv())
    assert cfg.ckpt.output_dir == "./checkpoint/llama3-8b-rm" and cfg.ckpt.save_steps == -1
    assert cfg.logger.logging_steps == 1 and cfg.eval.steps == -1
    assert (cfg.train.batch_size, cfg.train.micro_batch_size, cfg.train.max_epochs) == (256, 1, 1)
    assert cfg.actor.model_name_or_path == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert cfg.ds.param_dtype == "bf16" and cfg.ds.zero_stage == 3 and cfg.ds.packing_samples
    assert cfg.data.max_len == 8192
    assert cfg.adam.lr == 9e-6
    assert cfg.data.dataset == "OpenRLHF/preference_dataset_mixture2_and_safe_pku"
    assert cfg.data.apply_chat_template is True
    assert (cfg.data.chosen_key, cfg.data.rejected_key) == ("chosen", "rejected")
    assert cfg.actor.gradient_checkpointing_enable is True
    assert cfg.logger.wandb.key == "{wandb_token}"
    assert cfg.ds.value_head_prefix == "score" and cfg.actor.loss_type == "sigmoid"


def test_rm_un_dotted_keys_are_aliases_of_the_dotted_ones():
    spelled = [a for a in rm_argv() if a not in ("--chosen_key", "chosen", "--rejected_key", "rejected")]
    cfg = parse_rm([*spelled, "--data.chosen_key", "good", "--data.rejected_key", "bad"])
    assert (cfg.data.chosen_key, cfg.data.rejected_key) == ("good", "bad")
    assert parse_rm([*spelled, "--chosen_key", "good"]).data.chosen_key == "good"


def test_seed_ppo_command():
    # --vllm.sync_backend nccl with --train.colocate_all: CUDA IPC from every rank's GPU, as OpenRLHF
    from treadle.trainer.trainers.ppo_build import ipc_every_rank, sync_route

    seed = parse_ppo(ppo_seed_argv())
    assert seed.vllm.sync_backend == "nccl" and seed.engines_colocated
    assert sync_route(seed, cuda=True) == ("cuda_ipc", "nccl") and ipc_every_rank(seed, "cuda_ipc")
    with pytest.raises(ConfigError, match="--vllm.sync_backend nccl needs CUDA"):
        sync_route(seed, cuda=False)
    cfg = parse_ppo(ppo_argv())
    for role in (cfg.ref, cfg.reward, cfg.critic, cfg.actor):
        assert (role.num_nodes, role.num_gpus_per_node) == (1, 8)
    assert (cfg.vllm.num_engines, cfg.vllm.tensor_parallel_size) == (4, 2)
    assert cfg.vllm.gpu_memory_utilization == 0.5 and cfg.vllm.sync_backend is None
    assert cfg.vllm.enforce_eager and cfg.vllm.enable_sleep and cfg.ds.enable_sleep
    assert cfg.train.colocate_all and cfg.train.dynamic_batch_enable and cfg.ckpt.save_hf
    assert cfg.actor.model_name_or_path == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert cfg.reward.model_name_or_path == "OpenRLHF/Llama-3-8b-rm-700k"
    assert cfg.ckpt.path == "/openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf"
    assert (cfg.train.batch_size, cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt) == (128, 1024, 1)
    assert cfg.data.prompt_max_len == 1024 and cfg.rollout.max_new_tokens == 1024 and cfg.max_len == 2048
    assert cfg.data.max_samples == 100000
    assert (cfg.actor.adam.lr, cfg.critic.adam.lr) == (5e-7, 9e-6)
    assert cfg.algo.kl.init_coef == 0.01 and cfg.uses_reference
    assert cfg.data.prompt_dataset == "OpenRLHF/prompt-collection-v0.1"
    assert cfg.data.input_key == "context_messages" and cfg.data.apply_chat_template
    assert cfg.reward.normalize_enable and cfg.actor.gradient_checkpointing_enable and cfg.ds.packing_samples
    assert cfg.logger.wandb.key == "{wandb_token}"
    # gae is the default; like OpenRLHF, the critic starts from the reward model.
    assert cfg.algo.advantage.estimator == "gae"
    assert cfg.critic.model_name_or_path is None
    assert cfg.critic_model_name_or_path == "OpenRLHF/Llama-3-8b-rm-700k"


@pytest.mark.parametrize("extra", [
    ["--algo.kl.init_coef", "0"],
    ["--reward.model_name_or_path", "None", "--reward.remote_url", "http://host:5000/get_reward",
     "--critic.model_name_or_path", "OpenRLHF/Llama-3-8b-rm-700k"],
    ["--rollout.n_samples_per_prompt", "4"],
    ["--rollout.vllm_generate_batch_size", "2048", "--train.async_enable", "--train.no_colocate_all",
     "--vllm.no_enable_sleep", "--ds.no_enable_sleep"],
    ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "mask",
     "--algo.advantage.is_correction_threshold", "0.5", "5.0"],
    ["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_gating", "binary_kl",
     "--algo.advantage.is_correction_threshold", "0.001", "--algo.advantage.estimator", "flash_reinforce",
     "--rollout.n_samples_per_prompt", "1"],
    ["--algo.kl.use_loss", "--algo.kl.unbiased_gradient", "--algo.kl.estimator", "k3"],
    ["--actor.policy_loss_type", "gspo", "--actor.dual_clip", "3", "--algo.advantage.is_correction_level", "token"],
    ["--actor.policy_loss_type", "gspo_token", "--actor.loss_agg_mode", "token-mean"],
    ["--algo.advantage.discount_env_tokens", "--algo.advantage.gamma", "0.99"],
    ["--ckpt.best_metric_key", "eval_default_pass1"],
    ["--actor.policy_loss_type", "gspo"],
])
def test_seed_ppo_advanced_options(extra):
    cfg = parse_ppo([*ppo_argv(), *extra])
    assert isinstance(cfg, PPOConfig)


def test_seed_ppo_advanced_option_values():
    cfg = parse_ppo([*ppo_argv(), "--algo.advantage.is_correction_level", "seq",
                     "--algo.advantage.is_correction_threshold", "0.5", "5.0",
                     "--ckpt.best_metric_key", "eval_default_pass1", "--actor.policy_loss_type", "gspo_token"])
    adv = cfg.algo.advantage
    assert adv.is_correction_on and (adv.is_correction_level, adv.is_correction_mode) == ("seq", "mask")  # seq-mask-tis
    assert adv.is_correction_threshold == (0.5, 5.0) and adv.is_band == (0.5, 5.0)
    assert cfg.ckpt.best_metric_key == "eval_default_pass1" and cfg.actor.policy_loss_type == "gspo_token"
    assert cfg.actor.aggregation == "token-mean"
    one = parse_ppo([*ppo_argv(), "--algo.advantage.is_correction_level", "token",
                     "--algo.advantage.is_correction_gating", "tv", "--algo.advantage.is_correction_threshold", "0.2"])
    assert one.algo.advantage.is_band == (0.0, 0.2)  # one value: an upper bound
    gspo = parse_ppo([*ppo_argv(), "--actor.policy_loss_type", "gspo"])
    assert gspo.actor.loss_agg_mode is None and gspo.actor.aggregation == "seq-mean-token-mean"  # GSPO's own
    over = parse_ppo([*ppo_argv(), "--rollout.vllm_generate_batch_size", "2048", "--train.async_enable",
                      "--train.no_colocate_all", "--vllm.no_enable_sleep", "--ds.no_enable_sleep"])
    assert over.rollout.generate_batch_size == 2048 and over.train.async_enable


def test_best_metric_key_takes_openrlhfs_names_and_refuses_what_no_eval_produces():
    from treadle.trainer.config.commands import ppo_best_metric

    assert ppo_best_metric("eval_default_pass1", 4, True) == "eval/pass@1"
    assert ppo_best_metric("eval_default_pass4", 4, True) == "eval/pass@4"
    assert ppo_best_metric("", 4, True) == "eval/pass@1" and ppo_best_metric("eval/reward_mean", 4, True)
    assert ppo_best_metric("none", 4, True) is None and ppo_best_metric("eval_default_pass1", 4, False) is None
    for bad in ("eval_default_pass8", "eval_math_pass1", "eval/pass1", "reward"):
        with pytest.raises(ConfigError, match=r"is no metric the eval produces \(with --eval.n_samples_per_prompt 4: "
                                              r"eval/pass@1, eval/pass@4, eval/reward_mean"):
            ppo_best_metric(bad, 4, True)
    with pytest.raises(ConfigError, match="'eval_math_pass1' is no metric"):  # before any model loads
        parse_ppo([*ppo_argv(), "--ckpt.best_metric_key", "eval_math_pass1"])


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_every_advantage_estimator_parses(estimator):
    extra = ["--algo.advantage.estimator", estimator]
    if estimator in GROUP_ESTIMATORS:
        extra += ["--rollout.n_samples_per_prompt", "4"]
    cfg = parse_ppo([*ppo_argv(), *extra])
    assert cfg.algo.advantage.estimator == estimator
    assert (cfg.critic_model_name_or_path is not None) == (estimator == "gae")


def test_estimators_are_exactly_openrlhfs():
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo",
                                         "flash_reinforce"}  # OpenRLHF 0.11.2's


def _without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` minus each ``flag`` (and its value when the next word is not a flag)."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in flags:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(arg)
    return out


# ---------------------------------------------------------------------------------------------
# Invalid values and combinations fail loudly, naming the flag


@pytest.mark.parametrize(("extra", "flag"), [
    (["--ds.zero_stage", "5"], "--ds.zero_stage"),
    (["--train.micro_batch_size", "3"], "--train.micro_batch_size"),
    (["--algo.advantage.is_correction_threshold", "5.0", "0.5"], "--algo.advantage.is_correction_threshold"),
    (["--algo.advantage.is_correction_threshold", "0.1", "0.5", "5.0"], "--algo.advantage.is_correction_threshold"),
    (["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
     "--algo.advantage.is_correction_mode"),
    (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_gating", "binary_kl"],
     "--algo.advantage.is_correction_threshold"),
    (["--algo.kl.unbiased_gradient"], "--algo.kl.use_loss"),
    (["--actor.policy_loss_type", "gspo", "--actor.loss_agg_mode", "token-mean"], "--actor.loss_agg_mode"),
    (["--actor.policy_loss_type", "gspo", "--algo.advantage.is_correction_level", "seq"],
     "--algo.advantage.is_correction_level"),
    (["--actor.policy_loss_type", "gspo", "--algo.advantage.is_correction_level", "token",
      "--algo.advantage.is_correction_mode", "clip"], "--algo.advantage.is_correction_mode"),
    (["--rollout.vllm_generate_batch_size", "2048"], "--train.async_enable"),
    (["--algo.advantage.estimator", "group_norm"], "--rollout.n_samples_per_prompt"),
    (["--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "4",
      "--critic.model_name_or_path", "x"], "--critic.model_name_or_path"),
    (["--data.prompt_dataset", "a,b", "--data.prompt_probs", "0.5,0.4"], "--data.prompt_probs"),
    (["--data.prompt_dataset", "a,b,c", "--data.prompt_probs", "0.5,0.5"], "--data.prompt_probs"),
    (["--vllm.num_engines", "2"], "--vllm.num_engines"),
    (["--critic.num_gpus_per_node", "4"], "--critic.num_gpus_per_node"),
    (["--train.no_colocate_all"], "--train.colocate_all"),
    (["--ds.no_packing_samples"], "--ds.packing_samples"),
    (["--reward.remote_url", "http://h/r"], "--reward.remote_url"),
    (["--algo.dynamic_filtering_enable"], "--algo.dynamic_filtering_enable"),
    (["--eval.dataset", "x"], "--eval.dataset"),
    (["--rollout.top_p", "0"], "--rollout.top_p"),
    (["--actor.dual_clip", "0.5"], "--actor.dual_clip"),
    (["--data.input_template", "no placeholder"], "--data.input_template"),
    (["--algo.kl.init_coef", "0", "--algo.kl.use_loss"], "--algo.kl.use_loss"),
    (["--train.partial_rollout_enable"], "--train.async_enable"),
])
def test_invalid_ppo_combinations_name_the_flag(extra, flag):
    with pytest.raises(ConfigError) as exc:
        parse_ppo([*ppo_argv(), *extra])
    assert flag in str(exc.value)


def test_gae_without_a_critic_flag_starts_the_critic_as_openrlhf_does():
    # OpenRLHF's train_ppo_ray: the first reward model when rewards come from one, else the actor's
    argv = _without(ppo_argv(), "--reward.model_name_or_path")
    remote = parse_ppo([*argv, "--reward.remote_url", "http://h/r"])
    assert remote.algo.advantage.estimator == "gae" and remote.critic.model_name_or_path is None
    assert remote.critic_model_name_or_path == remote.actor.model_name_or_path == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert remote.critic_origin == "--actor.model_name_or_path"
    rms = parse_ppo(ppo_argv())
    assert (rms.critic_model_name_or_path, rms.critic_origin) == ("OpenRLHF/Llama-3-8b-rm-700k",
                                                                  "--reward.model_name_or_path")
    own = parse_ppo([*argv, "--reward.remote_url", "http://h/r", "--critic.model_name_or_path", "c"])
    assert (own.critic_model_name_or_path, own.critic_origin) == ("c", "--critic.model_name_or_path")
    agent = parse_ppo([*argv, "--train.agent_func_path", "agent.py"])
    assert agent.critic_model_name_or_path == agent.actor.model_name_or_path
    grpo = parse_ppo([*argv, "--reward.remote_url", "http://h/r", "--algo.advantage.estimator", "group_norm",
                      "--rollout.n_samples_per_prompt", "4"])
    assert grpo.critic_model_name_or_path is None and grpo.critic_origin is None


@pytest.mark.parametrize(("parse", "argv", "extra", "flag"), [
    (parse_sft, sft_argv, ["--data.multiturn"], "--data.apply_chat_template"),
    (parse_sft, sft_argv, ["--ds.ring_attn_size", "2", "--ds.no_packing_samples"], "--ds.packing_samples"),
    (parse_sft, sft_argv, ["--data.dataset", "a,b", "--data.dataset_probs", "0.3,0.3"], "--data.dataset_probs"),
    (parse_sft, sft_argv, ["--adam.lr", "0"], "--adam.lr"),
    (parse_sft, sft_argv, ["--lr_warmup_ratio", "1.5"], "--lr_warmup_ratio"),
    (parse_rm, rm_argv, ["--data.rejected_key", "chosen"], "--data.rejected_key"),
    (parse_rm, rm_argv, ["--ds.load_in_4bit"], "--ds.lora.rank"),
    (parse_rm, rm_argv, ["--ds.lora.dropout", "1"], "--ds.lora.dropout"),
    (parse_rm, rm_argv, ["--data.input_template", "Q: {}"], "--data.apply_chat_template"),
])
def test_invalid_supervised_values_name_the_flag(parse, argv, extra, flag):
    with pytest.raises(ConfigError) as exc:
        parse([*argv(), *extra])
    assert flag in str(exc.value)


def test_required_model_is_named():
    with pytest.raises(ConfigError, match=r"--actor\.model_name_or_path is required"):
        parse_sft(_without(sft_argv(), "--actor.model_name_or_path"))


def test_bad_choice_exits_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_ppo([*ppo_argv(), "--algo.advantage.estimator", "grpo"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--algo.advantage.estimator" in err and "grpo" in err


# ---------------------------------------------------------------------------------------------
# Retired flags and aliases


def test_value_prefix_head_from_the_readme_prose_names_the_new_flag():
    with pytest.raises(ConfigError, match=r"--value_prefix_head was renamed: use --ds\.value_head_prefix"):
        parse_rm([*rm_argv(), "--value_prefix_head", "score"])


@pytest.mark.parametrize(("parse", "argv", "old", "new"), [
    (parse_sft, sft_argv, "--pretrain", "--actor.model_name_or_path"),
    (parse_sft, sft_argv, "--learning_rate", "--adam.lr"),
    (parse_ppo, ppo_argv, "--actor_learning_rate", "--actor.adam.lr"),
    (parse_ppo, ppo_argv, "--advantage_estimator", "--algo.advantage.estimator"),
    (parse_ppo, ppo_argv, "--colocate_all_models", "--train.colocate_all"),
    (parse_ppo, ppo_argv, "--max_norm", "--actor.max_norm"),
])
def test_old_openrlhf_flags_are_errors_naming_the_new_ones(parse, argv, old, new):
    with pytest.raises(ConfigError) as exc:
        parse([*argv(), old, "1"])
    assert old in str(exc.value) and new in str(exc.value)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_renamed_tables_point_at_real_flags_and_never_shadow_one(command):
    flags = set(command_flags(command))
    renamed = COMMANDS[command][1]
    assert not flags & set(renamed), "a retired name is still a live flag"
    for old, new in renamed.items():
        if not new.startswith("--"):  # refused outright: the value is the reason (test_config_fields.py)
            continue
        for target in new.split(" / "):
            assert target in flags, f"{command}: {old} -> {target} is not a flag"


NEW_RL_FLAGS = {  # issue 28: each new flag and a phrase of its --help text
    "--algo.advantage.is_correction_level": "seq (gate each sequence",
    "--algo.advantage.is_correction_mode": "clamp the token ratio into the band",
    "--algo.advantage.is_correction_gating": "binary_kl / tv divergence",
    "--algo.advantage.is_correction_threshold": "or one HIGH",
    "--algo.advantage.discount_env_tokens": "once per environment token",
    "--algo.kl.unbiased_gradient": "by pi / pi_old (capped at 10)",
    "--actor.loss_agg_mode": "None: the loss type's own",
    "--actor.policy_loss_type": "gspo_token: GSPO-token",
}


def test_help_documents_the_new_rl_flags(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # one column of help boxes: a flag's text reads in order

    def text() -> str:
        return " ".join(re.sub("[\u2500-\u257f]", " ", capsys.readouterr().out).split())

    with pytest.raises(SystemExit):
        parse_ppo(["--help"])
    out = text()
    for flag, phrase in NEW_RL_FLAGS.items():
        assert flag in out and phrase in out, flag
    assert "flash_reinforce" in out
    with pytest.raises(SystemExit):
        parse_sft(["--help"])
    out = text()
    assert "--actor.loss_agg_mode" in out and "SFTLoss(token_level_loss=False)" in out


def test_sft_loss_agg_mode():
    assert parse_sft(sft_argv()).actor.loss_agg_mode == "token-mean"
    cfg = parse_sft([*sft_argv(), "--actor.loss_agg_mode", "seq-mean-token-mean"])
    assert cfg.actor.loss_agg_mode == "seq-mean-token-mean"


def test_help_documents_the_aliases(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the help box wraps at the terminal width
    with pytest.raises(SystemExit):
        parse_ppo(["--help"])
    out = capsys.readouterr().out
    assert "--prompt_max_len INT, --data.prompt_max_len INT" in out
    assert "--generate_max_len {None}|INT, --rollout.max_new_tokens {None}|INT" in out
    with pytest.raises(SystemExit):
        parse_rm(["--help"])
    out = capsys.readouterr().out
    assert "--chosen_key STR, --data.chosen_key STR" in out and "--rejected_key STR" in out


# ---------------------------------------------------------------------------------------------
# YAML and the pinned flag sets


def test_resolved_ppo_config_round_trips_through_yaml(tmp_path):
    cfg = parse_ppo([*ppo_argv(), "--algo.advantage.is_correction_threshold", "0.25", "4"])
    path = tmp_path / "config.yaml"
    dump_yaml(cfg, path, redact=False)
    assert load_yaml(PPOConfig, path) == cfg
    redacted = load_yaml(PPOConfig, dump_yaml(cfg))
    assert redacted.logger.wandb.key is None and "{wandb_token}" not in dump_yaml(cfg)


def test_config_file_then_flags(tmp_path):
    path = tmp_path / "ppo.yaml"
    dump_yaml(parse_ppo(ppo_argv()), path)
    cfg = parse_ppo(["--config", str(path), "--algo.advantage.estimator", "rloo",
                     "--rollout.n_samples_per_prompt", "8", "--actor.adam.lr", "1e-6"])
    assert cfg.algo.advantage.estimator == "rloo" and cfg.rollout.n_samples_per_prompt == 8
    assert cfg.actor.adam.lr == 1e-6 and cfg.vllm.num_engines == 4  # the rest from the file


@pytest.mark.parametrize("command", list(COMMANDS))
def test_flag_set_matches_the_snapshot(command):
    sections = dict(re.findall(r"^\[(\w+)\]\n(.*?)(?=^\[|\Z)", SNAPSHOT.read_text(), flags=re.M | re.S))
    pinned = sections[command].split()
    current = command_flags(command)
    added, removed = sorted(set(current) - set(pinned)), sorted(set(pinned) - set(current))
    assert current == pinned, f"{command}: added {added}, removed {removed}; see the module docstring"


def test_snapshot_file_is_exactly_the_dump(capsys):
    assert config_main(["--dump-flags"]) == 0
    assert capsys.readouterr().out == SNAPSHOT.read_text() == flags_snapshot()


def test_main_prints_the_resolved_config_or_the_error(capsys):
    assert config_main(["rm", *rm_argv()]) == 0
    assert load_yaml(type(parse_rm(rm_argv())), capsys.readouterr().out).data.max_len == 8192
    assert config_main(["rm", *rm_argv(), "--ds.zero_stage", "4"]) == 2
    assert "--ds.zero_stage must be 0, 1, 2 or 3, got 4" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# DPO / KTO


def test_dpo_and_kto_commands_parse_and_check_their_losses():
    from treadle.trainer.config import parse_dpo, parse_kto

    base = ["--actor.model_name_or_path", "m", "--data.dataset", "d.jsonl"]
    dpo = parse_dpo([*base, "--actor.loss_type", "ipo", "--actor.beta", "0.3", "--ref.precompute_enable",
                     "--chosen_key", "good"])
    assert (dpo.actor.loss_type, dpo.actor.beta, dpo.ref.precompute_enable, dpo.data.chosen_key) == ("ipo", 0.3, True, "good")
    with pytest.raises(ConfigError, match="--actor.label_smoothing .cDPO. applies to --actor.loss_type sigmoid"):
        parse_dpo([*base, "--actor.loss_type", "ipo", "--actor.label_smoothing", "0.1"])
    kto = parse_kto([*base, "--data.label_key", "ok", "--actor.undesirable_weight", "1.5"])
    assert kto.data.label_key == "ok" and kto.actor.undesirable_weight == 1.5
    with pytest.raises(ConfigError, match="--train.batch_size must be >= 2"):
        parse_kto([*base, "--train.batch_size", "1", "--train.micro_batch_size", "1"])
    with pytest.raises(ConfigError, match="--ipo was renamed: use --actor.loss_type"):
        parse_dpo([*base, "--ipo"])


@pytest.mark.parametrize(("extra", "flag"), [
    (["--vllm.endpoint", "tcp://10.1.2.3:5570"], "--vllm.curve_dir"),
    (["--reward.remote_url", "tcp://10.1.2.3:5555"], "--reward.curve_dir")])
def test_a_daemon_off_loopback_needs_the_clients_curve_keys(extra, flag, tmp_path):
    argv = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--algo.advantage.estimator",
            "group_norm", "--rollout.n_samples_per_prompt", "4", "--reward.remote_url", "reward.py"]
    if extra[0] == "--reward.remote_url":
        argv = argv[:-2]
    with pytest.raises(ConfigError, match=rf"10\.1\.2\.3.*{flag}"):
        parse_ppo([*argv, *extra])
    if flag == "--vllm.curve_dir":  # its engines must reach the weight group on this host, too
        with pytest.raises(ConfigError, match="--vllm.sync_host"):
            parse_ppo([*argv, *extra, flag, str(tmp_path)])
        extra = [*extra, "--vllm.sync_host", "10.1.2.9"]
    cfg = parse_ppo([*argv, *extra, flag, str(tmp_path)])  # keys are loaded when the trainer connects
    assert str(tmp_path) in (cfg.vllm.curve_dir, cfg.reward.curve_dir)


def test_reward_token_file_is_read_and_checked(tmp_path):
    (tmp_path / "tok").write_text("s3cret\n")
    cfg = parse_ppo([*ppo_argv(), "--reward.token_file", str(tmp_path / "tok")])
    assert cfg.reward.bearer == "s3cret"
    with pytest.raises(ConfigError, match="--reward.token_file .*missing is not a file"):
        parse_ppo([*ppo_argv(), "--reward.token_file", str(tmp_path / "missing")])


def test_agent_program_and_agent_file_are_one_or_the_other():
    base = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--algo.advantage.estimator",
            "group_norm", "--rollout.n_samples_per_prompt", "4"]
    cfg = parse_ppo([*base, "--train.agent_cmd", "python agent.py --fast"])
    assert cfg.train.agent_cmd == "python agent.py --fast"
    with pytest.raises(ConfigError, match="--train.agent_func_path and --train.agent_cmd are both set"):
        parse_ppo([*base, "--train.agent_cmd", "python a.py", "--train.agent_func_path", "agent.py"])
    with pytest.raises(ConfigError, match="--train.agent_cmd computes rewards itself"):
        parse_ppo([*base, "--train.agent_cmd", "python a.py", "--reward.remote_url", "r.py"])


def test_the_sync_canary_is_on_by_default_sized_by_its_flag_and_checked(tokenizer):
    """Every sync's canary: 16 tokens of a fixed text unless --vllm.canary_tokens says otherwise
    (0: none); bad sizes and tolerances are refused at parse time."""
    from treadle.trainer.trainers.ppo_build import canary_ids

    cfg = parse_ppo(ppo_argv())
    assert cfg.canary_size == 16 and cfg.vllm.canary_tolerance is None
    assert parse_ppo([*ppo_argv(), "--vllm.canary_tokens", "0"]).canary_size == 0
    ring = ["--ds.ring_attn_size", "2"]
    assert parse_ppo([*ppo_argv(), *ring]).canary_size == 0  # its forward cannot run unsharded
    with pytest.raises(ConfigError, match="--vllm.canary_tokens 16 with --ds.ring_attn_size 2"):
        parse_ppo([*ppo_argv(), *ring, "--vllm.canary_tokens", "16"])
    ids = canary_ids(tokenizer, 16)
    assert len(ids) == 16 and len(set(ids)) > 4 and all(0 <= i < len(tokenizer) for i in ids)
    assert canary_ids(tokenizer, 16) == ids and canary_ids(tokenizer, 400)[:16] == ids  # fixed, repeated to size
    assert canary_ids(tokenizer, 0) == ()
    with pytest.raises(ConfigError, match="--vllm.canary_tokens must be 0 .no canary. or >= 2, got 1"):
        parse_ppo([*ppo_argv(), "--vllm.canary_tokens", "1"])
    with pytest.raises(ConfigError, match="--vllm.canary_tolerance must be > 0 .or unset., got -1"):
        parse_ppo([*ppo_argv(), "--vllm.canary_tolerance", "-1"])


def test_the_weight_sync_goes_where_it_can_work():
    """Unset, the backend is picked per placement (colocated engines: cuda_ipc from every rank on
    CUDA, gloo on CPU; else nccl on CUDA, gloo on CPU); nccl means cuda_ipc for colocated engines
    (OpenRLHF's meaning); a backend given is otherwise used or refused; cuda_ipc needs CUDA."""
    from treadle.trainer.trainers.ppo_build import ipc_every_rank, sync_route

    def with_backend(backend, *extra, colocated=True):
        argv = ppo_argv()
        if not colocated:
            argv.remove("--train.colocate_all")
            argv[argv.index("--vllm.num_engines") + 1] = "1"
            for flag in ("--vllm.enable_sleep", "--ds.enable_sleep"):
                argv.remove(flag)
        return parse_ppo([*argv, *(["--vllm.sync_backend", backend] if backend else []), *extra])

    seed = with_backend(None)  # 4 engines of TP 2 on the trainer's 8 GPUs
    assert seed.train.colocate_all and seed.vllm.sync_backend is None
    assert sync_route(seed, cuda=True) == ("cuda_ipc", "nccl") and ipc_every_rank(seed, "cuda_ipc")
    assert sync_route(seed, cuda=False) == ("collective", "gloo")
    apart = with_backend(None, colocated=False)
    assert sync_route(apart, cuda=True) == ("collective", "nccl") and not ipc_every_rank(apart, "collective")
    assert sync_route(apart, cuda=False) == ("collective", "gloo")
    assert sync_route(with_backend("nccl", colocated=False), cuda=True) == ("collective", "nccl")
    with pytest.raises(ConfigError, match="--vllm.sync_backend nccl needs CUDA: on CPU use gloo"):
        sync_route(with_backend("nccl", colocated=False), cuda=False)
    assert sync_route(with_backend("nccl"), cuda=True) == ("cuda_ipc", "nccl")
    assert sync_route(with_backend("gloo"), cuda=True) == ("collective", "gloo")
    one_hf = ("--vllm.backend", "hf", "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1",
              "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1", "--reward.num_gpus_per_node", "1",
              "--critic.num_gpus_per_node", "1")
    assert sync_route(with_backend("cuda_ipc", *one_hf), cuda=True) == ("cuda_ipc", "nccl")
    one_vllm = [*one_hf[2:]]  # the vllm backend takes cuda_ipc too
    assert sync_route(with_backend("cuda_ipc", *one_vllm), cuda=True) == ("cuda_ipc", "nccl")
    assert sync_route(with_backend(None, *one_vllm), cuda=True) == ("cuda_ipc", "nccl")
    assert sync_route(with_backend(None, *one_vllm), cuda=False) == ("collective", "gloo")
    # a running daemon colocated with the trainer (the launcher's, or one given the same GPUs)
    assert sync_route(with_backend(None, *one_vllm, "--vllm.endpoint", "tcp://127.0.0.1:5570"),
                      cuda=True) == ("cuda_ipc", "nccl")
    # colocated, 8 engine GPUs: every rank shares its copy
    assert sync_route(with_backend("cuda_ipc", "--vllm.backend", "hf"), cuda=True) == ("cuda_ipc", "nccl")
    with pytest.raises(ConfigError, match="puts its 4 engine GPUs on GPUs of their own"):  # at parse time
        with_backend("cuda_ipc", "--vllm.num_engines", "2", colocated=False)
    # engines apart on a running daemon: rank 0 alone shares, its engines say whether they can open it
    running = with_backend("cuda_ipc", "--vllm.endpoint", "tcp://127.0.0.1:5570", colocated=False)
    assert sync_route(running, cuda=True)[0] == "cuda_ipc" and not ipc_every_rank(running, "cuda_ipc")
    with pytest.raises(ConfigError, match="cuda_ipc shares GPU memory: it needs CUDA"):
        sync_route(with_backend("cuda_ipc", *one_hf), cuda=False)


def test_a_daemon_the_trainer_starts_puts_its_engines_beside_or_on_the_trainers_gpus():
    import dataclasses

    from treadle.trainer.daemon import daemon_spec, engine_gpus, serve_args

    assert engine_gpus(engine_gpus=4, trainer_gpus=2, colocate=False, visible=8, mask=None) == (2, 3, 4, 5)
    assert engine_gpus(engine_gpus=2, trainer_gpus=2, colocate=True, visible=2, mask=None) == (0, 1)
    assert engine_gpus(engine_gpus=1, trainer_gpus=1, colocate=False, visible=2, mask="5, 7") == (7,)  # renumbered
    with pytest.raises(ConfigError, match=r"need 2 GPU\(s\) of their own beside the trainer's 1 on this host, which has 2"):
        engine_gpus(engine_gpus=2, trainer_gpus=1, colocate=False, visible=2, mask=None)
    with pytest.raises(ConfigError, match="the engines' 16 GPUs must be among the trainer's 8"):
        engine_gpus(engine_gpus=16, trainer_gpus=8, colocate=True, visible=8, mask=None)
    with pytest.raises(ConfigError, match="names GPUs by UUID"):
        engine_gpus(engine_gpus=1, trainer_gpus=1, colocate=True, visible=1, mask="GPU-0f3a")
    seed = daemon_spec(parse_ppo(ppo_argv()))  # vLLM, 4 engines x TP 2, colocated on 8 GPUs
    args = serve_args(dataclasses.replace(seed, gpu_ids=tuple(range(8))), "tcp://127.0.0.1:1")
    assert args[args.index("--gpu_ids") + 1:args.index("--gpu_ids") + 9] == [str(g) for g in range(8)]
    assert "--engine.device" not in args  # vLLM places itself on what CUDA_VISIBLE_DEVICES shows it
    hf = serve_args(dataclasses.replace(seed, backend="hf", engines=1, tensor_parallel_size=1, gpu_ids=(0,)), "tcp://h:1")
    assert hf[hf.index("--engine.device") + 1] == "cuda" and hf[hf.index("--gpu_ids") + 1] == "0"
    cpu = serve_args(dataclasses.replace(seed, backend="hf"), "tcp://h:1")
    assert "--gpu_ids" not in cpu and "--engine.device" not in cpu
