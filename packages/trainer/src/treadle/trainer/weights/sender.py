"""The trainer's weight sender: every rank gathers, rank 0 sends, the rollout daemon acknowledges.

    sender = WeightSender(engine, config=SenderConfig(dtype="bfloat16"),
                          client=rollout_client if is_main else None, zero_stage=3, is_main=is_main)
    report = sender.sync(version)   # on every rank, after the optimizer step
    sender.release()                # optional: free the kept buffers (before offloading states)
    sender.close()

``sync`` is a collective over the trainer's ranks, in three steps: *plan* (``plan.plan``: which
tensors, under which names, in which dtype; with ``adapters``, ``plan.adapter_plan``: a LoRA
model's adapter alone, which the engines serve on their base weights; the canary's logprobs if one is configured, a
forward pass that is a collective under ZeRO-3), *send* (the transport: ``collective`` over a
gloo / NCCL group, ``cuda_ipc`` for engines on rank 0's GPU (or on every rank's), ``inline`` for tests and tiny
models; each walks the buckets, gathering ZeRO-3 partitions one bucket at a time), *report*
(``SyncReport``). Rank 0's outcome is shared, so every rank returns or raises alike: rank 0 the
daemon's typed error (``EnginesQuarantined``, ``WeightMismatch`` for a name or shape mismatch,
...), the others an error of the same class pointing to rank 0's log.

Not here: what is sent (``plan``), gathering (``gather``), each transport's protocol (its module),
and anything of the receiving side (``treadle.rollout``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from treadle.common.config import ConfigError
from treadle.common.errors import EngineDead
from treadle.common.log import get_logger
from treadle.common.weights import plan_buckets
from treadle.trainer.weights.collective import Collective
from treadle.trainer.weights.cuda_ipc import CudaIpc
from treadle.trainer.weights.inline import Inline
from treadle.trainer.weights.outcome import Rank, WeightSyncFailed
from treadle.trainer.weights.plan import Item, adapter_plan, plan, prompt_logprobs

log = get_logger(__name__)

__all__ = ["SenderConfig", "SyncReport", "WeightSender", "WeightSyncFailed"]

ENGINE_DTYPES = ("float32", "bfloat16", "float16", "float64")
EXACT_CANARY_TOL = 1e-3  # same dtype on both sides: logprobs agree to ~1e-5 (PLATFORM.md)
ENGINE_BACK_S = 600.0  # a sync that reached no engine waits this long for one to be ready again
NARROWED_CANARY_TOL = 0.1  # an fp32 trainer vs a bf16 engine differ by ~5e-2 (PLATFORM.md)


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderConfig:
    """How the trainer sends its weights to the rollout engines."""

    transport: Literal["collective", "inline", "cuda_ipc"] = "collective"
    backend: Literal["gloo", "nccl"] = "gloo"  # the collective transport's group
    bucket_bytes: int = 256 << 20  # bytes per bucket; 0: one tensor per bucket
    dtype: str | None = None  # the engines' dtype ("bfloat16", ...); None: the trainer's parameter dtype
    mode: Literal["wait", "abort"] = "wait"  # in-flight samples: finish on the old weights, or stop now
    canary_token_ids: tuple[int, ...] = ()  # prompt whose logprobs the engines must reproduce; (): none
    canary_tolerance: float | None = None  # None: 1e-3, or 0.1 when ``dtype`` narrows the trainer's
    host: str = "127.0.0.1"  # collective: where rank 0 hosts the group's TCPStore (reachable from the engines)
    port: int = 0  # collective: the TCPStore's port; 0: a free one, picked at each join
    timeout_s: float = 300.0  # collective: joining, and each broadcast
    adapters: bool = False  # send the LoRA adapter alone (``plan.adapter_plan``), not the merged model
    ipc_every_rank: bool = False  # cuda_ipc: every rank shares a copy on its GPU (engines on all of them)

    def __post_init__(self) -> None:
        if self.transport not in ("collective", "inline", "cuda_ipc"):
            raise ConfigError(f"--transport must be collective, inline or cuda_ipc, got {self.transport!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"--backend must be gloo or nccl, got {self.backend!r}")
        if self.bucket_bytes < 0:
            raise ConfigError(f"--bucket_bytes must be >= 0 (0: one tensor per bucket), got {self.bucket_bytes}")
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(ENGINE_DTYPES)} (or unset), got {self.dtype!r}")
        if self.mode not in ("wait", "abort"):
            raise ConfigError(f"--mode must be wait or abort, got {self.mode!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be a TCP port or 0 (pick a free one), got {self.port}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout_s must be > 0, got {self.timeout_s}")
        if self.canary_token_ids and (len(self.canary_token_ids) < 2 or min(self.canary_token_ids) < 0):
            raise ConfigError(f"--canary_token_ids needs >= 2 token ids >= 0, got {list(self.canary_token_ids)}")
        if self.canary_tolerance is not None and not self.canary_tolerance > 0:
            raise ConfigError(f"--canary_tolerance must be > 0, got {self.canary_tolerance}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncReport:
    """What one ``sync`` did (timings are this rank's)."""

    version: int  # the weight version the engines now serve
    tensors: int  # tensors sent
    bytes: int  # bytes of those tensors, in the sent dtypes
    buckets: int  # buckets walked (broadcasts, for the collective transport)
    seconds: float  # the whole sync, canary included
    gather_seconds: float  # gathering and packing (waits for a free buffer excluded)
    send_seconds: float  # broadcasting (collective) or the daemon's call (inline, cuda_ipc); 0 on ranks > 0
    updated: list[str]  # engine ids that loaded the version (rank 0; empty elsewhere)
    failed: list[str]  # engine ids that did not (rank 0; empty elsewhere)
    # rank 0: per engine that loaded it, seconds from the start of ``sync`` to each stamp of its
    # load (``Engine.last_load``: called, loading, loaded, done); wall clocks of two processes
    engine_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    # rank 0: the largest canary gap (max |logprob difference|, engine vs sender) over the engines
    # that loaded it; None: no canary sent (a gap over the tolerance fails the sync instead)
    canary_gap: float | None = None


class WeightSender:
    """Sends one trained model's weights to a rollout daemon, one version per ``sync``."""

    def __init__(self, model_or_engine: Any, *, config: SenderConfig, client: Any, zero_stage: int,
                 is_main: bool) -> None:
        """``model_or_engine``: a DeepSpeed engine or a plain (maybe peft-wrapped) module;
        ``client``: a ``SyncRolloutClient`` on rank 0 (None elsewhere)."""
        self.config = config
        self._module = model_or_engine.module if hasattr(model_or_engine, "zero_optimization_stage") else model_or_engine
        if is_main and client is None:
            raise ValueError("WeightSender on rank 0 needs the rollout client (client=None)")
        first = next(self._module.parameters(), None)
        if first is not None and hasattr(first, "ds_id") and zero_stage != 3:
            raise ValueError(f"the model's parameters are ZeRO-3 partitions but zero_stage={zero_stage}")
        self._dtype = getattr(torch, config.dtype) if config.dtype else None
        on_gpu = config.backend == "nccl" or config.transport == "cuda_ipc"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu and torch.cuda.is_available() \
            else torch.device("cpu")
        self._rank = Rank(zero3=zero_stage == 3, main=is_main, client=client, device=device, mode=config.mode)
        if config.transport == "collective":
            self._transport: Any = Collective(self._rank, backend=config.backend, host=config.host, port=config.port,
                                              timeout_s=config.timeout_s)
        elif config.transport == "cuda_ipc":
            self._transport = CudaIpc(self._rank, every_rank=config.ipc_every_rank)
        else:
            self._transport = Inline(self._rank)
        self._closed = False

    def sync(self, version: int) -> SyncReport:
        """Make the engines serve the model's current weights as ``version``; every rank calls it."""
        if self._closed:
            raise RuntimeError("WeightSender.sync after close()")
        start, wall = time.perf_counter(), time.time()
        adapter = None
        if self.config.adapters:
            items, adapter = adapter_plan(self._module, self._dtype)
        else:
            items = plan(self._module, self._dtype)
        sizes = plan_buckets([it.nbytes for it in items], self.config.bucket_bytes)
        header = {"version": version, "names": [it.name for it in items], "dtypes": [it.dtype_name for it in items],
                  "shapes": [list(it.shape) for it in items], "adapter": adapter, **self._canary(items)}
        sent = self._send(header, items, sizes)
        answer = sent.answer
        report = SyncReport(version=version, tensors=len(items), bytes=sum(it.nbytes for it in items),
                            buckets=sent.buckets, seconds=time.perf_counter() - start,
                            gather_seconds=sent.gather_seconds, send_seconds=sent.send_seconds,
                            updated=list(answer.get("updated", [])), failed=sorted(answer.get("failed", {})),
                            engine_seconds={engine: {k: round(t - wall, 6) for k, t in stamps.items()}
                                            for engine, stamps in answer.get("loads", {}).items()},
                            canary_gap=max(answer["canary"].values()) if answer.get("canary") else None)
        if self._rank.main:
            log.info("weights sent", extra={"fields": {
                "version": version, "tensors": report.tensors, "mb": round(report.bytes / 1e6, 1),
                "buckets": report.buckets, "s": round(report.seconds, 3), "gather_s": round(report.gather_seconds, 3),
                "send_s": round(report.send_seconds, 3), "updated": report.updated, "failed": report.failed,
                "engine_s": report.engine_seconds, "canary_gap": report.canary_gap}})
        return report

    def _send(self, header: dict[str, Any], items: list[Item], sizes: list[int]) -> Any:
        """The transport's send, once more when every engine it went to died under it (a node
        lost mid-sync: ``EngineDead``, raised alike on every rank): rank 0 first waits up to
        ``ENGINE_BACK_S`` for an engine to be ready again (a restart, a replacement)."""
        try:
            return self._transport.send(header, items, sizes)
        except EngineDead as e:
            log.warning("weight sync of version %d reached no engine (%s): sending it again once an engine is back",
                        header["version"], e)
            if self._rank.main:
                self._rank.client.wait_ready(ENGINE_BACK_S, 1)
            return self._transport.send(header, items, sizes)

    def release(self) -> None:
        """Drop the memory kept from one sync to the next (send buffers, the cuda_ipc buffer), e.g.
        before the trainer offloads its states while colocated engines generate; the next sync
        makes them again. Every rank may call it."""
        self._transport.release()

    def close(self) -> None:
        """Leave the daemon's weight group (rank 0) and drop the buffers; idempotent."""
        if not self._closed:
            self._closed = True
            self._transport.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _canary(self, items: list[Item]) -> dict[str, Any]:
        """The update's canary fields: the prompt, the module's logprobs for it, the tolerance
        (every rank scores it under ZeRO-3: a forward is a collective there)."""
        cfg = self.config
        if not cfg.canary_token_ids or not self._rank.walks:
            return {}
        tolerance = cfg.canary_tolerance
        if tolerance is None:
            narrowed = any(it.dtype.itemsize < it.sources[0].dtype.itemsize for it in items)
            tolerance = NARROWED_CANARY_TOL if narrowed else EXACT_CANARY_TOL
        return {"canary_token_ids": np.asarray(cfg.canary_token_ids, dtype=np.int32),
                "canary_logprobs": prompt_logprobs(self._module, cfg.canary_token_ids),
                "canary_tolerance": tolerance}
