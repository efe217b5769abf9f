"""The rollout daemon an RL run generates with: one that is already running, or one started here.

With ``--vllm.endpoint`` the trainer connects to a ``treadle-rollout serve`` started by the user
(or the integration launcher) and leaves it running. Without it, the trainer starts one as a
child process on a free loopback port, serving the actor's starting weights with the ``--vllm.*``
settings, waits until every engine is ready, and stops it (SIGTERM, then SIGKILL of its process
group) when the run ends, also when the run fails.

Not here: talking to the daemon (``treadle.rollout.client``), or what is generated (``generation``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from treadle.common import env
from treadle.common.config import ConfigError
from treadle.common.log import get_logger
from treadle.trainer.config.rollout import VLLM_LORA_RANKS

log = get_logger(__name__)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonSpec:
    """What a daemon started by the trainer serves."""

    model: str
    """HF folder of the actor's starting weights."""
    engines: int
    """Engines in the pool."""
    backend: str
    """"vllm" or "hf"."""
    tensor_parallel_size: int
    """GPUs per engine."""
    dtype: str
    """Serving dtype (the trainer's parameter dtype, so logprobs agree)."""
    max_model_len: int
    """Prompt + response tokens per sample."""
    gpu_memory_utilization: float
    """vLLM's memory share."""
    enable_prefix_caching: bool
    """Reuse KV blocks of shared prefixes."""
    enforce_eager: bool
    """No CUDA graphs."""
    enable_sleep: bool
    """Allow real sleep (GPU)."""
    seed: int
    """Engine seed."""
    gpu_ids: tuple[int, ...] = ()
    """GPUs for the engines (``engine_gpus``; their --gpu_ids); (): none named (CPU)."""
    max_lora_rank: int = 0
    """vLLM: the LoRA rank its engines serve adapters up to (--vllm.sync_adapters); 0: none."""


def engine_gpus(*, engine_gpus: int, trainer_gpus: int, colocate: bool, visible: int,
                mask: str | None) -> tuple[int, ...]:
    """The GPUs a daemon started by the trainer puts its engines on (pure): with ``colocate``
    the trainer's own (the first ``engine_gpus`` of this host's ``trainer_gpus``), else the next
    ones after the trainer's, which this host (``visible`` GPUs) must have. Numbered as the
    engines' ``CUDA_VISIBLE_DEVICES`` takes them: through ``mask``, this process's own
    ``CUDA_VISIBLE_DEVICES`` (None: unset), when it renumbers the GPUs."""
    if colocate:
        if engine_gpus > trainer_gpus:
            raise ConfigError(f"--train.colocate_all: the engines' {engine_gpus} GPUs must be among the trainer's "
                              f"{trainer_gpus} on this host (a daemon started by the trainer runs on rank 0's host): "
                              "start one daemon per host yourself and pass --vllm.endpoint")
        mine = list(range(engine_gpus))
    else:
        if trainer_gpus + engine_gpus > visible:
            raise ConfigError(f"the rollout engines need {engine_gpus} GPU(s) of their own beside the trainer's "
                              f"{trainer_gpus} on this host, which has {visible}: pass --train.colocate_all (engines "
                              "on the trainer's GPUs), or --vllm.endpoint of a daemon started elsewhere")
        mine = list(range(trainer_gpus, trainer_gpus + engine_gpus))
    if mask is None:
        return tuple(mine)
    try:
        ids = [int(e) for e in mask.split(",") if e.strip()]
    except ValueError:
        raise ConfigError(f"CUDA_VISIBLE_DEVICES={mask!r} names GPUs by UUID, which --gpu_ids cannot: start the "
                          "rollout daemon yourself with its --gpu_ids and pass --vllm.endpoint") from None
    return tuple(ids[i] for i in mine)


def daemon_spec(cfg: Any) -> DaemonSpec:
    """The daemon a ``PPOConfig`` asks for (its ``--vllm.*``, the actor's weights, the trainer's dtype); pure."""
    v = cfg.vllm
    return DaemonSpec(model=cfg.actor.model_name_or_path, engines=v.num_engines, backend=v.backend,
                      tensor_parallel_size=v.tensor_parallel_size, dtype=DTYPES[cfg.ds.param_dtype],
                      max_model_len=cfg.max_len, gpu_memory_utilization=v.gpu_memory_utilization,
                      enable_prefix_caching=v.enable_prefix_caching, enforce_eager=v.enforce_eager,
                      enable_sleep=v.enable_sleep, seed=cfg.train.seed,
                      max_lora_rank=lora_rank_served(cfg.ds.lora.rank) if v.sync_adapters else 0)


def lora_rank_served(rank: int) -> int:
    """The smallest LoRA rank vLLM serves (its ``max_lora_rank`` values) that holds ``rank``."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(spec: DaemonSpec, endpoint: str) -> list[str]:
    """``treadle-rollout serve`` flags for ``spec`` (pure)."""
    args = ["--model", spec.model, "--engines", str(spec.engines), "--backend", spec.backend,
            "--endpoint", endpoint, "--engine.dtype", spec.dtype, "--engine.max_model_len", str(spec.max_model_len),
            "--engine.seed", str(spec.seed),
            "--engine.gpu_memory_utilization", str(spec.gpu_memory_utilization)]
    if spec.gpu_ids:
        args += ["--gpu_ids", *map(str, spec.gpu_ids)]
        if spec.backend == "hf":
            args += ["--engine.device", "cuda"]
    if spec.backend == "vllm":
        args += ["--tensor_parallel_size", str(spec.tensor_parallel_size)]
        args.append("--engine.enable_prefix_caching" if spec.enable_prefix_caching else "--engine.no_enable_prefix_caching")
        if spec.enforce_eager:
            args.append("--engine.enforce_eager")
        if spec.enable_sleep:
            args.append("--engine.enable_sleep_mode")
        if spec.max_lora_rank:
            args += ["--engine.max_lora_rank", str(spec.max_lora_rank)]
    return args


class OwnedDaemon:
    """A ``treadle-rollout serve`` child process; ``stop`` ends it and its engines."""

    def __init__(self, spec: DaemonSpec, *, start_timeout_s: float = 900.0) -> None:
        self.endpoint = f"tcp://127.0.0.1:{_free_port()}"
        # --exit_with_pid: the daemon lives in a session of its own (a Ctrl-C at the trainer's terminal is
        # the trainer's to handle), so it must notice a trainer killed hard by itself
        cmd = [sys.executable, "-m", "treadle.rollout", "serve", *serve_args(spec, self.endpoint),
               "--exit_with_pid", str(os.getpid())]
        log.info("starting rollout daemon", extra={"fields": {"cmd": " ".join(cmd)}})
        self.proc = subprocess.Popen(cmd, env=env.child_env(), start_new_session=True, stdin=subprocess.DEVNULL)
        self.start_timeout_s = start_timeout_s

    def wait_ready(self, client: object) -> float:
        """Block until every engine serves (through ``client``, a SyncRolloutClient); seconds waited."""
        start = time.perf_counter()
        deadline = start + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ConfigError(f"the rollout daemon exited with status {self.proc.returncode} while starting "
                                  "(its log is above); check --vllm.* and the model folder")
            try:
                client.wait_ready(timeout=5.0)
                return time.perf_counter() - start
            except TimeoutError:
                if time.perf_counter() > deadline:
                    self.stop()
                    raise TimeoutError(f"rollout daemon not ready within {self.start_timeout_s:g} s") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
