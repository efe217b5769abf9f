#!/usr/bin/env python3
"""Ring attention benchmark: SFT tokens/s and peak memory per rank against sequence length,
ring size 1 vs 2, on 2 ranks (gloo on CPU, NCCL with ``--device cuda``).

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_ring_attention.py \\
        --model .cache/models/small --lengths 512,1024,2048,4096 --steps 3 --warmup 1

Both variants train the same 2 sequences of exactly L tokens per optimizer step (pre-training
mode, packed, ZeRO-2, one sequence per micro-batch): ring 1 gives each rank one sequence;
ring 2 gives both sequences to the one ring, each rank holding half of every row. So tokens
per step are equal and tokens/s compares step times. Each (length, ring) runs in a fresh
``torchrun`` launch so that peak memory is that variant's alone; launches alternate ring 1 /
ring 2 per length. Memory per rank: on CPU the process's peak RSS (``ru_maxrss``) and its rise
over the RSS before the first step; on CUDA ``torch.cuda.max_memory_allocated``. Step times
are medians over ``--steps`` after ``--warmup``. The CPU is noisy (PLATFORM.md): compare the
two columns of one run, not runs with each other.

``--kernel`` times the attention alone (no trainer, no DeepSpeed: what the GPU machine runs
without wheels): one sequence of L tokens, forward + backward of the ring kernel on 2 ranks
against SDPA's causal kernel on the whole sequence on one rank, the model's head shapes and
dtype, in one launch; on CUDA also the peak memory of each.

The parent prints a markdown table and writes JSON; ``--worker`` is the per-rank entry.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his",
         "an", "were", "are", "which", "this", "be", "river", "mountain", "language", "model", "station"]


def write_data(path: Path, rows: int, words: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n"
                            for _ in range(rows)))


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(a: argparse.Namespace) -> None:
    """One (length, ring) variant on this rank; rank 0 writes ``a.result``."""
    import torch
    import torch.distributed as dist

    from treadle.common.log import setup_logging
    from treadle.trainer.config import parse_sft
    from treadle.trainer.strategy.deepspeed import init_distributed, shutdown_distributed
    from treadle.trainer.trainers.sft import build_trainer

    setup_logging("WARNING")
    info = init_distributed()
    cuda = info.device.type == "cuda"
    out = Path(a.result).parent
    argv = ["--actor.model_name_or_path", a.model, "--data.dataset", a.data, "--data.input_key", "text",
            "--actor.pretrain_mode_enable", "--data.max_len", str(a.length), "--train.batch_size", "2",
            "--train.micro_batch_size", "1", "--ds.param_dtype", a.dtype, "--ds.zero_stage", "2", "--ds.packing_samples",
            "--ds.ring_attn_size", str(a.ring), "--ds.ring_attn_head_stride", str(a.head_stride), "--adam.lr", "1e-5",
            "--lr_warmup_ratio", "0", "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model")]
    try:
        trainer = build_trainer(parse_sft(argv))
        before = torch.cuda.memory_allocated() if cuda else _rss_bytes()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, tokens = [], 0.0
        for step in range(a.warmup + a.steps):
            start = time.perf_counter()
            metrics = trainer.train_step(0, step)
            if cuda:
                torch.cuda.synchronize()
            if step >= a.warmup:
                times.append(time.perf_counter() - start)
                tokens = metrics["tokens"]
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        per_rank = torch.zeros(info.world, 2, dtype=torch.float64, device=info.device)
        per_rank[info.rank] = torch.tensor([peak, before], dtype=torch.float64)
        dist.all_reduce(per_rank)
        if info.rank == 0:
            Path(a.result).write_text(json.dumps({
                "median_step_s": statistics.median(times), "tokens_per_step": tokens,
                "peak_bytes": per_rank[:, 0].tolist(), "before_bytes": per_rank[:, 1].tolist(), "device": info.device.type}))
    finally:
        shutdown_distributed()


def _timed(fn, repeats: int, cuda: bool) -> float:  # noqa: ANN001
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    import torch

    times = []
    for k in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if k:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kernel_row(length: int, ring, heads: int, heads_kv: int, dim: int, dtype, steps: int) -> dict:  # noqa: ANN001
    """One length: (ring fwd + bwd on this rank's slots, SDPA fwd + bwd on the whole sequence), seconds and peaks."""
    import torch

    from treadle.trainer.data.batching import pack_batch
    from treadle.trainer.data.samples import Sample, TokenSeq
    from treadle.trainer.ring.attention import ring_attention
    from treadle.trainer.ring.shard import shard_batch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"

    def make(n: int, h: int) -> torch.Tensor:
        return torch.randn(h, n, dim, device=device, dtype=dtype, requires_grad=True)

    def peak() -> int:
        return torch.cuda.max_memory_allocated() if cuda else 0

    batch = pack_batch([Sample(seqs=(TokenSeq.of([1] * length, [True] * length),), index=0)]).to(device)
    shard = shard_batch(batch, ring)
    n = shard.layout.local_length
    qkv = [make(n, heads), make(n, heads_kv), make(n, heads_kv)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ring_s = _timed(lambda: ring_attention(*qkv, shard, dim ** -0.5).sum().backward(), steps, cuda)
    ring_peak = peak()
    qkv[:] = [make(length, heads)[None] for _ in range(3)]  # the ring's tensors go: the full sequence's take their place
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    full_s = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True).sum().backward(),
                    steps, cuda)
    return {"length": length, "ring_s": ring_s, "full_s": full_s, "ring_peak": ring_peak, "full_peak": peak()}


def kernel_worker(a: argparse.Namespace) -> None:
    """Ring kernel (2 ranks) vs SDPA on the whole sequence, fwd + bwd, per length; rank 0 writes ``a.result``."""
    import torch
    import torch.distributed as dist

    from treadle.trainer.models.loading import DTYPES
    from treadle.trainer.ring.group import setup_ring
    from treadle.trainer.strategy.deepspeed import DistInfo

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = json.loads(Path(a.model, "config.json").read_text())
    heads, heads_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ring = setup_ring(2, a.head_stride, DistInfo(rank=rank, world=2, local_rank=rank, device=device))
    rows = [_kernel_row(int(n), ring, heads, heads_kv, cfg["hidden_size"] // heads, DTYPES[a.dtype], a.steps)
            for n in a.lengths.split(",")]
    if rank == 0:
        Path(a.result).write_text(json.dumps({"device": device.type, "kind": ring.backend, "rows": rows}))
    dist.destroy_process_group()


def kernel_report(a: argparse.Namespace, res: dict) -> str:
    lines = [f"Attention only ({res['device']}, ring backend {res['kind']}, {a.dtype}), fwd + bwd of one causal "
             f"sequence: ring of 2 ranks vs SDPA on the whole sequence on one rank; median of {a.steps}", "",
             "| L | SDPA, 1 rank | ring, 2 ranks | SDPA / ring | SDPA peak | ring peak / rank |",
             "| --- | --- | --- | --- | --- | --- |"]
    def mib(b: float) -> str:
        return f"{b / 2**20:,.0f} MiB" if res["device"] == "cuda" else "n/a"

    for r in res["rows"]:
        lines.append(f"| {r['length']:,} | {r['full_s'] * 1e3:,.1f} ms | {r['ring_s'] * 1e3:,.1f} ms | "
                     f"{r['full_s'] / r['ring_s']:.2f}x | {mib(r['full_peak'])} | {mib(r['ring_peak'])} |")
    return "\n".join(lines)


def launch(a: argparse.Namespace, data: Path, length: int, ring: int, folder: Path) -> dict:
    """One fresh 2-rank torchrun of ``worker``; returns its result."""
    result = folder / f"L{length}_R{ring}" / "result.json"
    result.parent.mkdir(parents=True)
    script = [str(Path(__file__).resolve())]
    if importlib.util.find_spec("datasets") is None:  # the GPU machine reads jsonl without HF datasets
        script = [str(ROOT / "packages" / "trainer" / "tests" / "gpu_run.py"), *script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script, "--worker",
           "--model", a.model, "--data", str(data), "--length", str(length), "--ring", str(ring), "--dtype", a.dtype,
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--head_stride", str(a.head_stride), "--result", str(result),
           "--lengths", a.lengths, *(["--kernel"] if a.kernel else [])]
    src = os.pathsep.join([*(str(ROOT / "packages" / p / "src") for p in ("common", "rollout", "rewards", "agents", "trainer")),
                           *filter(None, [os.environ.get("PYTHONPATH")])])  # carried wheels on the GPU machine
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    for attempt in (1, 2):  # a launch that crashes (it happened once in the ring-less baseline) gets one retry
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode == 0:
            return json.loads(result.read_text())
        if "out of memory" in proc.stderr.lower():  # a finding (this length does not fit), not a crash
            line = next((ln for ln in proc.stderr.splitlines() if "out of memory" in ln.lower()), "")
            return {"oom": True, "error": line.strip()[-400:]}
        print(f"L={length} ring={ring} attempt {attempt} failed:\n{proc.stderr[-2000:]}", file=sys.stderr, flush=True)
    raise SystemExit(f"L={length} ring={ring} failed twice")


def report(a: argparse.Namespace, runs: dict[int, dict[int, dict]]) -> str:
    lines = [f"SFT on 2 ranks ({a.device}), {a.model}, {a.dtype}, 2 sequences of L tokens per step, "
             f"{a.head_stride} key/value heads per ring pass, median of {a.steps} steps after {a.warmup} warm-up",
             "", "| L | ring 1 tokens/s | ring 2 tokens/s | ring 2 / ring 1 | ring 1 peak / rank | ring 2 peak / rank "
             "| ring 1 rise / rank | ring 2 rise / rank |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for length, by_ring in runs.items():
        cells = {r: _cells(v) for r, v in by_ring.items()}
        ratio = (f"{cells[2][3] / cells[1][3]:.2f}x" if all(r in cells and cells[r][3] for r in (1, 2)) else "-")
        c1, c2 = cells.get(1, ("-",) * 4), cells.get(2, ("-",) * 4)
        lines.append(f"| {length:,} | {c1[0]} | {c2[0]} | {ratio} | {c1[1]} | {c2[1]} | {c1[2]} | {c2[2]} |")
    return "\n".join(lines)


def _cells(v: dict) -> tuple[str, str, str, float]:
    """(tokens/s, peak / rank, rise / rank, tokens/s as a number) of one launch's result; an
    out-of-memory launch reads "out of memory"."""
    if v.get("oom"):
        return ("out of memory", "out of memory", "-", 0.0)
    mib = 1 << 20
    tps = v["tokens_per_step"] / v["median_step_s"]
    peak = max(v["peak_bytes"]) / mib
    rise = max(p - b for p, b in zip(v["peak_bytes"], v["before_bytes"], strict=True)) / mib
    return (f"{tps:,.0f}", f"{peak:,.0f} MiB", f"{rise:,.0f} MiB", tps)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / ".cache" / "models" / "small"))
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default=None, help="fp32 on CPU, bf16 on CUDA unless given")
    p.add_argument("--head_stride", type=int, default=None,
                   help="key/value heads per ring pass; default all of the model's (one pass per layer)")
    p.add_argument("--json", default=str(ROOT / ".cache" / "bench_ring_attention.json"))
    p.add_argument("--kernel", action="store_true", help="time the attention kernels alone (no trainer)")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--data", default="")
    p.add_argument("--length", type=int, default=0)
    p.add_argument("--ring", type=int, default=1)
    p.add_argument("--result", default="")
    a = p.parse_args()
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    if a.head_stride is None:
        a.head_stride = json.loads(Path(a.model, "config.json").read_text())["num_key_value_heads"]
    if a.worker:
        (kernel_worker if a.kernel else worker)(a)
        return 0
    folder = Path(tempfile.mkdtemp(prefix="bench_ring_"))
    if a.kernel:
        res = launch(a, folder / "none", 0, 2, folder)
        print(kernel_report(a, res))
        Path(a.json).write_text(json.dumps({"args": vars(a), "kernel": res}, indent=1))
        return 0
    runs: dict[int, dict[int, dict]] = {}
    for length in (int(x) for x in a.lengths.split(",")):
        data = folder / f"text_{length}.jsonl"
        write_data(data, rows=2 * (a.warmup + a.steps), words=length)  # >= 1 token per word: rows are cut to L
        runs[length] = {ring: launch(a, data, length, ring, folder) for ring in (1, 2)}
        print(f"L={length}: " + ", ".join(f"ring {r}: " + ("out of memory" if v.get("oom") else
                                                      f"{v['median_step_s']:.2f} s/step") for r, v in runs[length].items()),
              flush=True)
    table = report(a, runs)
    print("\n" + table)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
