#!/usr/bin/env python3
"""Benchmark: episodes/s of a 3-turn environment, through the executor vs through the gateway.

Starts a real rollout daemon (``python -m treadle.rollout serve``, ``--backend`` hf or vllm,
one engine, the ``--preset`` tiny model built into a temp folder; ``--no_cpu_bind``, so the engine
keeps this process's OMP_NUM_THREADS: with 1, a busy neighbour on the shared 2-core machine slows
it down instead of stalling its OpenMP barriers, and the other core is left to the clients and
the gateway) and a real gateway
(``python -m treadle.agents serve``), each its own process. The environment answers every turn
with a user message and ends after 3 turns; every turn samples exactly ``--tokens`` tokens
(``min_tokens = max_tokens``), so both paths do the same engine work per episode.

- executor: ``MultiTurnExecutor`` in this process (``RolloutSampler`` over ZeroMQ);
- gateway: per episode, an agent loop in this process drives the gateway with the official
  ``openai.AsyncOpenAI`` client (3 chat completions in one session, the environment stepped on
  each reply), then fetches the stitched Trajectory (``GatewayClient.finish``);
- gateway_light: the same loop with ``treadle.agents.client.GatewayClient`` (plain aiohttp + JSON,
  no pydantic models) for the chat calls, separating the client's cost from the gateway's.

One round = ``--episodes`` episodes per path with ``--concurrency`` in flight, the paths back to
back in a rotating order; ``--repeats`` rounds after one warm-up round. Reported: the medians of
episodes/s, and the median over rounds of each path's rate divided by the executor's rate in the
same round (paired: the shared CPU's load changes by 10x within minutes, PLATFORM.md). Both paths are checked to produce the same number of trainable
tokens per episode.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_agents.py --repeats 5

Prints a markdown table: median episodes/s per path and its ratio to the executor.
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
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parents[2]
SRC = [str(ROOT / "packages" / p / "src") for p in ("common", "rollout", "rewards", "agents")]
sys.path[:0] = [p for p in SRC if p not in sys.path]

from treadle.agents.api import Action, Episode, StepResult  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Args:
    """Agent episodes/s: executor vs gateway."""

    episodes: int = 64
    """Episodes per round."""
    concurrency: int = 32
    """Episodes in flight at once."""
    tokens: int = 16
    """Tokens sampled per turn (exactly)."""
    repeats: int = 5
    """Rounds per path, alternating."""
    backend: str = "hf"
    """Rollout engine backend: hf or vllm."""
    preset: str = "tiny"
    """tools/tiny_model.py preset."""


class ThreeTurnEnv:
    """Answers each turn with a user message; done after the third turn."""

    async def reset(self, episode: Episode) -> list[dict[str, str]]:
        return [{"role": "user", "content": "Tell me a story, one part per turn."}]

    async def step(self, action: Action) -> StepResult:
        done = action.turn == 2
        return StepResult(observation=[] if done else [{"role": "user", "content": "Go on."}],
                          reward=1.0 if done else 0.0, done=done)


def child_env() -> dict[str, str]:
    env = dict(os.environ)  # a developer script: it hands its own environment to its children
    env["PYTHONPATH"] = os.pathsep.join([*SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def build_model(preset: str, out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("bench_tiny_model", ROOT / "tools" / "tiny_model.py")
    tm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tm
    spec.loader.exec_module(tm)
    return tm.build(preset, out, seed=0).out


def start(cmd: list[str], pattern: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env())
    line = proc.stdout.readline()
    m = re.search(pattern, line)
    if m is None:
        proc.kill()
        raise RuntimeError(f"{cmd[2:4]} did not start: {line!r}")
    return proc, m.group(1)


async def executor_round(ex: Any, n: int) -> list[Any]:
    return await ex.run_many([Episode(prompt="", uid=uuid.uuid4().hex) for _ in range(n)])


async def chat_openai(client: Any, messages: list[dict[str, Any]], sid: str, tokens: int) -> dict[str, Any]:
    r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=tokens,
                                             extra_body={"session_id": sid, "min_tokens": tokens})
    return r.choices[0].message.model_dump(exclude_none=True)


async def chat_light(gw: Any, messages: list[dict[str, Any]], sid: str, tokens: int) -> dict[str, Any]:
    r = await gw.chat(messages, session_id=sid, max_tokens=tokens, min_tokens=tokens)
    return r["choices"][0]["message"]


async def gateway_episode(chat: Any, gw: Any, tokens: int, sem: asyncio.Semaphore) -> Any:
    async with sem:
        env, sid = ThreeTurnEnv(), uuid.uuid4().hex
        messages: list[dict[str, Any]] = list(await env.reset(Episode(prompt="")))
        for turn in range(3):
            msg = await chat(messages, sid, tokens)
            res = await env.step(Action(text=msg.get("content") or "", token_ids=np.zeros(0, np.int32),
                                        finish_reason="length", turn=turn, stopped=False))
            messages += [msg, *res.observation]
        [traj] = await gw.finish(sid, reward=res.reward)
        return traj


async def gateway_round(chat: Any, gw: Any, n: int, tokens: int, concurrency: int) -> list[Any]:
    sem = asyncio.Semaphore(concurrency)
    return list(await asyncio.gather(*(gateway_episode(chat, gw, tokens, sem) for _ in range(n))))


async def bench(args: Args, model: Path, rollout: str, gateway_url: str) -> dict[str, list[float]]:
    import openai

    from treadle.agents.chat import ChatFormat
    from treadle.agents.client import GatewayClient
    from treadle.agents.executor import ExecutorConfig, MultiTurnExecutor
    from treadle.agents.sampler import RolloutSampler
    from treadle.common.records import SamplingParams
    from treadle.rollout.client import RolloutClient

    rates: dict[str, list[float]] = {"executor": [], "gateway": [], "gateway_light": []}
    async with RolloutClient(rollout) as rc, GatewayClient(gateway_url) as gw:
        await rc.wait_ready(600)
        ex = MultiTurnExecutor(env_factory=ThreeTurnEnv, sampler=RolloutSampler(rc), chat=ChatFormat.load(model),
                               sampling=SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens),
                               config=ExecutorConfig(max_in_flight=args.concurrency, max_turn_tokens=args.tokens))
        client = openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0)
        with_openai = lambda m, s, t: chat_openai(client, m, s, t)  # noqa: E731
        with_light = lambda m, s, t: chat_light(gw, m, s, t)  # noqa: E731
        runs = {"executor": lambda: executor_round(ex, args.episodes),
                "gateway": lambda: gateway_round(with_openai, gw, args.episodes, args.tokens, args.concurrency),
                "gateway_light": lambda: gateway_round(with_light, gw, args.episodes, args.tokens, args.concurrency)}
        names = list(runs)
        for r in range(args.repeats + 1):  # round 0 warms every path up
            for name in names[r % 3:] + names[:r % 3]:  # rotate the order: no path always goes first
                run = runs[name]
                t0 = time.perf_counter()
                out = await run()
                dt = time.perf_counter() - t0
                trainable = {int(t.loss_mask.sum()) for t in out}
                assert trainable == {3 * args.tokens}, (name, trainable)
                if r:
                    rates[name].append(args.episodes / dt)
        await client.close()
    return rates


def main(args: Args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.preset, Path(tmp) / args.preset)
        port = 5600 + os.getpid() % 300
        daemon, rollout = start([sys.executable, "-m", "treadle.rollout", "serve", "--model", str(model),
                                 "--engines", "1", "--backend", args.backend, "--endpoint", f"tcp://127.0.0.1:{port}",
                                 "--no_cpu_bind"],
                                r"serving (\S+)")
        try:
            gateway, url = start([sys.executable, "-m", "treadle.agents", "serve", "--model", str(model),
                                  "--rollout", rollout, "--port", "0"], r"serving (\S+)")
            try:
                rates = asyncio.run(bench(args, model, rollout, url))
            finally:
                gateway.terminate()
                gateway.wait()
        finally:
            daemon.terminate()
            daemon.wait()
    ex, gw, light = (statistics.median(rates[k]) for k in ("executor", "gateway", "gateway_light"))
    paired = {k: statistics.median(a / b for a, b in zip(rates[k], rates["executor"], strict=True))
              for k in ("gateway", "gateway_light")}
    print(f"\n{args.episodes} episodes x 3 turns x {args.tokens} tokens, {args.concurrency} in flight, "
          f"{args.backend} engine, {args.repeats} rounds each (medians)\n")
    print("| path | episodes/s (median) | vs executor (medians) | vs executor (paired, median) |")
    print("| --- | --- | --- | --- |")
    print(f"| executor (MultiTurnExecutor, ZeroMQ) | {ex:.1f} | 1.00x | 1.00x |")
    print(f"| gateway (openai.AsyncOpenAI -> treadle-agents serve) | {gw:.1f} | {gw / ex:.2f}x | "
          f"{paired['gateway']:.2f}x |")
    print(f"| gateway (treadle.agents.client.GatewayClient -> treadle-agents serve) | {light:.1f} | {light / ex:.2f}x | "
          f"{paired['gateway_light']:.2f}x |")
    print("\nper round: " + "; ".join(f"{k} " + ", ".join(f"{x:.1f}" for x in v) for k, v in rates.items()))


if __name__ == "__main__":
    main(tyro.cli(Args))
