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
- ``recipes``: RM (ZeRO-3, margin, W&B offline), DPO (ZeRO-3, packed, ZeRO-3 reference on the fly), KTO
  (ZeRO-1, precomputed reference) losses over two epochs, and their exported models.
- ``reference_zero3``: the replicated reference vs the ZeRO-3-sharded one (and its
  parameter-offloaded variant) on batches that differ per rank, the parameters each rank keeps,
  and a precomputed reference table whose per-rank batch counts differ (ZeRO-3 lockstep).
- ``tokenise_once``: which ranks run the tokenizer when a run builds its datasets (first, and
  again with the cache present), whether the ranks' samples agree, and what each rank raises
  when the data has a malformed row.
- ``autotp``: SFT steps with AutoTP (``--ds.tensor_parallel_size 2``) vs without: losses,
  gradient norms, the shard each rank holds, the exported weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"  # a fake key: offline runs never check it


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
    wandb = ["--logger.wandb.key", WANDB_KEY, "--logger.wandb.project", "treadle-test", "--logger.wandb.group", "g1",
             "--logger.wandb.run_name", "rm-offline"]
    for name, folder in (("WANDB_MODE", None), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                         ("WANDB_DATA_DIR", "data")):  # no network here; keep wandb's files in the test folder
        os.environ[name] = "offline" if folder is None else f"{a.out}/wandb_home/{folder}"
    runs = {
        "rm": (rm, parse_rm([*common, *pref, "--ds.zero_stage", "3", "--actor.margin_loss_enable", *wandb,
                             *_paths(a, "rm")])),
        "dpo": (dpo, parse_dpo([*common, *pref, "--ds.zero_stage", "3", "--ds.packing_samples", *_paths(a, "dpo")])),
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


def _rank_samples(seed: int, n: int, lo: int = 3, hi: int = 40) -> list:
    from treadle.trainer.data.samples import Sample, TokenSeq

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(Sample(seqs=(TokenSeq.of(torch.randint(3, 500, (length,), generator=g).tolist(), [True] * length),),
                          index=i))
    return out


def _device() -> torch.device:
    from treadle.trainer.strategy.deepspeed import init_distributed

    return init_distributed().device  # collectives on the backend's device (NCCL: CUDA tensors)


def _max_over_ranks(value: float) -> float:
    from treadle.trainer.strategy.deepspeed import all_reduce

    return all_reduce([value], _device(), op="max")[0]


def _per_rank(value: float) -> list:
    """Every rank's ``value`` (exact for integers below 2**53), in rank order."""
    from treadle.trainer.strategy.deepspeed import all_reduce

    values = [0.0] * dist.get_world_size()
    values[dist.get_rank()] = float(value)
    return [int(v) if float(v).is_integer() else v for v in all_reduce(values, _device())]


def reference_zero3(a: argparse.Namespace) -> dict:
    """The replicated reference vs the ZeRO-3 one (plain and parameter-offloaded) on batches that
    differ per rank; what each rank holds; a precomputed table whose batch counts differ per rank."""
    import functools

    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.data.batching import local_batches, pad_batch
    from treadle.trainer.strategy.deepspeed import init_distributed
    from treadle.trainer.trainers import build
    from treadle.trainer.trainers.ref_logps import RefLogps

    info = init_distributed()
    rep = build.reference(a.model, DeepSpeedConfig(param_dtype="fp32", zero_stage=2), info, offload=False)
    z3 = DeepSpeedConfig(param_dtype="fp32", zero_stage=3)
    sharded = {"sharded": build.reference(a.model, z3, info, offload=False),
               "offloaded": build.reference(a.model, z3, info, offload=True)}
    mine = _rank_samples(info.rank, 6)
    out: dict = {"max_diff": {}}
    for name, ref in sharded.items():
        diff = 0.0
        for k in range(0, len(mine), 2):
            batch = pad_batch(mine[k:k + 2], pad_id=0).to(info.device)
            diff = max(diff, (ref.logprobs(batch) - rep.logprobs(batch)).abs().max().item())
        out["max_diff"][name] = _max_over_ranks(diff)
    params = list(sharded["sharded"].module.module.parameters())
    out["full_numel"] = sum(p.ds_numel for p in params)
    out["resident_numel"] = _per_rank(sum(p.ds_tensor.numel() + p.data.numel() for p in params))
    out["offload_device"] = str(sharded["offloaded"].module.zero_offload_param().device)
    samples = _rank_samples(7, 13)  # the same 13 samples on both ranks: 7 and 6 (+ 1 filler) per rank
    batches = functools.partial(local_batches, micro_batch=4, token_budget=60, packing=True, pad_id=0)
    out["unequal_batches"] = _per_rank(len(batches(samples[info.rank::2])))
    tables = {name: RefLogps.precompute(ref, {"train": samples}, info, batches).tables["train"]
              for name, ref in (("replica", rep), ("sharded", sharded["sharded"]))}
    out["precompute_max_diff"] = (tables["replica"] - tables["sharded"]).abs().max().item()
    out["precompute_nonzero"] = int((tables["replica"] != 0).sum())
    for ref in sharded.values():
        ref.close()
    return out


def _digest(samples: list) -> int:
    import hashlib

    h = hashlib.sha256()
    for smp in samples:
        h.update(f"{smp.index},{smp.margin},{smp.desirable}".encode())
        for q in smp.seqs:
            h.update(q.ids.astype("int64").tobytes() + q.target.tobytes())
    return int.from_bytes(h.digest()[:6], "little")


def tokenise_once(a: argparse.Namespace) -> dict:
    """Who tokenises: the first build (rank 0 only), a second one (nobody: the cache is reused),
    and a build on malformed data (an error on every rank, none left waiting)."""
    from treadle.trainer.config import parse_sft
    from treadle.trainer.data.formatting import sft_samples
    from treadle.trainer.strategy.deepspeed import init_distributed
    from treadle.trainer.trainers import build

    info = init_distributed()
    calls = []

    def run(data: str, name: str) -> tuple[list, list]:
        cfg = parse_sft(sft_argv(a, name, "--data.dataset", data, "--eval.dataset", f"{a.data}/sft.jsonl"))
        tok, fmt = build.tokenizer_and_formatter(cfg)

        def tokenise(rows: list) -> tuple:
            calls.append(len(rows))
            return sft_samples(rows, fmt, input_key="question", output_key="response", multiturn=False,
                               pretrain=False, max_len=cfg.data.max_len)

        return build.datasets(cfg, tokenise, info, tok)

    train, evaluation = run(f"{a.data}/sft.jsonl", "tok")
    out = {"first_calls": _per_rank(len(calls)), "digest": _per_rank(_digest(train) ^ _digest(evaluation)),
           "sizes": [len(train), len(evaluation)],
           "cache_files": sorted(p.name for p in Path(a.out, "tok", "ckpt", "data_cache").iterdir())}
    calls.clear()
    again = run(f"{a.data}/sft.jsonl", "tok")
    out["second_calls"] = _per_rank(len(calls))
    out["second_same"] = _digest(again[0]) == _digest(train)
    bad = Path(a.out, "bad.jsonl")
    if info.rank == 0:
        bad.write_text('{"question": "repeat fox", "response": "fox"}\n{"question": "repeat echo"}\n')
    dist.barrier()
    try:
        run(str(bad), "tok_bad")
        out_error = ""
    except Exception as e:  # noqa: BLE001
        out_error = f"{type(e).__name__}: {e}"
    raw = out_error.encode()[:400]
    codes = [0.0] * 800  # both ranks' messages as byte values, summed into place (no pickle)
    codes[info.rank * 400: info.rank * 400 + len(raw)] = list(map(float, raw))
    from treadle.trainer.strategy.deepspeed import all_reduce

    summed = bytes(int(c) for c in all_reduce(codes, info.device))
    out["errors"] = [summed[r * 400:(r + 1) * 400].rstrip(b"\0").decode() for r in range(2)]
    return out


def autotp(a: argparse.Namespace, steps: int = 4) -> dict:
    """SFT (ZeRO-2) with --ds.tensor_parallel_size 1 and 2: per-step losses and gradient norms,
    the rows of one MLP weight each rank holds, and the exported weights."""
    from safetensors.torch import load_file

    from treadle.trainer.config import parse_sft
    from treadle.trainer.trainers.sft import build_trainer

    out: dict = {"losses": {}, "grad_norms": {}, "rows": {}}
    for tp in (1, 2):
        trainer = build_trainer(parse_sft(sft_argv(a, f"tp{tp}", "--ds.zero_stage", "2",
                                                   "--ds.tensor_parallel_size", str(tp))))
        metrics = [trainer.train_step(0, s) for s in range(steps)]
        out["losses"][tp] = [m["loss"] for m in metrics]
        out["grad_norms"][tp] = [m["grad_norm"] for m in metrics]
        weight = dict(trainer.engine.module.named_parameters())["model.layers.0.mlp.up_proj.weight"]
        out["rows"][tp] = _per_rank(weight.shape[0])
        trainer.export(Path(a.out, f"tp{tp}", "model"))
    if dist.get_rank() == 0:
        one, two = (load_file(str(Path(a.out, f"tp{tp}", "model", "model.safetensors"))) for tp in (1, 2))
        out["export_keys_equal"] = one.keys() == two.keys()
        out["export_max_diff"] = max((one[k] - two[k]).abs().max().item() for k in one)
    return out


SCENARIOS = {"grad_split": grad_split, "trajectories": trajectories, "resume": resume, "recipes": recipes,
             "reference_zero3": reference_zero3, "tokenise_once": tokenise_once, "autotp": autotp}


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
