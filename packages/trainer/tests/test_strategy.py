"""The DeepSpeed config built from the typed config (pure), batch arithmetic, optimizer groups."""

from __future__ import annotations

import pytest
import torch

from treadle.common.config import ConfigError
from treadle.trainer.config import parse_sft
from treadle.trainer.config.deepspeed import DeepSpeedConfig, LoraConfig
from treadle.trainer.config.optim import OptimizerConfig
from treadle.trainer.strategy.deepspeed import (
    build_engine,
    build_optimizer,
    build_scheduler,
    check_autotp,
    check_deepcompile,
    ds_config,
    frozen_config,
    grad_accum_steps,
    jit_arch_list,
)


def test_zero_stages_offload_precision_and_passthroughs():
    optim = OptimizerConfig(max_norm=0.5)
    base = ds_config(DeepSpeedConfig(zero_stage=0, param_dtype="fp32"), optim, micro_batch=2, grad_accum=4, world=2)
    assert base["train_batch_size"] == 16 and base["gradient_clipping"] == 0.5
    assert base["zero_optimization"]["stage"] == 0 and not base["bf16"]["enabled"] and not base["fp16"]["enabled"]
    assert "offload_optimizer" not in base["zero_optimization"] and "tensor_parallel" not in base
    ds = DeepSpeedConfig(zero_stage=3, param_dtype="bf16", adam_offload=True, param_offload=True, zpg=8,
                         tensor_parallel_size=2, deepcompile=True, grad_accum_dtype="fp32", overlap_comm=True)
    cfg = ds_config(ds, optim, micro_batch=1, grad_accum=1, world=8)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert zero["zero_hpz_partition_size"] == 8 and zero["overlap_comm"] and cfg["bf16"]["enabled"]
    assert cfg["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}  # full-vocab logits
    assert "train_batch_size" not in cfg and cfg["compile"] == {"deepcompile": True}
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds_config(ds, None, micro_batch=1, grad_accum=1, world=1)["gradient_clipping"] == 0.0


def test_param_offload_needs_zero3():
    with pytest.raises(ConfigError, match="--param_offload needs --zero_stage 3"):
        DeepSpeedConfig(zero_stage=2, param_offload=True)


def test_batch_arithmetic_names_the_flags():
    assert grad_accum_steps(256, 2, 8) == 16
    with pytest.raises(ConfigError, match="--train.batch_size 10 must be a multiple of --train.micro_batch_size 2 x 4 ranks"):
        grad_accum_steps(10, 2, 4)


def test_optimizer_skips_decay_on_vectors_and_schedule_warms_up():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = parse_sft(["--actor.model_name_or_path", "m", "--data.dataset", "d", "--adam.weight_decay", "0.1",
                     "--adam.lr", "1e-3", "--lr_warmup_ratio", "0.5", "--lr_scheduler", "cosine_with_min_lr"])
    opt = build_optimizer(model, cfg, offload=False)
    decays = sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups)
    assert decays == [(0.0, 3), (0.1, 1)]  # Linear.bias, LayerNorm weight/bias: no decay
    sched = build_scheduler(opt, cfg, total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-3) and lrs[-1] >= 1e-4 * 0.99  # min_lr_ratio 0.1


@pytest.mark.parametrize(("given", "built"), [
    ("9.0a", "9.0"),                    # the H200 image's own value; DeepSpeed's int() fails on '0a'
    ("8.0;9.0a+PTX", "8.0;9.0+PTX"),
    ("9.0 9.0a 10.0f", "9.0;10.0"),     # whitespace-separated, repeats dropped
    ("8.0;9.0+PTX", None),              # already readable: left as is
    (None, None), ("", None),
    ("sm_90", None),                    # not an arch entry: DeepSpeed reports it itself
])
def test_jit_arch_list_gives_deepspeed_numbers_it_can_parse(given, built):
    assert jit_arch_list(given) == built


def test_frozen_reference_config_is_zero3_without_optimizer():
    ds = DeepSpeedConfig(zero_stage=3, param_dtype="bf16")
    cfg = frozen_config(ds, offload=True, world=4, hidden_size=64)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu" and "offload_optimizer" not in zero
    assert zero["stage3_param_persistence_threshold"] == 640 and cfg["train_batch_size"] == 4 and cfg["bf16"]["enabled"]
    assert "offload_param" not in frozen_config(ds, offload=False, world=1, hidden_size=None)["zero_optimization"]


def test_deepcompile_is_refused_on_cpu_and_without_zero():
    check_deepcompile(DeepSpeedConfig(deepcompile=False), "cpu")  # off: nothing to check
    check_deepcompile(DeepSpeedConfig(deepcompile=True, zero_stage=3), "cuda")
    with pytest.raises(ConfigError, match=r"--ds.deepcompile needs CUDA: .* this run's is cpu"):
        check_deepcompile(DeepSpeedConfig(deepcompile=True), "cpu")
    with pytest.raises(ConfigError, match="--ds.deepcompile needs --ds.zero_stage 1, 2 or 3"):
        check_deepcompile(DeepSpeedConfig(deepcompile=True, zero_stage=0), "cuda")
    cfg = parse_sft(["--actor.model_name_or_path", "m", "--data.dataset", "d", "--ds.deepcompile"])
    with pytest.raises(ConfigError, match="--ds.deepcompile needs CUDA"):  # before DeepSpeed is asked anything
        build_engine(torch.nn.Linear(2, 2), cfg.ds, cfg, micro_batch=1, grad_accum=1, world=1, total_steps=1)


def test_autotp_combinations_that_cannot_train_are_refused():
    from types import SimpleNamespace

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(num_key_value_heads=1)
    check_autotp(DeepSpeedConfig(zero_stage=2, tensor_parallel_size=2), model)  # works: a rank without heads
    with pytest.raises(ConfigError, match="--ds.tensor_parallel_size 2 exceeds the model's 1 key/value heads"):
        check_autotp(DeepSpeedConfig(zero_stage=3, tensor_parallel_size=2), model)
    with pytest.raises(ConfigError, match="AutoTP and ring attention"):
        DeepSpeedConfig(tensor_parallel_size=2, ring_attn_size=2, packing_samples=True)
    with pytest.raises(ConfigError, match="AutoTP shards the linear layers LoRA adapts"):
        DeepSpeedConfig(tensor_parallel_size=2, lora=LoraConfig(rank=4))


@pytest.mark.parametrize("recipe", ["rm", "ppo"])
def test_recipes_without_autotp_refuse_it(recipe, tmp_path):
    from treadle.trainer import config
    from treadle.trainer.trainers import ppo_build, rm

    argv = ["--actor.model_name_or_path", "m", "--ds.tensor_parallel_size", "2", "--ckpt.path", str(tmp_path)]
    if recipe == "rm":
        with pytest.raises(ConfigError, match=r"--ds.tensor_parallel_size > 1 \(AutoTP\): not available"):
            rm.build_trainer(config.parse_rm([*argv, "--data.dataset", "d"]))
    else:
        with pytest.raises(ConfigError, match=r"--ds.tensor_parallel_size > 1 \(AutoTP\): not available"):
            ppo_build.build_parts(config.parse_ppo([*argv, "--data.prompt_dataset", "d", "--reward.remote_url", "x",
                                                    "--algo.advantage.estimator", "reinforce"]))


def test_max_restarts_is_the_launchers_and_refused_by_the_trainer_alone(tmp_path):
    """``--train.max_restarts`` (issue 32's name): a launcher takes it off the trainer's flags and
    restarts the run; ``treadle-train ppo`` on its own refuses it before anything starts."""
    from treadle.trainer import config
    from treadle.trainer.trainers import ppo_build

    argv = ["--actor.model_name_or_path", "m", "--ckpt.path", str(tmp_path), "--data.prompt_dataset", "d",
            "--reward.remote_url", "x", "--algo.advantage.estimator", "reinforce", "--train.max_restarts", "2"]
    with pytest.raises(ConfigError, match=r"--train\.max_restarts 2 resumes from the trainer's checkpoints, but "
                                          r"--ckpt\.save_steps -1"):
        config.parse_ppo(argv)
    with pytest.raises(ConfigError, match=r"--train\.max_restarts 2: restarting a failed run is the launcher's"):
        ppo_build.build_parts(config.parse_ppo([*argv, "--ckpt.save_steps", "1"]))
