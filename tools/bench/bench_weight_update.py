#!/usr/bin/env python3
"""Benchmark prep: one weight update of the `small` model into a rollout engine over gloo,
bucketed (buckets of --bucket-mb MB) vs one tensor per broadcast.

Times, from the sender's side, the whole update: first broadcast until ``receive_weights``
returns (gate closed, receive, ``reload_weights``, tied-head refresh, resume, version bump).
After one untimed warm-up round the two variants run interleaved ``--repeats`` times, their
order alternating, on alternating weight sets (so every update really changes the weights); medians and the per-tensor / bucketed ratio are printed, plus an
inline update (``InlineWeights``, the tensors in hand) for reference. After the last update the engine's prompt
logprobs are checked against the HF model holding the same weights.

    OMP_NUM_THREADS=1 PYTHONPATH=packages/common/src:packages/rollout/src \
        .venv/bin/python tools/bench/bench_weight_update.py --bucket-mb 16 --repeats 5

Not a pytest benchmark: starting a vLLM engine takes ~10 s, and the CPU is noisy, so only the
ratio measured in one run means anything (PLATFORM.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class Args:
    """Bucketed vs per-tensor weight update over gloo."""

    model: str = ""
    """HF model folder; empty: build the `small` preset (tools/tiny_model.py) into a temp folder."""
    bucket_mb: float = 16.0
    """Bucket size in MB for the bucketed variant."""
    repeats: int = 5
    """Interleaved repetitions of each variant (medians are reported)."""
    backend: Literal["vllm", "hf"] = "vllm"
    """Engine backend receiving the weights."""
    multiprocess: bool = False
    """vLLM only: workers in their own process."""


def build_small(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.build("small", out, seed=0).out


def make_engine(args: Args, model: Path):
    from treadle.rollout.engine import ENGINES

    cls, cfg = ENGINES[args.backend]
    if args.backend == "vllm":
        return cls(cfg(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512,
                       eos_token_ids=(), multiprocess=args.multiprocess, kv_cache_memory_bytes=64 << 20))
    return cls(cfg(model=str(model), max_model_len=512, eos_token_ids=()))


async def timed_update(engine, sender, names, tensors, sizes) -> float:
    """Seconds from the first broadcast until the engine has loaded and resumed."""
    from treadle.common.records import CollectiveWeights
    from treadle.common.weights import send_buckets

    update = CollectiveWeights(version=engine.weight_version + 1, names=names,
                               dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                               shapes=[list(t.shape) for t in tensors], bucket_sizes=sizes, group=sender.spec)
    start = time.perf_counter()
    thread = threading.Thread(target=send_buckets, args=(sender, tensors, sizes))
    thread.start()
    await engine.receive_weights(update)
    await asyncio.to_thread(thread.join)
    return time.perf_counter() - start


async def bench(args: Args, model: Path) -> None:
    import socket

    import numpy as np
    import torch
    from safetensors.torch import load_file

    from treadle.common.records import InlineWeights, WeightGroupSpec
    from treadle.common.weights import WeightGroup, plan_buckets

    base = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    g = torch.Generator().manual_seed(0)
    other = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    names = list(base)
    sets = [[other[n] for n in names], [base[n] for n in names]]
    nbytes = [t.numel() * t.element_size() for t in sets[0]]
    bucketed = plan_buckets(nbytes, int(args.bucket_mb * (1 << 20)))
    print(f"model {model}: {len(names)} tensors, {sum(nbytes) / 2**20:.1f} MiB; "
          f"{len(bucketed)} buckets of <= {args.bucket_mb:g} MB")

    engine = make_engine(args, model)
    t0 = time.perf_counter()
    await engine.start()
    print(f"{args.backend} engine started in {time.perf_counter() - t0:.1f} s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = WeightGroupSpec(host="127.0.0.1", port=port, world_size=2, rank=0, timeout_s=120)
    sender_box: list = []
    joining = threading.Thread(target=lambda: sender_box.append(WeightGroup(spec)))
    joining.start()
    await engine.join_weight_group(spec.with_rank(1))
    joining.join()
    sender = sender_box[0]

    times: dict[str, list[float]] = {"bucketed": [], "per_tensor": []}
    variants = [("bucketed", bucketed), ("per_tensor", [1] * len(names))]
    for i in range(args.repeats + 1):  # round 0 warms both variants up, untimed
        tensors = sets[i % 2]
        for variant, sizes in (variants if i % 2 else variants[::-1]):  # the order alternates
            t = await timed_update(engine, sender, names, tensors, sizes)
            if i:
                times[variant].append(t)
    last = sets[args.repeats % 2]
    t0 = time.perf_counter()
    await engine.update_weights(InlineWeights(version=engine.weight_version + 1, names=names,
                                              dtypes=["float32"] * len(names), shapes=[list(t.shape) for t in last],
                                              tensors=last))
    inline = time.perf_counter() - t0

    probe = np.arange(3, 40, dtype=np.int32)
    got = await engine.prompt_logprobs(probe)
    await engine.leave_weight_group()
    sender.close()
    await engine.close()
    gap = check_against_hf(model, dict(zip(names, last, strict=True)), probe, got)

    mb = sum(nbytes) / 1e6
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:>10}: median {med[k] * 1e3:8.1f} ms  ({mb / med[k]:7.1f} MB/s)  runs "
              + " ".join(f"{x * 1e3:.0f}" for x in v))
    print(f"{'inline':>10}: {inline * 1e3:8.1f} ms  (update_weights with the tensors in hand, one run)")
    print(f"ratio per_tensor / bucketed = {med['per_tensor'] / med['bucketed']:.2f}")
    print(f"engine vs HF prompt logprobs after the last update: max |gap| = {gap:.2e}")


def check_against_hf(model: Path, weights: dict, probe, got) -> float:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ref.load_state_dict(weights, strict=False)
    x = torch.as_tensor(probe.astype(np.int64))[None]
    with torch.no_grad():
        lp = torch.log_softmax(ref(x).logits[0, :-1].double(), -1).gather(1, x[0, 1:, None]).squeeze(1)
    return float(np.abs(lp.numpy() - got).max())


def main() -> None:
    import tyro

    args = tyro.cli(Args)
    with tempfile.TemporaryDirectory(prefix="treadle-bench-") as tmp:
        model = Path(args.model) if args.model else build_small(Path(tmp) / "small")
        asyncio.run(bench(args, model))


if __name__ == "__main__":
    main()
