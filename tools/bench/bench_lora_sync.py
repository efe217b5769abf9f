#!/usr/bin/env python3
"""Benchmark: a LoRA model's weight sync, merged model vs adapter alone (issue 33).

Builds the `small` preset (tools/tiny_model.py, seed 0), starts ``treadle-rollout serve`` with
one engine serving it (``--backend``: hf, or vLLM's CPU build with ``--engine.max_lora_rank``),
puts PEFT LoRA adapters (``--rank``, alpha 2 x rank, all linear layers, B nonzero) on the same
model in this process and syncs it with one ``WeightSender`` each way (collective transport,
gloo): ``adapters=False`` (today's path: every weight, LoRA merged) and ``adapters=True`` (the
adapter alone, served by the engine on its base). First one checked adapter sync (the canary on,
and the daemon's prompt logprobs against the trainer model's own forward) and an untimed merged
one; then ``--repeats``
rounds of both, interleaved, timed by the sender's ``SyncReport`` (from ``sync`` until the daemon
reported the engine loaded), canary off, on one sender whose config is switched between syncs
(two would take the daemon's group from each other, and the joins would be timed). Medians are
reported, with bytes and tensors per sync.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_lora_sync.py --backend hf --repeats 5
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_lora_sync.py --backend vllm --repeats 5

A timed adapter sync after a merged one lands on the merged weights (the engine keeps its base):
the bytes and the time are what they would be, the served model is not; the checked syncs come
first (adapter) and last (merged) for that reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
PROBE = list(range(5, 120))
CANARY = tuple(range(3, 40))


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def own_logprobs(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    x = torch.tensor([ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
    return lp.gather(1, x[0, 1:, None]).squeeze(1).numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from treadle.rollout.client import SyncRolloutClient
    from treadle.trainer.weights.sender import SenderConfig, WeightSender

    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    folder = _tool("tiny_model").build("small", tmp / "small", seed=0).out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    extra = ["--engine.dtype", "float32"]
    if a.backend == "vllm":
        extra += ["--engine.max_lora_rank", str(a.rank), "--engine.enforce_eager",
                  "--engine.kv_cache_memory_bytes", str(64 << 20)]
    proc = subprocess.Popen([sys.executable, "-m", "treadle.rollout", "serve", "--endpoint", endpoint, "--backend",
                             a.backend, "--model", str(folder), "--engines", "1", *extra],
                            start_new_session=True, stdin=subprocess.DEVNULL)
    client = SyncRolloutClient(endpoint)
    try:
        client.wait_ready(600)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                               LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules="all-linear"))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
        want = own_logprobs(model, PROBE)
        version = int(client.health()["version"])
        # one sender, its config switched between syncs (``bench_weight_sync``'s way): a second
        # sender would take the daemon's group over at every switch, and the joins would be timed
        sender = WeightSender(model, config=SenderConfig(), client=client, zero_stage=0, is_main=True)
        checks = {}

        def sync(kind: str, canary: tuple[int, ...] = ()) -> object:
            nonlocal version
            sender.config = SenderConfig(adapters=kind == "adapter", bucket_bytes=64 << 20, canary_token_ids=canary)
            version += 1
            return sender.sync(version)

        sync("adapter", CANARY)  # checked (the engine still holds the base), and the join
        checks["adapter"] = float(np.abs(client.prompt_logprobs(np.asarray(PROBE)) - want).max())
        sync("merged")  # untimed: the sender's first bucket buffer
        rows: dict[str, list] = {"adapter": [], "merged": []}
        for r in range(a.repeats):
            for kind in (("adapter", "merged") if r % 2 == 0 else ("merged", "adapter")):
                rows[kind].append(sync(kind))
        sync("merged", CANARY)
        checks["merged"] = float(np.abs(client.prompt_logprobs(np.asarray(PROBE)) - want).max())
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
               platform.machine(), "cpus": os.cpu_count(), "backend": a.backend, "rank": a.rank,
               "repeats": a.repeats, "command": " ".join(sys.argv), "logprob_gap": checks}
        for kind, reps in rows.items():
            out[kind] = {"tensors": reps[0].tensors, "mb": round(reps[0].bytes / 1e6, 3),
                         "median_s": round(statistics.median(r.seconds for r in reps), 4),
                         "min_s": round(min(r.seconds for r in reps), 4)}
        out["bytes_ratio"] = round(out["merged"]["mb"] / out["adapter"]["mb"], 1)
        out["time_ratio"] = round(out["merged"]["median_s"] / out["adapter"]["median_s"], 2)
        print(json.dumps(out, indent=1))
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
        sender.close()
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
