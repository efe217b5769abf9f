"""The actor's EMA (``models.ema``) on real DeepSpeed engines, run by test_ema.py under
``torchrun --nproc_per_node 2`` (gloo): for ZeRO-3 (and its parameter-offloaded variant) and
ZeRO-2, a tiny-model engine takes 3 optimizer steps (the ranks on different batches) while
``ActorEMA`` follows it; rank 0 records the whole trainable weights before and after every step
(gathered: they are what the EMA must average), the EMA's export, and the export of a fresh
``ActorEMA`` that loaded the slices the first one saved (a checkpoint's round trip). Rank 0 writes
``<out>/results.pt`` ({variant: {"weights": [theta_0..theta_3], "export": {...}, "numels": ...}}).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

BETA = 0.5
STEPS = 3


def full_weights(engine, names: list[str], zero3: bool) -> dict[str, torch.Tensor]:
    import deepspeed

    out = {}
    for name, p in engine.module.named_parameters():
        if name in names:
            with deepspeed.zero.GatheredParameters([p], enabled=zero3):
                out[name] = p.detach().clone().cpu()
    return out


def run(model: str, out: str, stage: int, offload: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from treadle.trainer.checkpoint.export import full_state_dict
    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.config.optim import AdamConfig, OptimizerConfig
    from treadle.trainer.models.ema import ActorEMA
    from treadle.trainer.strategy.deepspeed import build_engine

    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ds = DeepSpeedConfig(zero_stage=stage, param_dtype="fp32", param_offload=offload)
    optim = OptimizerConfig(adam=AdamConfig(lr=1e-2), lr_warmup_ratio=0.0, lr_scheduler="constant")
    engine = build_engine(module, ds, optim, micro_batch=2, grad_accum=1, world=dist.get_world_size(), total_steps=STEPS)
    ema = ActorEMA(engine.module, beta=BETA, zero3=stage == 3)
    weights = [full_weights(engine, ema.names, stage == 3)]
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own batches
    for _ in range(STEPS):
        ids = torch.randint(0, module.config.vocab_size, (2, 12), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ema.update()
        weights.append(full_weights(engine, ema.names, stage == 3))
    state = full_state_dict(engine, zero_stage=stage, is_main=dist.get_rank() == 0)
    export = ema.apply(dict(state) if state is not None else None, is_main=dist.get_rank() == 0)
    # a checkpoint's round trip: a fresh average (the engine's weights) loads the saved slices
    folder = Path(out) / f"ckpt_{stage}_{offload}"
    folder.mkdir(exist_ok=True)
    ema.save(folder, dist.get_rank())
    dist.barrier()
    fresh = ActorEMA(engine.module, beta=BETA, zero3=stage == 3)
    loaded = fresh.load(folder, dist.get_rank())
    reloaded = fresh.apply(dict(state) if state is not None else None, is_main=dist.get_rank() == 0)
    shard = sum(s.numel() for s in ema.shards)
    total = sum(w.numel() for w in weights[0].values())
    engine.destroy()
    return {"weights": weights, "export": export, "reloaded": reloaded, "loaded": loaded,
            "shard_numel": shard, "total_numel": total,
            "shard_device": str(ema.shards[0].device), "shard_dtype": str(ema.shards[0].dtype)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from treadle.trainer.strategy.deepspeed import init_distributed

    init_distributed()
    results = {name: run(a.model, a.out, stage, offload)
               for name, stage, offload in (("zero3", 3, False), ("zero3_offload", 3, True), ("zero2", 2, False))}
    if dist.get_rank() == 0:
        torch.save(results, Path(a.out) / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
