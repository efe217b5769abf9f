"""Distributed scenarios on the tiny model, run by test_distributed.py under
``torchrun --nproc_per_node 2`` (gloo). Rank 0 writes ``<out>/results.json``; the test asserts.

Sharing one launch keeps the suite fast (start-up and imports dominate on a 2-core CPU):

- ``grad_split``: one SFT step's all-reduced gradient (ZeRO-0) for three ways of splitting the
  same step (1 sample per micro-batch, 4 per micro-batch, packed by a token budget), and the
  gradient of the plain token-mean loss of all 8 samples computed without DeepSpeed on rank 0.
- ``trajectories``: per-step SFT losses of ZeRO-0 / ZeRO-3 padded and ZeRO-2 packed /
  packed with dynamic batches.
- ``resume``: an 8-step run (2 epochs) saving every 2 steps, keeping 3, and a run resumed from
  its step-4 checkpoint (the end of epoch 0).
- ``recipes``: RM (ZeRO-3, margin), DPO (packed, reference on the fly), KTO (ZeRO-1,
  precomputed reference) losses over two epochs, and their exported models.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def sft_argv(a: argparse.Namespace, name: str, *extra: str) -> list[str]:
    return ["--actor.model_name_or_path", a.model, "--data.dataset", f"{a.data}/sft.jsonl",
            "--data.input_key", "question", "--data.output_key", "response", "--data.input_template", "User: {}\nAssistant: ",
            "--data.max_samples", "32", "--train.batch_size", "8", "--train.micro_batch_size", "2",
            "--ds.param_dtype", "fp32", "--adam.lr", "1e-3", "--lr_warmup_ratio", "0", "--lr_scheduler", "constant",
            "--ckpt.path", f"{a.out}/{name}/ckpt", "--ckpt.output_dir", f"{a.out}/{name}/model", *extra]


def grad_split(a: argparse.Namespace) -> dict:
    from deepspeed.utils import safe_get_full_grad

    from treadle.trainer.config import parse_sft
    from treadle.trainer.trainers.sft import build_trainer

    variants = {"micro1": ["--train.micro_batch_size", "1"], "micro4": ["--train.micro_batch_size", "4"],
                "packed_budget": ["--ds.packing_samples", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "40"]}
    grads, micro_batches, trainer = {}, {}, None
    for name, extra in variants.items():
        trainer = build_trainer(parse_sft(sft_argv(a, f"grad_{name}", "--ds.zero_stage", "0", *extra)))
        engine, captured = trainer.engine, {}
        step = engine.step

        def capture(step=step, engine=engine, captured=captured):  # gradients as reduced, before the update
            if engine.is_gradient_accumulation_boundary():
                captured["g"] = torch.cat([safe_get_full_grad(p).reshape(-1) for p in engine.module.parameters()])
            step()

        engine.step = capture
        metrics = trainer.train_step(0, 0)
        grads[name], micro_batches[name] = captured["g"], metrics["micro_batches"]
    ref = _plain_gradient(trainer)
    out = {"micro_batches": micro_batches, "ref_norm": ref.norm().item()}
    out["max_diff"] = {name: (g.cpu() - ref).abs().max().item() for name, g in grads.items()}
    return out


def _plain_gradient(trainer) -> torch.Tensor:  # noqa: ANN001
    """d/dtheta of the token-mean NLL of the step's 8 samples, one process, no DeepSpeed."""
    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.data.batching import pad_batch
    from treadle.trainer.losses.sft import nll_loss
    from treadle.trainer.models.actor import Actor
    from treadle.trainer.models.loading import load_causal_lm

    order = trainer.p.order
    samples = [trainer.p.train_set[i] for r in range(order.world) for i in order.rank_share(0, 0, r)]
    model = load_causal_lm(trainer.p.tokenizer.name_or_path, DeepSpeedConfig(param_dtype="fp32"), trainable=True)
    batch = pad_batch(samples, pad_id=trainer.pad_id)
    nll_loss(Actor(model)(batch).logprobs, batch.target_mask, float(batch.target_mask.sum())).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def trajectories(a: argparse.Namespace, steps: int = 4) -> dict:
    from treadle.trainer.config import parse_sft
    from treadle.trainer.trainers.sft import build_trainer

    variants = {"zero0": ["--ds.zero_stage", "0"], "zero3": ["--ds.zero_stage", "3"],
                "zero2_packed": ["--ds.zero_stage", "2", "--ds.packing_samples"],
                "zero2_dynamic": ["--ds.zero_stage", "2", "--ds.packing_samples", "--train.dynamic_batch_enable",
                                  "--train.max_tokens_per_gpu", "48"]}
    out = {}
    for name, extra in variants.items():
        trainer = build_trainer(parse_sft(sft_argv(a, f"traj_{name}", *extra)))
        out[name] = [trainer.train_step(0, s)["loss"] for s in range(steps)]
    return out


def resume(a: argparse.Namespace) -> dict:
    from treadle.trainer.config import parse_sft
    from treadle.trainer.trainers.sft import build_trainer

    common = ["--ds.zero_stage", "2", "--ckpt.save_steps", "2", "--ckpt.max_num", "3", "--eval.dataset",
              f"{a.data}/sft.jsonl", "--eval.steps", "1", "--ckpt.best_metric_key", "none"]
    full = build_trainer(parse_sft(sft_argv(a, "resume_full", *common)))
    full.fit()
    full.close(plot=False)
    if dist.get_rank() == 0:
        shutil.copytree(f"{a.out}/resume_full/ckpt/step_00000004", f"{a.out}/resume_part/ckpt/step_00000004")
    dist.barrier()
    part = build_trainer(parse_sft(sft_argv(a, "resume_part", *common, "--ckpt.load_enable")))
    state = part.fit(resume=True)
    part.close(plot=False)
    return {"final_step": state.global_step, "full": f"{a.out}/resume_full", "part": f"{a.out}/resume_part"}


def recipes(a: argparse.Namespace) -> dict:
    from treadle.trainer.config import parse_dpo, parse_kto, parse_rm
    from treadle.trainer.trainers import dpo, kto, rm

    common = ["--actor.model_name_or_path", a.model, "--train.batch_size", "8", "--train.micro_batch_size", "2",
              "--ds.param_dtype", "fp32", "--adam.lr", "1e-3", "--train.max_epochs", "2", "--data.max_samples", "48"]
    pref = ["--data.dataset", f"{a.data}/pref.jsonl", "--data.prompt_key", "prompt"]
    runs = {
        "rm": (rm, parse_rm([*common, *pref, "--ds.zero_stage", "3", "--actor.margin_loss_enable", *_paths(a, "rm")])),
        "dpo": (dpo, parse_dpo([*common, *pref, "--ds.zero_stage", "2", "--ds.packing_samples", *_paths(a, "dpo")])),
        "kto": (kto, parse_kto([*common, "--data.dataset", f"{a.data}/kto.jsonl", "--ds.zero_stage", "1",
                                "--ref.precompute_enable", "--actor.beta", "0.5", *_paths(a, "kto")])),
    }
    out = {}
    for name, (module, cfg) in runs.items():
        trainer = module.build_trainer(cfg)
        trainer.fit()
        trainer.close(plot=name == "rm" and importlib.util.find_spec("matplotlib") is not None)
        out[name] = f"{a.out}/{name}"
    return out


def _paths(a: argparse.Namespace, name: str) -> list[str]:
    return ["--ckpt.path", f"{a.out}/{name}/ckpt", "--ckpt.output_dir", f"{a.out}/{name}/model"]


SCENARIOS = {"grad_split": grad_split, "trajectories": trajectories, "resume": resume, "recipes": recipes}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    a = parser.parse_args()
    from treadle.common.log import setup_logging
    from treadle.trainer.strategy.deepspeed import init_distributed, shutdown_distributed

    setup_logging("WARNING")
    info = init_distributed()
    results = {"world": info.world}
    try:
        for name in a.only.split(","):
            results[name] = SCENARIOS[name](a)
        if info.rank == 0:
            Path(a.out, "results.json").write_text(json.dumps(results, indent=1))
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
