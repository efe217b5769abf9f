#!/usr/bin/env python3
"""Benchmark: the trainer's weight sync (issue 7), ZeRO-3 sender -> rollout daemon, bucketed vs
one tensor per broadcast.

Builds the `small` preset twice (tools/tiny_model.py: seed 0 for the daemon, seed 1 for the
trainer), starts ``treadle-rollout serve`` with one engine (vLLM by default: fp32, eager,
64 MiB KV cache, on core 1 by default), then runs the trainer side under ``torchrun`` (``--ranks`` gloo ranks): a
ZeRO-3 DeepSpeed engine and one ``WeightSender`` (collective transport over gloo). After an
untimed warm-up sync (join, buffers, first reload), the variants alternate ``--repeats`` times
(AB, BA, ...): ``--bucket-mb`` MB buckets vs ``bucket_bytes=0``. Each sync is timed by the
sender's ``SyncReport``: from the start of ``sync`` until the daemon reported the engine loaded
(gather + broadcast + the engine's reload + acknowledgement); its gather and broadcast parts
are reported too. The ratio is given of the medians and paired (the median over rounds of the
two variants' ratio within a round). One inline sync (tensors in the message, a second sender
with ``transport="inline"``) is timed for reference. Finally the daemon's prompt logprobs are
checked against the trainer model's own forward.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_weight_sync.py --bucket-mb 16 --repeats 7
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_weight_sync.py --ranks 2 --json .cache/ws.json

The bucket size is switched on the one sender between syncs (``sender.config``): a second
sender would replace the daemon's group at every switch, and the joins would be timed too.
Not a pytest benchmark: the daemon's vLLM engine takes ~20 s to start, and the CPU is noisy, so
only ratios measured in one run mean anything (PLATFORM.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
PROBE = list(range(5, 120))


@dataclass(frozen=True, kw_only=True)
class Args:
    """ZeRO-3 weight sync to a rollout daemon: bucketed vs per tensor."""

    bucket_mb: float = 16.0
    """Bucket size in MB (2**20 bytes) of the bucketed variant."""
    repeats: int = 7
    """Timed syncs of each variant (interleaved; medians are reported)."""
    ranks: int = 1
    """Trainer ranks (torchrun, gloo); rank 0 sends."""
    backend: Literal["vllm", "hf"] = "vllm"
    """The daemon's engine backend."""
    engine_cpus: tuple[int, ...] = (1,)
    """Cores of the daemon's engine (``--cpus``; one thread each); empty: the daemon's default
    (all cores, one OpenMP thread per core: stalls whenever a neighbour takes a core)."""
    json: str = ""
    """Write the results here as JSON too."""


# ------------------------------------------------------------------ trainer side (under torchrun)


def worker(endpoint: str, model: str, out: str, bucket_mb: float, repeats: int) -> None:
    import numpy as np
    import torch

    from treadle.common.log import setup_logging
    from treadle.rollout.client import SyncRolloutClient
    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.config.optim import OptimizerConfig
    from treadle.trainer.models.loading import load_causal_lm
    from treadle.trainer.strategy.deepspeed import (
        build_engine,
        init_distributed,
        shutdown_distributed,
    )
    from treadle.trainer.weights.sender import SenderConfig, WeightSender

    setup_logging("WARNING")
    info = init_distributed()
    ds = DeepSpeedConfig(zero_stage=3, param_dtype="fp32")
    engine = build_engine(load_causal_lm(model, ds, trainable=True), ds, OptimizerConfig(), micro_batch=1,
                          grad_accum=1, world=info.world, total_steps=10)
    client = SyncRolloutClient(endpoint) if info.is_main else None
    sender = WeightSender(engine, config=SenderConfig(bucket_bytes=int(bucket_mb * (1 << 20))), client=client,
                          zero_stage=3, is_main=info.is_main)
    try:
        variants = {"bucketed": {"bucket_bytes": sender.config.bucket_bytes}, "per_tensor": {"bucket_bytes": 0}}
        warm = sender.sync(1)
        runs: dict[str, list[dict]] = {k: [] for k in variants}
        version = 1
        for i in range(repeats):
            for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
                sender.config = dataclasses.replace(sender.config, **variants[name])
                version += 1
                r = sender.sync(version)
                runs[name].append({"seconds": r.seconds, "gather": r.gather_seconds, "send": r.send_seconds,
                                   "buckets": r.buckets})
        # the transport is fixed per sender; an inline one joins no group, so the collective
        # sender's group stays the daemon's
        with WeightSender(engine, config=SenderConfig(transport="inline"), client=client, zero_stage=3,
                          is_main=info.is_main) as inline_sender:
            inline = inline_sender.sync(version + 1)
        x = torch.as_tensor(PROBE)[None]
        with torch.no_grad():
            mine = torch.log_softmax(engine.module(input_ids=x).logits[0, :-1].double(), -1)
        mine = mine.gather(1, x[0, 1:, None]).squeeze(1).numpy()
        if info.is_main:
            got = client.prompt_logprobs(np.asarray(PROBE))
            Path(out).write_text(json.dumps({
                "tensors": warm.tensors, "bytes": warm.bytes, "warmup_seconds": warm.seconds, "runs": runs,
                "inline_seconds": inline.seconds, "gap": float(np.abs(got - mine).max()),
                "version": client.health()["version"]}))
    finally:
        sender.close()
        if client is not None:
            client.close()
        shutdown_distributed()


# ------------------------------------------------------------------ orchestration


def build(preset: str, out: Path, seed: int) -> Path:
    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.build(preset, out, seed=seed).out


def start_daemon(args: Args, model: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    engine = ["--engine.dtype", "float32", "--engine.max_model_len", "512"]
    if args.engine_cpus:
        engine += ["--cpus", *map(str, args.engine_cpus)]
    if args.backend == "vllm":
        engine += ["--engine.enforce_eager", "--engine.kv_cache_memory_bytes", str(64 << 20)]
    proc = subprocess.Popen([sys.executable, "-m", "treadle.rollout", "serve", "--endpoint", endpoint, "--model",
                             str(model), "--engines", "1", "--backend", args.backend, *engine],
                            start_new_session=True, stdin=subprocess.DEVNULL)
    return proc, endpoint


def wait_ready(endpoint: str, timeout: float = 600.0) -> None:
    from treadle.rollout.client import SyncRolloutClient

    with SyncRolloutClient(endpoint) as c:
        c.wait_ready(timeout)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def summarise(args: Args, res: dict, command: str) -> dict:
    med = {k: {f: statistics.median(r[f] for r in runs) for f in ("seconds", "gather", "send")}
           for k, runs in res["runs"].items()}
    mb = res["bytes"] / 1e6
    print(f"small model: {res['tensors']} tensors, {mb:.1f} MB fp32; {args.ranks} ZeRO-3 rank(s); "
          f"daemon: 1 {args.backend} engine; {args.repeats} interleaved syncs per variant")
    for name, runs in res["runs"].items():
        m = med[name]
        print(f"{name:>13} ({runs[0]['buckets']:3d} broadcasts): median {m['seconds'] * 1e3:7.1f} ms "
              f"({mb / m['seconds']:6.1f} MB/s)  gather {m['gather'] * 1e3:6.1f} ms  broadcast "
              f"{m['send'] * 1e3:6.1f} ms  runs " + " ".join(f"{r['seconds'] * 1e3:.0f}" for r in runs))
    new, base = list(res["runs"])  # the variant under test, its baseline
    ratio = med[base]["seconds"] / med[new]["seconds"]
    # per round: the two variants ran back to back, so load changes between rounds cancel out
    paired = statistics.median(p["seconds"] / b["seconds"]
                               for p, b in zip(res["runs"][base], res["runs"][new], strict=True))
    print(f"{'inline':>10}: {res['inline_seconds'] * 1e3:.1f} ms (one run); warm-up sync (join + first load) "
          f"{res['warmup_seconds'] * 1e3:.0f} ms")
    print(f"ratio {base} / {new} = {ratio:.2f} (medians), {paired:.2f} (paired, median of rounds)")
    print(f"daemon vs trainer prompt logprobs after the last sync: max |gap| = {res['gap']:.2e} "
          f"(version {res['version']})")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": f"{platform.node()} ({os.cpu_count()} cores)",
            "command": command, "args": dataclasses.asdict(args), **res, "median": med, "ratio": ratio,
            "paired_ratio": paired}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":  # the torchrun side
        _, _, endpoint, model, out, bucket_mb, repeats = sys.argv
        worker(endpoint, model, out, float(bucket_mb), int(repeats))
        return
    import tyro

    args = tyro.cli(Args)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    with tempfile.TemporaryDirectory(prefix="treadle-bench-") as tmp:
        served, trained = build("small", Path(tmp) / "small0", 0), build("small", Path(tmp) / "small1", 1)
        proc, endpoint = start_daemon(args, served)
        try:
            t0 = time.perf_counter()
            wait_ready(endpoint)
            print(f"daemon ready in {time.perf_counter() - t0:.1f} s")
            out = Path(tmp) / "result.json"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={args.ranks}", __file__, "worker", endpoint, str(trained), str(out),
                            str(args.bucket_mb), str(args.repeats)], check=True)
            result = summarise(args, json.loads(out.read_text()), command)
        finally:
            stop(proc)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
