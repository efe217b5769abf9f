#!/usr/bin/env python3
"""Benchmark (issue 10): how an engine copies a weight update's packed buckets into its model's
parameters, on one GPU, in one process (no IPC: a mapped same-GPU buffer reads like any other).

A Qwen2.5-1.5B-shaped bf16 model (random init, no download) is the engine's model; one flat
buffer holds its tensors packed in ``plan_buckets`` buckets of ``--bucket-mb`` in the model's
order (as a cuda_ipc sender's buffer does). Timed, medians of ``--repeats`` after one warm-up,
each until the GPU is done: ``flat`` (one copy per bucket into a second flat buffer: the raw
copy of the same bytes), ``views`` (making each bucket's tensor views alone, host), ``foreach``
(typed, shaped views and one ``_foreach_copy_`` per bucket: the hf engine's load), ``per_tensor`` (one
``copy_`` per tensor) and ``split`` (tensors of at least ``--big-mb`` copied one by one, the
rest by one ``_foreach_copy_`` per bucket), ``split_views`` (1-d views from one ``split`` per
bucket, host), ``foreach_split`` (those into the parameters' flat views), ``foreach_kept`` and
``per_tensor_kept`` (views made once: the copies alone). The byte- and word-view variants of
session 13 went with the engine's word views (2026-12-02, issue 31; their figures are in
docs/benchmarks.md).

    python tools/bench/bench_gpu_copy_in.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPE_1P5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--big-mb", type=float, default=4.0, help="``split``: tensors this large are copied alone")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default="")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    from treadle.common.weights import bucket_layout, bucket_ranges, bucket_views, plan_buckets

    dev = torch.device("cuda", 0)
    cfg = Qwen2Config(**SHAPE_1P5B, tie_word_embeddings=True)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    named = [(n, t) for n, t in model.named_parameters()]
    names = [n for n, _ in named]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    sizes = plan_buckets([t.numel() * t.element_size() for _, t in named], int(a.bucket_mb * (1 << 20)))
    ranges = bucket_ranges(sizes, len(names))
    totals = [bucket_layout(dtypes[lo:hi], shapes[lo:hi])[1] for lo, hi in ranges]
    src = torch.empty(sum(totals), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    flats, off = [], 0
    for n in totals:
        flats.append(src[off:off + n])
        off += n
    params = dict(model.named_parameters())
    big = int(a.big_mb * (1 << 20))

    def views() -> list[list[tuple[str, torch.Tensor]]]:
        out = []
        for (lo, hi), flat in zip(ranges, flats, strict=True):
            vs = bucket_views(flat, dtypes[lo:hi], shapes[lo:hi])
            out.append(list(zip(names[lo:hi], vs, strict=True)))
        return out

    def flat_copy() -> None:
        o = 0
        for f in flats:
            dst[o:o + f.numel()].copy_(f)
            o += f.numel()

    @torch.inference_mode()
    def foreach() -> None:
        for bucket in views():
            torch._foreach_copy_([params[n] for n, _ in bucket], [t for _, t in bucket])

    @torch.inference_mode()
    def per_tensor() -> None:
        for bucket in views():
            for n, t in bucket:
                params[n].copy_(t)

    @torch.inference_mode()
    def split() -> None:
        for bucket in views():
            small = [(params[n], t) for n, t in bucket if t.numel() * t.element_size() < big]
            for n, t in bucket:
                if t.numel() * t.element_size() >= big:
                    params[n].copy_(t)
            if small:
                torch._foreach_copy_([d for d, _ in small], [t for _, t in small])

    flat_dst = {n: t.view(-1) for n, t in params.items()}  # made once: the parameters are kept objects
    runs = []  # per bucket: the split sizes (tensor, padding, tensor, ...) in elements, all bf16 here
    for lo, hi in ranges:
        offs, total = bucket_layout(dtypes[lo:hi], shapes[lo:hi])
        ends = [o + params[n].numel() * 2 for o, n in zip(offs, names[lo:hi], strict=True)]
        sz = []
        for i, o in enumerate(offs):
            sz += [(ends[i] - o) // 2, ((offs[i + 1] if i + 1 < len(offs) else total) - ends[i]) // 2]
        runs.append(sz)

    def split_views() -> list[list[torch.Tensor]]:
        return [list(torch.split(f.view(torch.bfloat16), sz))[::2] for f, sz in zip(flats, runs, strict=True)]

    kept_src = split_views()
    kept_dst = [[flat_dst[n] for n in names[lo:hi]] for lo, hi in ranges]

    @torch.inference_mode()
    def foreach_split() -> None:
        for (lo, hi), src_views in zip(ranges, split_views(), strict=True):
            torch._foreach_copy_([flat_dst[n] for n in names[lo:hi]], src_views)

    @torch.inference_mode()
    def foreach_kept() -> None:
        for d, s in zip(kept_dst, kept_src, strict=True):
            torch._foreach_copy_(d, s)

    @torch.inference_mode()
    def per_tensor_kept() -> None:
        for d, s in zip(kept_dst, kept_src, strict=True):
            for x, y in zip(d, s, strict=True):
                x.copy_(y)

    variants = {"flat": flat_copy, "views": views, "foreach": foreach, "per_tensor": per_tensor, "split": split,
                "split_views": split_views, "foreach_split": foreach_split, "foreach_kept": foreach_kept,
                "per_tensor_kept": per_tensor_kept}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(a.repeats + 1):
        for k, fn in (variants.items() if r % 2 == 0 else reversed(variants.items())):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if r:
                times[k].append(time.perf_counter() - t)
    src.random_(0, 120)  # finite bf16 bit patterns (no NaN: equality must hold)
    foreach_split()
    assert all(torch.equal(flat_dst[n], t) for d, ss in zip(ranges, kept_src, strict=True)
               for n, t in zip(names[d[0]:d[1]], ss, strict=True)), "foreach_split copied wrong bytes"
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "bytes": src.numel(),
           "tensors": len(names), "buckets": len(sizes), "medians_ms": {k: v * 1e3 for k, v in med.items()},
           "vs_flat": {k: v / med["flat"] for k, v in med.items()}}
    for k, v in med.items():
        print(f"{k:<12}{v * 1e3:8.2f} ms  {v / med['flat']:.2f}x flat  {src.numel() / v / 1e9:8.0f} GB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
