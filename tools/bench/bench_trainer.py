#!/usr/bin/env python3
"""Trainer benchmarks, one torchrun launch, variants interleaved step by step (medians):

1. SFT tokens/s, packed vs padded, on variable-length data: the same samples in the same
   micro-batches (4 per micro-batch, 2 ranks), once right-padded to the longest of the
   micro-batch and once packed into one row (no padding); plus packing with dynamic batches
   (token budget). Tokens counted are real tokens only.
2. Step time of ZeRO-3 vs ZeRO-2 on the same (packed) run.

    OMP_NUM_THREADS=1 PYTHONPATH=packages/common/src:packages/trainer/src \\
        .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tools/bench/bench_trainer.py --model .cache/models/small --steps 8

Data: pre-training rows of 4-320 words (log-uniform), ~5-1000 tokens. Not a pytest benchmark:
each variant is a whole DeepSpeed engine and the CPU is noisy, so only ratios measured in one
run, interleaved, mean anything (PLATFORM.md). Rank 0 prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "an", "were", "are", "which", "this", "be"]


def write_data(folder: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = int(math.exp(rng.uniform(math.log(4), math.log(320))))
        rows.append({"text": " ".join(rng.choice(WORDS) for _ in range(words))})
    path = folder / "text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def argv(a: argparse.Namespace, data: Path, out: Path, name: str, *extra: str) -> list[str]:
    return ["--actor.model_name_or_path", a.model, "--data.dataset", str(data), "--data.input_key", "text",
            "--actor.pretrain_mode_enable", "--data.max_len", "1024", "--train.batch_size", str(a.batch),
            "--train.micro_batch_size", "4", "--ds.param_dtype", a.dtype, "--adam.lr", "1e-4",
            "--ckpt.path", str(out / name / "ckpt"), "--ckpt.output_dir", str(out / name / "model"), *extra]


def interleaved(trainers: dict, steps: int, warmup: int) -> dict[str, list[tuple[float, float]]]:
    """(seconds, tokens) per measured step of each trainer; steps alternate between trainers."""
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in trainers}
    for s in range(warmup + steps):
        for name, t in trainers.items():
            start = time.perf_counter()
            m = t.train_step(0, s)
            if s >= warmup:
                times[name].append((time.perf_counter() - start, m["tokens"]))
    return times


def summary(times: dict[str, list[tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """Median step time, and tokens/s over all measured steps (every variant trains the same
    samples, so the token totals are equal and the ratio is that of the total times)."""
    return {k: {"median_step_s": statistics.median(t for t, _ in v),
                "tokens_per_s": sum(n for _, n in v) / sum(t for t, _ in v)} for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--json", default=".cache/bench_trainer.json")
    a = p.parse_args()
    import torch.distributed as dist

    from treadle.common.log import setup_logging
    from treadle.trainer.config import parse_sft
    from treadle.trainer.strategy.deepspeed import init_distributed, shutdown_distributed
    from treadle.trainer.trainers.sft import build_trainer

    setup_logging("WARNING")
    info = init_distributed()
    tmp = Path(tempfile.mkdtemp(prefix="bench_trainer_")) if info.rank == 0 else None
    shared = [str(tmp)]
    dist.broadcast_object_list(shared, src=0)
    out = Path(shared[0])
    data = out / "text.jsonl"
    if info.rank == 0:
        write_data(out, n=a.batch * (a.warmup + a.steps))
    dist.barrier()
    try:
        pack = {name: build_trainer(parse_sft(argv(a, data, out, name, "--ds.zero_stage", "2", *extra)))
                for name, extra in (("padded", []), ("packed", ["--ds.packing_samples"]),
                                    ("packed_dynamic", ["--ds.packing_samples", "--train.dynamic_batch_enable",
                                                        "--train.max_tokens_per_gpu", "1024"]))}
        packing = summary(interleaved(pack, a.steps, a.warmup))
        del pack
        zero = {name: build_trainer(parse_sft(argv(a, data, out, name, "--ds.zero_stage", stage, "--ds.packing_samples")))
                for name, stage in (("zero2", "2"), ("zero3", "3"))}
        zeros = summary(interleaved(zero, a.steps, a.warmup))
        if info.rank == 0:
            report(a, packing, zeros, info.world)
    finally:
        shutdown_distributed()
    return 0


def report(a: argparse.Namespace, packing: dict, zeros: dict, world: int) -> None:
    base = packing["padded"]["tokens_per_s"]
    print(f"\nSFT, {world} ranks, {a.model}, batch {a.batch}, micro-batch 4, {a.dtype}, {a.steps} steps after {a.warmup} warm-up\n")
    print("| layout | tokens/s | median step | tokens/s vs padded |\n| --- | --- | --- | --- |")
    for k, v in packing.items():
        print(f"| {k} | {v['tokens_per_s']:,.0f} | {v['median_step_s'] * 1000:.0f} ms | {v['tokens_per_s'] / base:.2f}x |")
    z2 = zeros["zero2"]["median_step_s"]
    print("\n| ZeRO stage | median step | vs ZeRO-2 |\n| --- | --- | --- |")
    for k, v in zeros.items():
        print(f"| {k} | {v['median_step_s'] * 1000:.0f} ms | {v['median_step_s'] / z2:.2f}x |")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"packing": packing, "zero": zeros, "world": world, "args": vars(a)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
