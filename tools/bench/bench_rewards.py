#!/usr/bin/env python3
"""Benchmark: reward-daemon throughput (samples/s), HTTP vs ZeroMQ, for a rule function and a
tiny reward model, in one run.

Starts two real daemons (``python -m treadle.rewards.cli serve``, each its own process, as in
production): one serving the built-in ``format`` rule function (``--workers`` worker processes),
one serving a tiny random ``Qwen2ForSequenceClassification`` reward model (``--preset`` of
tools/tiny_model.py, built into a temp folder). Clients live in this process: ZeroMQ through
``treadle.rewards.client.RewardClient``, HTTP through an aiohttp session with keep-alive
against OpenRLHF's ``POST /get_reward``. One round = ``--requests`` requests of ``--batch``
samples with ``--concurrency`` in flight; the transports alternate round by round
(``--repeats`` rounds each) and medians are compared (the CPU is noisy: PLATFORM.md).

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_rewards.py --repeats 5
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_rewards.py --repeats 3 --rm-replicas 2

Prints a markdown table: median samples/s per (scorer, transport) and ZeroMQ / HTTP (and, with
``--rm-replicas R``, R copies of the reward model against one).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class Args:
    """Reward daemon throughput, HTTP vs ZeroMQ."""

    requests: int = 32
    """Requests per round."""
    batch: int = 32
    """Samples per request."""
    concurrency: int = 4
    """Requests in flight at once."""
    repeats: int = 5
    """Rounds per (scorer, transport), alternating transports."""
    workers: int = 2
    """Worker processes of the rule function."""
    preset: str = "tiny"
    """tools/tiny_model.py preset of the reward model."""
    rm_replicas: int = 1
    """Above 1: the reward model again with ``--rm.replicas`` copies (CPU copies here: what a
    reward model apart on that many GPUs runs), against one copy."""


def build_rm(preset: str, out: Path) -> Path:
    """A random Qwen2ForSequenceClassification (num_labels=1) with the tiny model's tokenizer."""
    spec = importlib.util.spec_from_file_location("bench_tiny_model", ROOT / "tools" / "tiny_model.py")
    tm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tm
    spec.loader.exec_module(tm)
    import torch
    from transformers import Qwen2ForSequenceClassification

    tok = tm.wrap_tokenizer(tm.train_tokenizer(tm.PRESETS[preset].vocab_size), 2048)
    cfg = tm.model_config(tm.PRESETS[preset], tok)
    cfg.num_labels = 1
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def start_daemon(*flags: str) -> tuple[subprocess.Popen[str], str, str]:
    cmd = [sys.executable, "-m", "treadle.rewards.cli", "serve", "--http.port", "0",
           "--zmq.endpoint", "tcp://127.0.0.1:0", "--cache.size", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    m = re.search(r"zmq=(\S+) http=(\S+)", line)
    if m is None:
        proc.kill()
        raise RuntimeError(f"daemon did not start: {line!r}")
    return proc, m.group(1), m.group(2)


def samples(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    prompts = [f"<|im_start|>user\nquestion {seed}-{i}: what is {i} + {i}?<|im_end|>\n<|im_start|>assistant\n"
               for i in range(n)]
    queries = [p + f"<think>adding {i} and {i} gives {2 * i}, let me check it twice</think>"
                   f"<answer>{2 * i}</answer><|im_end|>" for i, p in enumerate(prompts)]
    return queries, prompts, [str(2 * i) for i in range(n)]


async def one_round(transport: str, target: object, a: Args, seed: int) -> float:
    """Seconds to answer a.requests requests of a.batch samples, a.concurrency at a time."""
    sem = asyncio.Semaphore(a.concurrency)

    async def one(i: int) -> None:
        q, p, lab = samples(a.batch, seed * 1000 + i)
        async with sem:
            if transport == "zmq":
                res = await target.score(q, p, lab)
                assert len(res.rewards) == a.batch
            else:
                async with target.post("/get_reward", json={"query": q, "prompts": p, "labels": lab}) as r:
                    body = await r.json()
                    assert len(body["rewards"]) == a.batch

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(a.requests)))
    return time.perf_counter() - start


async def measure(name: str, zmq: str, http: str, a: Args) -> dict[str, list[float]]:
    import aiohttp

    from treadle.rewards.client import RewardClient

    times: dict[str, list[float]] = {"http": [], "zmq": []}
    async with RewardClient(zmq, timeout_s=600) as zc, aiohttp.ClientSession(http) as hc:
        await one_round("zmq", zc, a, 0)  # warm up both paths (workers, model, connections)
        await one_round("http", hc, a, 0)
        for r in range(a.repeats):
            for transport, client in (("http", hc), ("zmq", zc)) if r % 2 == 0 else (("zmq", zc), ("http", hc)):
                times[transport].append(await one_round(transport, client, a, r + 1))
    return times


def main() -> None:
    a = tyro.cli(Args)
    n = a.requests * a.batch
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rm = build_rm(a.preset, Path(tmp) / "rm")
        scorers = {
            f"rule function (`format`, {a.workers} workers)": ("--functions", "format", "--workers.num_workers",
                                                                str(a.workers)),
            f"reward model (Qwen2ForSequenceClassification, `{a.preset}` preset, fp32)": (
                "--rm.path", str(rm), "--rm.micro_batch_size", str(a.batch)),
        }
        if a.rm_replicas > 1:
            scorers[f"the same, `--rm.replicas {a.rm_replicas}`"] = (
                "--rm.path", str(rm), "--rm.micro_batch_size", str(a.batch), "--rm.replicas", str(a.rm_replicas),
                "--rm.device", "cpu")
        for name, flags in scorers.items():
            proc, zmq, http = start_daemon(*flags)
            try:
                times = asyncio.run(measure(name, zmq, http, a))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            med = {t: statistics.median(v) for t, v in times.items()}
            rows.append((name, n / med["http"], n / med["zmq"], med["http"] / med["zmq"]))
    print(f"\n{a.requests} requests x {a.batch} samples, {a.concurrency} in flight, {a.repeats} rounds each, "
          f"medians; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n")
    print("| scorer | HTTP samples/s | ZeroMQ samples/s | ZeroMQ / HTTP |\n| --- | --- | --- | --- |")
    for name, h, z, ratio in rows:
        print(f"| {name} | {h:,.0f} | {z:,.0f} | {ratio:.2f}x |")
    if a.rm_replicas > 1:
        print(f"\n--rm.replicas {a.rm_replicas} / one copy, ZeroMQ samples/s: {rows[2][2] / rows[1][2]:.2f}x")


if __name__ == "__main__":
    main()
