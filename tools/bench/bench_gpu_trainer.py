#!/usr/bin/env python3
"""Benchmark (issue 10): treadle's SFT step and PPO actor step under ZeRO-3 on 2 GPUs, with packing:
tokens/s/GPU and MFU, DeepSpeed's default settings against the tuned ones.

One *variant* runs under ``torchrun`` (one process per GPU) and builds everything from treadle's
own pieces: a Qwen2-shaped model made from a config (random init, seed 0, no download) and saved
once, loaded with ``models.loading.load_causal_lm``; the engine from ``strategy.deepspeed.build_engine``
and a ``DeepSpeedConfig``; then

* SFT: ``--micro-batch`` sequences of ``--seq`` random tokens per rank, packed into one row
  (``data.batching.pack_batch``), ``models.actor.Actor`` on the engine, ``losses.sft.nll_loss``,
  one micro-batch per optimizer step, as ``trainers.base`` does it;
* PPO: ``rl.update.actor_step`` on as many synthetic ``Experience`` records per rank (a
  ``Trajectory`` of ``--seq / 4`` prompt and ``3 --seq / 4`` response tokens, random advantages,
  strictly on-policy), packed, PPO clip loss, token mean, entropy computed (as the trainer does).

Each is ``--warmup`` untimed steps (compilation happens there), then ``--steps`` timed steps
(CUDA synchronised around each; medians reported), then for SFT one more step with a
synchronisation after the forward and after the backward, to split the step's time. The row is
the same every step, unless ``--varied``: then every step packs a new mix of sequence lengths
(around ``--seq``) into a row of 92-100% of ``--micro-batch x --seq`` tokens, as real batches
do; compiled layers then see changing shapes (dynamo turns them dynamic after the first change).

MFU = 6 * N * (tokens/s per GPU) / 989e12 (dense bf16 peak of one H200/H100 SXM), N = every
parameter (embeddings and LM head included), attention score FLOPs left out; ``mfu_attn`` adds
them: + 6 * layers * hidden * seq per token (causal, forward + backward, within each sequence).

Variants (``VARIANTS``): ``baseline`` is what treadle emitted before the tuning (DeepSpeed's own
ZeRO-3 bucket defaults, no overlap, transformers' SDPA attention on packed rows, no compile);
``tuned`` is overlap_comm + the new bucket defaults + ``treadle_varlen`` attention (its fastest
kernel: FlashAttention-4 where flash-attn-4 is installed) + ``--ds.compile_layers``; the others
take one piece away to show what each is worth (``tuned_fa2``: PyTorch's varlen FA2 instead);
``defaults`` sets nothing but ZeRO-3 and packing (overlap_comm and compiled layers are treadle's
defaults on CUDA now, the attention is chosen by ``models.loading``).

``--sweep size:variant,...`` runs variants one after another, each its own ``torchrun`` (a
ZeRO-3 engine does not give its memory back inside a process), within ``--deadline-s``;
results go to ``--json`` (one JSON object per line, failures included) and the children's
output to ``--log``. ``--cpu`` is the dry run: tiny shape, fp32, gloo, same code paths.

    NCCL_NVLS_ENABLE=0 python3 tools/bench/bench_gpu_trainer.py --sweep 1.35b:tuned,1.35b:baseline \\
        --json bench_gpu_trainer.json --log bench_gpu_trainer.log
    python3 tools/bench/bench_gpu_trainer.py --cpu --sweep tiny:tuned,tiny:baseline --json /tmp/b.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

PEAK_FLOPS = 989e12
SHAPES: dict[str, dict[str, Any]] = {
    "1.35b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False),
    "0.47b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
_DS_DEFAULTS = dict(zero3_prefetch_bucket_size=50_000_000, zero3_param_persistence_threshold=100_000)
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": dict(ds=dict(overlap_comm=False, compile_layers=False, **_DS_DEFAULTS), attn="sdpa"),
    # treadle's defaults as they are (nothing set but ZeRO-3 and packing): should equal tuned
    "defaults": dict(ds=dict(), attn=None),
    "tuned": dict(ds=dict(overlap_comm=True, compile_layers=True), attn="treadle_varlen"),
    # tuned, with PyTorch's varlen FlashAttention-2 even where flash-attn-4 is installed
    "tuned_fa2": dict(ds=dict(overlap_comm=True, compile_layers=True, varlen_kernel="flash_varlen"), attn="treadle_varlen"),
    "tuned_eager": dict(ds=dict(overlap_comm=True, compile_layers=False), attn="treadle_varlen"),
    "tuned_sdpa": dict(ds=dict(overlap_comm=True, compile_layers=False), attn="sdpa"),
    "ds_tuned_only": dict(ds=dict(overlap_comm=True, compile_layers=True), attn="sdpa"),
    "tuned_flex": dict(ds=dict(overlap_comm=True, compile_layers=True), attn="flex_attention"),
    # tuned_eager with Liger's RoPE, RMSNorm and SwiGLU kernels (--ds.use_liger_kernel; issue 33); with
    # compiled layers it crashed on an H200 and is refused (docs/benchmarks.md, "Liger's kernels")
    "eager_liger": dict(ds=dict(overlap_comm=True, compile_layers=False, use_liger_kernel=True), attn="treadle_varlen"),
    # tuned, and every parameter gathered by the forward kept for the backward (no second gather)
    "tuned_keep": dict(ds=dict(overlap_comm=True, compile_layers=True, zero3_max_live_parameters=10**11,
                               zero3_max_reuse_distance=10**11), attn="treadle_varlen"),
}


# -- one variant, on every rank ---------------------------------------------------------------


def _model_dir(root: Path, size: str, dtype: Any, device: Any) -> Path:
    """Rank 0 writes the random model of ``size`` once (built on ``device``); every rank waits."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: PLC0415

    path = root / size
    if torch.distributed.get_rank() == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = Qwen2Config(**SHAPES[size], max_position_embeddings=8192, use_cache=False)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        tmp = root / f".{size}.tmp{os.getpid()}"
        model.save_pretrained(tmp)
        tmp.rename(path)
        del model
    torch.distributed.barrier()
    return path


def _lengths(rng: Any, mb: int, seq: int, varied: bool) -> list[int]:
    """Sequence lengths of one packed row: ``mb`` x ``seq``, or (``varied``, as real batches are)
    a new mix every row: lengths drawn around ``seq`` (1/8 to 15/8 of it) up to 92-100% of
    ``mb * seq`` tokens, so both the row's length and its sequences change from step to step."""
    if not varied:
        return [seq] * mb
    total, lengths = int(mb * seq * rng.uniform(0.92, 1.0)), []
    while total - sum(lengths) >= 16:
        lengths.append(min(int(rng.integers(seq // 8, 2 * seq - seq // 8)), total - sum(lengths)))
    return lengths


def _sft_batch(rng: Any, lengths: list[int], vocab: int) -> Any:
    import numpy as np  # noqa: PLC0415

    from treadle.trainer.data.batching import pack_batch  # noqa: PLC0415
    from treadle.trainer.data.samples import Sample, TokenSeq  # noqa: PLC0415

    samples = []
    for k, n in enumerate(lengths):
        target = np.ones(n, dtype=bool)
        target[0] = False
        samples.append(Sample(seqs=(TokenSeq(ids=rng.integers(0, vocab, n), target=target),), index=k))
    return pack_batch(samples)


def _experiences(rng: Any, lengths: list[int], vocab: int) -> list[Any]:
    import numpy as np  # noqa: PLC0415

    from treadle.common.records import Trajectory  # noqa: PLC0415
    from treadle.trainer.rl.experience import from_trajectory  # noqa: PLC0415

    exps = []
    for n in lengths:
        prompt, response = n // 4, n - n // 4
        traj = Trajectory(prompt_token_ids=rng.integers(0, vocab, prompt).astype(np.int32),
                          response_token_ids=rng.integers(0, vocab, response).astype(np.int32),
                          rollout_logprobs=-rng.random(response, dtype=np.float32),
                          loss_mask=np.ones(response, dtype=np.uint8), reward=float(rng.random()))
        e = from_trajectory(traj)
        e.arrays["advantages"] = rng.standard_normal(e.num_actions).astype(np.float32)
        e.arrays["is_weights"] = np.ones(e.num_actions, dtype=np.float32)
        exps.append(e)
    return exps


def _timed(fn: Any, sync: Any) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


PHASE = "treadle_phase/"
"""Prefix of the profiler ranges ``_sft_step(mark=True)`` puts around its phases."""


def _sft_step(engine: Any, batch: Any, world: int, device: Any, sync: Any = None, mark: bool = False) -> dict[str, float]:
    """One SFT optimizer step (``trainers.base.train_step``'s inner loop, one micro-batch);
    with ``sync``, the seconds of forward / backward / optimizer step; with ``mark``, each phase
    is a profiler range (``PHASE`` + its name)."""
    from torch.profiler import record_function  # noqa: PLC0415

    from treadle.trainer.losses.sft import nll_loss  # noqa: PLC0415
    from treadle.trainer.models.actor import Actor  # noqa: PLC0415
    from treadle.trainer.strategy.deepspeed import all_reduce  # noqa: PLC0415

    def phase(name: str) -> Any:
        return record_function(PHASE + name) if mark else contextlib.nullcontext()

    split: dict[str, float] = {}
    t0 = time.perf_counter()
    with phase("forward"):
        batch = batch.to(device)
        normaliser = all_reduce([float(batch.target_mask.sum())], device)[0]
        engine.train()
        engine.set_gradient_accumulation_boundary(True)
        loss = nll_loss(Actor(engine)(batch, targets_only=True).logprobs, batch.target_mask, normaliser)
        if sync:
            sync()
    split["forward_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    with phase("backward"):
        engine.backward(loss * world, scale_wrt_gas=False)
        if sync:
            sync()
    split["backward_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    with phase("optimizer"):
        engine.step()
        if sync:
            sync()
    split["optimizer_s"] = time.perf_counter() - t0
    return split if sync else {}


def covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time some kernel ran."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _ppo_step(engine: Any, exps: list[Any], world: int, device: Any, mb: int) -> None:
    from treadle.trainer.rl.update import Batching, PolicyLoss, actor_step  # noqa: PLC0415

    b = Batching(micro_batch=mb, token_budget=None, packing=True, pad_id=0, device=device)
    loss = PolicyLoss(kind="ppo", clip_low=0.2, clip_high=0.28, dual_clip=None, entropy_coef=0.0,
                      aggregation="token-mean", kl_coef=0.0, kl_estimator="k3", temperature=1.0)
    actor_step(engine, exps, b, loss, world)


def _build(args: argparse.Namespace, dist: Any) -> tuple[Any, int, Any]:
    import torch  # noqa: PLC0415

    from treadle.trainer.config.deepspeed import DeepSpeedConfig  # noqa: PLC0415
    from treadle.trainer.config.optim import OptimizerConfig  # noqa: PLC0415
    from treadle.trainer.models.loading import load_causal_lm  # noqa: PLC0415
    from treadle.trainer.ops.varlen_attention import register  # noqa: PLC0415
    from treadle.trainer.strategy.deepspeed import build_engine, compiles_layers  # noqa: PLC0415

    spec = VARIANTS[args.variant]
    dtype = "fp32" if args.cpu else "bf16"
    if spec["attn"] == "treadle_varlen":
        register()
    ds = DeepSpeedConfig(zero_stage=3, param_dtype=dtype, attn_implementation=spec["attn"], packing_samples=True,
                         **spec["ds"])
    path = _model_dir(Path(args.model_root), args.size, torch.float32 if args.cpu else torch.bfloat16, dist.device)
    model = load_causal_lm(str(path), ds, trainable=True, gradient_checkpointing=args.checkpointing)
    params = sum(p.numel() for p in model.parameters())
    # what the defaults resolve to, for the record
    resolved = replace(ds, attn_implementation=model.config._attn_implementation,
                       compile_layers=compiles_layers(ds, dist.device.type, model))
    engine = build_engine(model, ds, OptimizerConfig(), micro_batch=args.micro_batch, grad_accum=1,
                          world=dist.world, total_steps=10_000)
    return engine, params, replace(resolved, overlap_comm=engine.zero_overlap_comm())


def _measure(args: argparse.Namespace, name: str, step: Any, rows: list[list[int]], sync: Any,
             params: int) -> dict[str, Any]:
    """``step(i)`` runs step i on the row of sequence lengths ``rows[i]`` (``--warmup`` untimed
    steps first): the median step time, and the medians of tokens/s and MFU over the timed steps
    (attention FLOPs: 6 x layers x hidden x the sum of squared sequence lengths)."""
    shape = SHAPES[args.size]
    for i in range(args.warmup):
        step(i)
    times = [_timed(lambda i=i: step(i), sync) for i in range(args.warmup, args.warmup + args.steps)]
    timed = rows[args.warmup:]
    tokens = [sum(r) for r in timed]
    attn = [6 * shape["num_hidden_layers"] * shape["hidden_size"] * sum(n * n for n in r) for r in timed]
    return {f"{name}_step_s": statistics.median(times), f"{name}_step_s_all": times,
            f"{name}_tokens_per_s_gpu": statistics.median(n / t for n, t in zip(tokens, times, strict=True)),
            f"{name}_mfu": statistics.median(6 * params * n / t / PEAK_FLOPS for n, t in zip(tokens, times, strict=True)),
            f"{name}_mfu_attn": statistics.median((6 * params * n + a) / t / PEAK_FLOPS
                                                  for n, a, t in zip(tokens, attn, times, strict=True))}


def run_variant(args: argparse.Namespace) -> None:
    """Everything for one (size, variant), on every rank; rank 0 appends the JSON line."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from treadle.trainer.strategy.deepspeed import init_distributed, shutdown_distributed  # noqa: PLC0415

    dist = init_distributed()
    cuda = dist.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_start = time.perf_counter()
    try:
        engine, params, ds = _build(args, dist)
        shape, mb, seq = SHAPES[args.size], args.micro_batch, args.seq
        rng = np.random.default_rng(1000 + dist.rank)
        out: dict[str, Any] = {"size": args.size, "variant": args.variant, "params": params, "world": dist.world,
                               "micro_batch": mb, "seq": seq, "tokens_per_gpu_step": mb * seq,
                               "varied": args.varied,
                               "attn": ds.attn_implementation, "overlap_comm": ds.overlap_comm,
                               "compile_layers": ds.compile_layers,
                               "prefetch_bucket": ds.zero3_prefetch_bucket_size,
                               "persistence_threshold": ds.zero3_param_persistence_threshold,
                               "checkpointing": args.checkpointing, "build_s": time.perf_counter() - t_start}
        # one row per step; the same row every step unless --varied
        rows = [_lengths(rng, mb, seq, args.varied) for _ in range(args.warmup + args.steps)]
        batches = [_sft_batch(rng, r, shape["vocab_size"]) for r in (rows if args.varied else rows[:1])]
        out.update(_measure(args, "sft", lambda i: _sft_step(engine, batches[i % len(batches)], dist.world,
                                                             dist.device), rows, sync, params))
        batch = batches[-1]
        out.update(_sft_step(engine, batch, dist.world, dist.device, sync=sync))
        exps = [_experiences(rng, r, shape["vocab_size"]) for r in (rows if args.varied else rows[:1])]
        out.update(_measure(args, "ppo", lambda i: _ppo_step(engine, exps[i % len(exps)], dist.world, dist.device,
                                                             len(exps[i % len(exps)])), rows, sync, params))
        if ds.attn_implementation == "treadle_varlen":
            from treadle.trainer.ops.varlen_attention import kernel_name  # noqa: PLC0415

            head_dim = shape["hidden_size"] // shape["num_attention_heads"]
            out["attn_kernel"] = kernel_name(torch.empty(1, 1, head_dim, dtype=torch.bfloat16 if cuda else torch.float32,
                                                         device=dist.device))
        if cuda:
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if args.profile:
            out["profile"] = _profile(lambda: _sft_step(engine, batch, dist.world, dist.device, sync=sync, mark=True),
                                      sync)
        out["unique_graphs"] = _compiled_graphs()
        out["total_s"] = time.perf_counter() - t_start
        if dist.is_main:
            print("RESULT " + json.dumps(out), flush=True)
            with open(args.json, "a") as f:
                f.write(json.dumps(out) + "\n")
    finally:
        shutdown_distributed()


KERNEL_KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "attention")),
                ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "wgmma")), ("optimizer", ("adam", "foreach")),
                ("copy", ("memcpy", "memset", "copy", "cat", "fill")))
"""Kernel-name substrings -> the kind a profile sums them under (first match; else "elementwise/other")."""


def _kind(kernel: str) -> str:
    name = kernel.lower()
    return next((k for k, subs in KERNEL_KINDS if any(x in name for x in subs)), "elementwise/other")


def _profile(step: Any, sync: Any) -> dict[str, Any]:
    """One more SFT step (``step()``, its phases marked: ``_sft_step(mark=True)``) under
    torch.profiler: GPU kernel seconds by kind (``KERNEL_KINDS``; NCCL kernels run on their own
    stream, overlapping the others), the step's wall time; per phase its wall time, the time the
    GPU ran some kernel (``covered``) and kernel seconds by kind; the 12 costliest kernels and
    the 20 operators whose kernels took the most GPU time."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    kinds: dict[str, float] = {}
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0
               and not e.key.startswith(PHASE)]  # the ranges' GPU-side annotations are no kernels
    for e in kernels:
        kind = _kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e6
    events = prof.events()
    runs = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type.name == "CUDA" and not e.name.startswith(PHASE)]
    phases = {}
    for e in events:
        if e.device_type.name == "CPU" and e.name.startswith(PHASE):
            a, b = e.time_range.start, e.time_range.end
            inside = [(s, t, n) for s, t, n in runs if a <= s < b]
            by_kind: dict[str, float] = {}
            for s, t, n in inside:
                by_kind[_kind(n)] = by_kind.get(_kind(n), 0.0) + (t - s) / 1e6
            phases[e.name[len(PHASE):]] = {"wall_s": (b - a) / 1e6, "gpu_busy_s": covered([(s, t) for s, t, _ in inside]) / 1e6,
                                           "kernels": len(inside), "kernel_s_by_kind": by_kind}
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    # which operators launched the GPU time (a templated kernel name says little: elementwise
    # and copy kernels are one name for many operators)
    ops = sorted((e for e in prof.key_averages() if e.device_type.name == "CPU" and e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)[:20]
    return {"wall_s": wall, "kernel_s_by_kind": kinds, "phases": phases,
            "compute_kernel_s": sum(v for k, v in kinds.items() if k != "nccl"),
            "top": [[e.key[:90], e.self_device_time_total / 1e6, e.count] for e in top],
            "top_ops": [[e.key[:90], e.self_device_time_total / 1e6, e.count] for e in ops]}


def _compiled_graphs() -> int:
    """Graphs dynamo compiled in this process (recompiles show here)."""
    try:
        from torch._dynamo.utils import counters  # noqa: PLC0415
    except ImportError:
        return -1
    return int(counters["stats"]["unique_graphs"])


# -- the sweep: one torchrun per variant ------------------------------------------------------------


def _child_cmd(args: argparse.Namespace, item: str) -> list[str]:
    """torchrun for one ``size:variant[:micro_batch[:warmup:steps]]`` (omitted parts: the flags')."""
    size, variant, *rest = item.split(":")
    mb, warmup, steps = [*rest, *[str(v) for v in (args.micro_batch, args.warmup, args.steps)][len(rest):]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--size", size, "--variant", variant, "--micro-batch", mb,
           "--seq", str(args.seq), "--warmup", warmup, "--steps", steps,
           "--json", args.json, "--model-root", args.model_root]
    flags = [f for f, on in (("--cpu", args.cpu), ("--checkpointing", args.checkpointing), ("--profile", args.profile),
                             ("--varied", args.varied)) if on]
    return cmd + flags


def sweep(args: argparse.Namespace) -> None:
    """Run each ``size:variant[:micro_batch[:warmup:steps]]`` of ``--sweep`` in turn until
    ``--deadline-s``; record failures."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    end = time.monotonic() + args.deadline_s
    log = open(args.log, "a") if args.log else sys.stdout  # noqa: SIM115
    for item in args.sweep.split(","):
        left = end - time.monotonic()
        if left < args.min_left_s:
            _record(args.json, item, f"skipped: {left:.0f} s left")
            continue
        t0 = time.monotonic()
        print(f"== {item} (limit {left:.0f} s)", file=log, flush=True)
        # Its own session, so that a timeout ends torchrun's workers too (they hold the GPUs).
        proc = subprocess.Popen(_child_cmd(args, item), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            tail, _ = proc.communicate(timeout=left)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            tail, _ = proc.communicate()
            rc = "timeout"
        noise = ("warn", "return func(", "Loading weights")
        lines = [ln for ln in tail.splitlines() if ln.strip() and not any(n in ln for n in noise)]
        print("\n".join(lines[-80:]), file=log, flush=True)
        result = next((ln for ln in lines if ln.startswith("RESULT ")), None)
        errors = [ln for ln in lines if ("Error" in ln or "error:" in ln) and "ChildFailedError" not in ln]
        if result is None:
            _record(args.json, item, f"rc={rc}: " + " | ".join(errors[:3] or lines[-4:])[-800:])
        print(f"== {item}: rc={rc}, {time.monotonic() - t0:.0f} s", flush=True)
        print(result[:300] if result else "   " + (errors[:1] or ["no RESULT"])[0][-300:], flush=True)
    summary(args.json)


def summary(path: str) -> None:
    """One line per result of ``path``: the table docs/benchmarks.md carries."""
    print("| size | variant | mb | attn | SFT tok/s/GPU | SFT MFU | PPO tok/s/GPU | PPO MFU | fwd / bwd / opt s "
          "| peak GiB |")
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if "error" in r:
            print(f"| {r['item']} | failed: {r['error'][:160]} |")
            continue
        print(f"| {r['size']} | {r['variant']} | {r['micro_batch']} | {r.get('attn_kernel', r['attn'])} "
              f"| {r['sft_tokens_per_s_gpu']:,.0f} | {100 * r['sft_mfu']:.1f}% ({100 * r['sft_mfu_attn']:.1f}%) "
              f"| {r['ppo_tokens_per_s_gpu']:,.0f} | {100 * r['ppo_mfu']:.1f}% ({100 * r['ppo_mfu_attn']:.1f}%) "
              f"| {r['forward_s']:.3f} / {r['backward_s']:.3f} / {r['optimizer_s']:.3f} "
              f"| {r.get('peak_mem_gib', 0):.1f} |")
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if "profile" in r:
            prof = r["profile"]
            kinds = ", ".join(f"{k} {v:.3f}" for k, v in sorted(prof["kernel_s_by_kind"].items(), key=lambda kv: -kv[1]))
            print(f"profile {r['size']} {r['variant']}: step {prof['wall_s']:.3f} s, GPU kernel s: {kinds}")
            for name, ph in prof.get("phases", {}).items():
                print(f"  {name}: {ph['wall_s'] * 1e3:.1f} ms, GPU busy {ph['gpu_busy_s'] * 1e3:.1f} ms "
                      f"({ph['gpu_busy_s'] / max(ph['wall_s'], 1e-9):.0%}), {ph['kernels']} kernels")


def _record(path: str, item: str, error: str) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"item": item, "error": error}) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", help="size:variant,... run one after another (each its own torchrun)")
    p.add_argument("--size", choices=sorted(SHAPES), default="1.35b")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="tuned")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per rank per step (one packed row)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    p.add_argument("--varied", action="store_true",
                   help="a new mix of sequence lengths every step, the row 92-100%% of micro-batch x seq tokens")
    p.add_argument("--cpu", action="store_true", help="dry run: tiny shapes work best, fp32, gloo")
    p.add_argument("--profile", action="store_true", help="profile one more SFT step: GPU kernel time by kind")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=300.0)
    p.add_argument("--min-left-s", type=float, default=40.0, help="skip a variant with less time left")
    p.add_argument("--model-root", default="/tmp/treadle_bench_models")
    p.add_argument("--json", default="bench_gpu_trainer.json")
    p.add_argument("--log", default=None)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    Path(args.model_root).mkdir(parents=True, exist_ok=True)
    if args.sweep:
        sweep(args)
    else:
        run_variant(args)


if __name__ == "__main__":
    main()
