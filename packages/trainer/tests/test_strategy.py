"""The DeepSpeed config built from the typed config (pure), batch arithmetic, optimizer groups."""

from __future__ import annotations

import pytest
import torch

from treadle.common.config import ConfigError
from treadle.trainer.config import parse_sft
from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.config.optim import OptimizerConfig
from treadle.trainer.strategy.deepspeed import (
    build_optimizer,
    build_scheduler,
    ds_config,
    grad_accum_steps,
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
    assert cfg["tensor_parallel"] == {"autotp_size": 2} and cfg["compile"] == {"deepcompile": True}
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
    with pytest.raises(ConfigError, match="--optim muon"):
        build_optimizer(model, parse_sft(["--actor.model_name_or_path", "m", "--data.dataset", "d", "--optim", "muon"]), offload=False)
