#!/usr/bin/env python3
"""The RL control plane's cost (issue 32): rank 0's CPU time per GRPO step against batch size and engines.

What runs is what ``treadle-train ppo``'s rank 0 runs around the models, built from the same
modules: a ``Generator`` (``treadle.trainer.rl.generation``) over a ``PromptStream`` runs each
prompt's ``n`` episodes through a ``SingleTurnExecutor`` (``treadle.agents``: chat template and
tokenization, a ``SeededSampler(RolloutSampler(RolloutClient))`` streaming one request per sample
to ``treadle-rollout serve`` over ZeroMQ, detokenization, the built-in ``math`` reward function in
this process), every group appended to the durable ``TrajectoryLog`` (fsync on), then the steps
rank 0 takes on the whole batch: the trajectories encoded for the broadcast to the other ranks
(``rl.transfer``: codec frames into one byte buffer), ``from_trajectory`` for each, ``finalize``
(rewards, group-normalised advantages, GRPO's returns; ``rl.returns``), the micro-batches
assembled for one pass over the batch (``rl.experience.collate``, packed, the actor step's
arrays) and the step record in the log.

Counted (``time.process_time`` of this process: every thread, user + system) per step:
``rollout`` (the event-loop thread: executor, client, codec; ZeroMQ's I/O thread; the reward
function's worker threads, split out by ``/proc/self/task``), ``log`` (appends + fsync + the
step record), ``encode`` (the broadcast's payload), ``advantages`` (``from_trajectory`` +
``finalize``), ``collate`` (one pass of micro-batches). Not counted, because rank 0 does not run
them on its CPU or they are measured elsewhere: generation (engine processes), model forwards and
backwards (the GPU), the collectives (the broadcast itself, all-gathers: the network), the weight
sync (``bench_fanout.py``). With ``W`` data-parallel ranks rank 0 collates ``B/W`` of the batch
for each pass (here ``W = 1``: the whole batch, once). The rollout daemon's front end is a
second control process; its CPU time (``/proc/<pid>/stat``, its own threads, not its engines)
is reported beside rank 0's.

Engines: ``--engine fake`` (the default) runs ``FakeEngine`` below in every engine process: a
fake, the neighbour of the thing under test, because 64 hf engines (~260 MB private memory and
~4 s of CPU to start each) do not fit a 2-core, 24 GiB machine. The daemon, its front end, the
engine worker processes and their RPC servers, the wire and the client are the real ones; only
the engine class inside each worker is swapped (a ``sitecustomize`` on the daemon's
``PYTHONPATH`` points the registry's ``hf`` entry at ``FakeEngine``; nothing else sees it). A
fake sample is ``max_tokens`` tokens of the model's tokenizer ending in ``\\boxed{d}`` with a
digit ``d`` drawn from the sample's seed, so the math reward parses an answer and about one in
ten is right; logprobs are -1. ``--engine hf`` runs the real hf backend with the tiny model
(for the 1- and 4-engine cells, to check that the fake does not change rank 0's cost).

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_controller.py
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_controller.py --engines 1 4 --batches 256 --engine hf

Writes ``--json`` (default .cache/bench/controller.json) and prints a table. Not a pytest
benchmark: each engine count needs its own daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from treadle.common.records import GenerateRequest, GenerateResult
from treadle.rollout.engine.base import Engine
from treadle.rollout.engine.state import SleepState
from treadle.rollout.engine.weights import WeightSpec, spec_from_checkpoint

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TICK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ the fake engine


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeEngineConfig:
    """The hf backend's config fields (the pool passes those); only model and max_model_len are read."""

    model: str
    engine_id: str = "fake-0"
    max_model_len: int = 2048
    seed: int = 0
    eos_token_ids: Any = None
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_samples: int = 64


class FakeEngine(Engine):
    """A fake engine (bench only): answers every sample at once with canned tokens ending in an answer."""

    backend = "fake"

    def __init__(self, config: FakeEngineConfig) -> None:
        super().__init__(engine_id=config.engine_id)
        self.config = config
        self._answers: list[np.ndarray] = []
        self._filler = np.zeros(0, np.int32)

    async def _start(self) -> WeightSpec:
        from tokenizers import Tokenizer

        cfg = self.config
        tok = Tokenizer.from_file(str(Path(cfg.model) / "tokenizer.json"))
        self.vocab_size = int(json.loads((Path(cfg.model) / "config.json").read_text())["vocab_size"])
        self.max_model_len = cfg.max_model_len
        self._filler = np.asarray(tok.encode("adding the two numbers step by step gives ").ids, np.int32)
        self._answers = [np.asarray(tok.encode(f" so the answer is \\boxed{{{d}}}").ids, np.int32) for d in range(10)]
        return spec_from_checkpoint(cfg.model, dtype=cfg.dtype)

    def _canned(self, length: int, seed: int) -> np.ndarray:
        tail = self._answers[seed % 10][:length]
        reps = -(-(length - tail.shape[0]) // max(1, self._filler.shape[0]))
        return np.concatenate([np.tile(self._filler, reps)[: length - tail.shape[0]], tail])

    async def _generate(self, req: GenerateRequest, version: int) -> AsyncIterator[GenerateResult]:
        sp = req.sampling
        for i in range(sp.n):
            await asyncio.sleep(0)
            ids = self._canned(sp.max_tokens, (sp.seed or 0) + i)
            yield GenerateResult(response_token_ids=ids, logprobs=np.full(ids.shape[0], -1.0, np.float32),
                                 finish_reason="length", index=i, key=req.key, weight_version=version,
                                 engine_id=self.engine_id)

    async def _abort(self, key: str) -> int:
        return 0

    async def _prompt_logprobs(self, ids: np.ndarray) -> np.ndarray:
        return np.full(ids.shape[0] - 1, -1.0, np.float32)

    async def _abort_all(self) -> None: ...
    async def _pause(self) -> None: ...
    async def _resume(self) -> None: ...
    async def _load(self, update: Any, tensors: list[Any]) -> None: ...
    async def _join_group(self, spec: Any) -> None: ...
    async def _receive(self, update: Any) -> None: ...
    async def _discard(self, update: Any) -> None: ...
    async def _leave_group(self) -> None: ...

    async def _sleep_backend(self, level: int) -> SleepState:
        return SleepState(level=level, memory_released=False, note="fake engine")

    async def _wake_backend(self, level: int) -> None: ...
    async def _reset_prefix_cache(self) -> None: ...

    async def _weight_digest(self) -> str:
        return "fake"

    def _load_counts(self) -> tuple[int, int]:
        return 0, 0

    async def _close(self) -> None: ...


SITECUSTOMIZE = """\
# Written by tools/bench/bench_controller.py for its daemon only: the hf backend's engine class
# is the bench's FakeEngine in every engine process (see that module's docstring).
from treadle.rollout.engine import _BACKENDS
_BACKENDS["hf"] = ("bench_controller", "FakeEngine", "FakeEngineConfig")
"""


# ------------------------------------------------------------------------------ the daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``'s own threads (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class Daemon:
    """``treadle-rollout serve --backend hf`` with ``engines`` engines (fake or real)."""

    def __init__(self, model: Path, engines: int, engine: str, tmp: Path, max_model_len: int) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ)
        if engine == "fake":
            site = tmp / "fake_site"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
            env["PYTHONPATH"] = os.pathsep.join([str(site), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.rollout", "serve", "--model", str(model), "--backend", "hf",
             "--engines", str(engines), "--endpoint", self.endpoint, "--engine.max_model_len", str(max_model_len)],
            env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# ------------------------------------------------------------------------------ rank 0's work


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds of ``thread`` (a thread of this process), from its own POSIX CPU clock."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


@dataclass(slots=True)
class StepCost:
    """CPU seconds of one step, by phase (see the module docstring), plus what the step held."""

    samples: int
    tokens: int
    rollout: float
    rollout_loop: float
    rollout_other: float
    log: float
    encode: float
    advantages: float
    collate: float
    daemon: float
    wall: float
    busy_retries: int
    payload_bytes: int
    reward_mean: float
    failed: int

    @property
    def total(self) -> float:
        return self.rollout + self.log + self.encode + self.advantages + self.collate


class Controller:
    """Rank 0's RL-loop pieces, built as ``trainers.ppo_build.rollout_side`` builds them."""

    def __init__(self, model: Path, endpoint: str, tmp: Path, *, n: int, max_tokens: int, prompts: int,
                 micro_batch: int) -> None:
        from treadle.agents.chat import ChatFormat
        from treadle.agents.executor import ExecutorConfig, SingleTurnExecutor
        from treadle.agents.rewards import reward_sources
        from treadle.agents.sampler import RolloutSampler
        from treadle.common.records import SamplingParams
        from treadle.common.rpc import LoopThread
        from treadle.rollout.client import RolloutClient
        from treadle.trainer.rl.generation import Generator, Prompt, PromptStream, SeededSampler
        from treadle.trainer.rl.returns import ReturnsConfig
        from treadle.trainer.rl.trajlog import TrajectoryLog

        self.lt = LoopThread(name="ppo-rollout")

        async def make_client() -> RolloutClient:
            return RolloutClient(endpoint)

        self.client = self.lt.run(make_client())
        self.lt.run(self.client.wait_ready(600))
        chat = ChatFormat.load(model)
        self.sampler = RolloutSampler(self.client)
        sampling = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens)
        executor = SingleTurnExecutor(reward=reward_sources(["math"]), sampler=SeededSampler(self.sampler, 0),
                                      chat=chat, sampling=sampling,
                                      config=ExecutorConfig(max_length=max_tokens + 256, episode_timeout_s=600.0))
        self.generator = Generator(executor=executor, eval_executor=executor, n=n, lt=self.lt)
        rng = np.random.default_rng(0)
        pairs = rng.integers(0, 5, size=(prompts, 2))  # sums 0..8: a canned digit is right 1 time in 10
        self.stream = PromptStream([Prompt(prompt=[{"role": "user", "content": f"What is {a} + {b}?"}],
                                           label=str(a + b)) for a, b in pairs.tolist()], episodes=1000, seed=0)
        self.trajlog = TrajectoryLog(tmp / "trajectories")
        self.returns = ReturnsConfig(estimator="group_norm", group_size=n, gamma=1.0, lambd=1.0, std_norm=True,
                                     kl_coef=0.0, kl_estimator="k1", kl_in_reward=False, clip_range=(-10.0, 10.0),
                                     max_new_tokens=max_tokens, overlong_buffer_len=None, overlong_penalty_factor=1.0,
                                     stop_properly_coef=None, is_level=None)
        self.n = n
        self.micro_batch = micro_batch
        self.step_no = 0
        self.loop_thread = self.lt._thread  # the event loop's thread: the rollout's own CPU

    def step(self, samples: int, daemon: Daemon) -> StepCost:
        from treadle.common.codec import encode
        from treadle.common.records import TrajectoryBatch
        from treadle.trainer.rl.experience import collate, from_trajectory
        from treadle.trainer.rl.returns import finalize
        from treadle.trainer.rl.transfer import frames_to_bytes

        self.step_no += 1
        retries0 = self.sampler.retries
        w0, c0, t0, d0 = time.perf_counter(), time.process_time(), thread_cpu(self.loop_thread), daemon.cpu()
        groups = self.generator.collect(self.stream.take(samples // self.n))
        c1, t1, d1 = time.process_time(), thread_cpu(self.loop_thread), daemon.cpu()
        for g in groups:
            self.trajlog.append_group(g.seq, g.trajectories)
        trajs = [t for g in groups for t in g.trajectories]
        self.trajlog.mark_step(self.step_no, used=[t.uid for t in trajs])
        c2 = time.process_time()
        payload = frames_to_bytes(encode(TrajectoryBatch(trajectories=trajs, step=self.step_no)))
        c3 = time.process_time()
        exps = [from_trajectory(t) for t in trajs]
        for e in exps:
            e.reward = float(e.traj.reward or 0.0)
        metrics = finalize(exps, self.returns)
        c4 = time.process_time()
        names = ["advantages", "is_weights", "rollout_logp"]
        for lo in range(0, len(exps), self.micro_batch):
            collate(exps[lo:lo + self.micro_batch], packing=True, pad_id=0, names=names)
        c5 = time.process_time()
        loop = t1 - t0
        return StepCost(samples=len(trajs), tokens=sum(int(np.asarray(t.response_token_ids).shape[0]) for t in trajs),
                        rollout=c1 - c0, rollout_loop=loop, rollout_other=(c1 - c0) - loop, log=c2 - c1,
                        encode=c3 - c2, advantages=c4 - c3, collate=c5 - c4, daemon=d1 - d0,
                        wall=time.perf_counter() - w0, busy_retries=self.sampler.retries - retries0,
                        payload_bytes=len(payload), reward_mean=metrics["reward/mean"],
                        failed=sum(t.finish_reason == "error" for t in trajs))

    def close(self) -> None:
        try:
            self.lt.run(self.client.close())
        finally:
            self.lt.stop()
            self.trajlog.close()


# ------------------------------------------------------------------------------ the run


@dataclass(frozen=True, kw_only=True)
class Args:
    """Rank 0's CPU time per GRPO step against batch size and engine count."""

    engines: tuple[int, ...] = (1, 4, 16, 64)
    """Engine counts (one daemon each)."""
    batches: tuple[int, ...] = (256, 1024, 4096, 16384)
    """Samples per step (prompts x n)."""
    engine: Literal["fake", "hf"] = "fake"
    """Engine class inside each engine process (see the module docstring)."""
    n: int = 8
    """Samples per prompt (GRPO's group)."""
    max_tokens: int = 256
    """Tokens per response (every sample is exactly this long)."""
    micro_batch: int = 8
    """Samples per micro-batch (--train.micro_batch_size)."""
    repeats: int = 3
    """Timed steps per cell for batches <= 1024 (one above); medians reported."""
    model: str = ""
    """HF model folder; empty: build the `tiny` preset into a temp folder."""
    json: str = ".cache/bench/controller.json"


@dataclass(slots=True)
class Cell:
    engines: int
    batch: int
    steps: list[StepCost] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(getattr(s, name) for s in self.steps)


def build_model(out: Path) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.build("tiny", out, seed=0).out


COLUMNS = ("rollout", "rollout_loop", "rollout_other", "log", "encode", "advantages", "collate", "total", "daemon",
           "wall")


def table(cells: list[Cell]) -> str:
    head = f"{'engines':>7} {'samples':>7} | " + " ".join(f"{c:>13}" for c in COLUMNS) + \
        f" | {'rank0 ms/sample':>15} {'daemon ms/sample':>16} {'busy':>6}"
    rows = [head, "-" * len(head)]
    for c in cells:
        vals = [statistics.median(getattr(s, k) if k != "total" else s.total for s in c.steps) for k in COLUMNS]
        total, daemon = vals[COLUMNS.index("total")], vals[COLUMNS.index("daemon")]
        rows.append(f"{c.engines:>7} {c.batch:>7} | " + " ".join(f"{v:>13.3f}" for v in vals)
                    + f" | {total / c.batch * 1e3:>15.3f} {daemon / c.batch * 1e3:>16.3f} "
                    f"{statistics.median(s.busy_retries for s in c.steps):>6.0f}")
    return "\n".join(rows)


def run(args: Args, model: Path, tmp: Path) -> list[Cell]:
    cells: list[Cell] = []
    prompts = max(args.batches) // args.n * 2
    for engines in args.engines:
        start = time.perf_counter()
        daemon = Daemon(model, engines, args.engine, tmp, args.max_tokens + 512)
        ctl = None
        try:
            ctl = Controller(model, daemon.endpoint, tmp / f"e{engines}", n=args.n, max_tokens=args.max_tokens,
                             prompts=prompts, micro_batch=args.micro_batch)
            print(f"{engines} {args.engine} engine(s) ready in {time.perf_counter() - start:.1f} s", flush=True)
            ctl.step(min(args.batches), daemon)  # warm-up: imports, first connections, math-verify's caches
            for batch in args.batches:
                cell = Cell(engines=engines, batch=batch)
                for _ in range(args.repeats if batch <= 1024 else 1):
                    cell.steps.append(ctl.step(batch, daemon))
                s = cell.steps[-1]
                print(f"  {batch:>6} samples: rank 0 {s.total:.2f} s CPU, daemon {s.daemon:.2f} s, wall {s.wall:.1f} s, "
                      f"busy retries {s.busy_retries}, failed {s.failed}, reward mean {s.reward_mean:.3f}", flush=True)
                cells.append(cell)
        finally:
            if ctl is not None:
                ctl.close()
            daemon.stop()
    return cells


def main() -> None:
    import tyro

    args = tyro.cli(Args)
    threading.current_thread().name = "bench-main"
    with tempfile.TemporaryDirectory(prefix="treadle-bench-ctl-") as d:
        tmp = Path(d)
        model = Path(args.model) if args.model else build_model(tmp / "tiny")
        started = time.perf_counter()
        cells = run(args, model, tmp)
    print(table(cells))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": "controller", "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core {platform.machine()}",
        "args": asdict(args), "seconds": round(time.perf_counter() - started, 1),
        "cells": [{"engines": c.engines, "batch": c.batch, "steps": [asdict(s) | {"total": s.total} for s in c.steps]}
                  for c in cells]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
