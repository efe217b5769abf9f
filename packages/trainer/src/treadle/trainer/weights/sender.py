"""The trainer's weight sender: every rank gathers, rank 0 sends, the rollout daemon acknowledges.

    sender = WeightSender(engine, config=SenderConfig(dtype="bfloat16"),
                          client=rollout_client if is_main else None, zero_stage=3, is_main=is_main)
    report = sender.sync(version)   # on every rank, after the optimizer step
    sender.close()

``sync`` is a collective over the trainer's ranks. With the collective transport, per version:

1. every rank lists the tensors (``gather.plan``) and, if a canary prompt is configured, scores
   it (a forward pass: collective under ZeRO-3);
2. rank 0 announces the update (joining the weight group first when it has none); the daemon
   accepts it in the background. Rank 0 waits for the acceptance, rejoining once when the
   daemon answers ``WeightGroupStale`` (its membership changed) or has no group (it restarted).
   A refusal ends the sync on every rank before anything is gathered (a one-element all-reduce
   tells the other ranks);
3. every rank walks the buckets (ZeRO-3 gathers one bucket's partitions at a time); rank 0
   packs each bucket into one of two buffers while a background thread broadcasts the other,
   so gathering bucket k+1 overlaps sending bucket k. With ``peer_reads`` (GPUs of one host)
   rank 0 copies the other ranks' partitions itself over CUDA IPC and the other ranks only wait
   for the outcome; rank 0 then starts packing while the daemon is still accepting (the two
   buffers fill before the first broadcast), and handles a refusal or a rejoin alone, walking
   again after a rejoin;
4. rank 0 waits for the daemon's answer; a second all-reduce shares the outcome; every rank
   returns a ``SyncReport`` or raises: rank 0 the daemon's typed error (``EnginesQuarantined``,
   ``BadRequest`` for a name or shape mismatch, ...), the other ranks an error of the same class
   pointing to rank 0's log, so that all ranks take the same branch.

The inline transport gathers alike but rank 0 keeps host copies and sends them inside the
``WeightUpdate`` (tests and tiny models: the message must fit the daemon's frame limit).

The cuda_ipc transport is for engines on rank 0's GPU (colocated): every rank gathers alike,
rank 0 packs every bucket into one GPU buffer (a full copy of the sent weights, kept for the
next sync), sends the buckets' CUDA IPC handles (``treadle.rollout.engine.ipc``) inside the
``WeightUpdate``, and leaves the buffer untouched until the daemon answered (the engines copy
from it and unmap it before they answer). No group, no broadcast. Where rank 0 holds every tensor
whole as sent (one ZeRO-3 rank, or ZeRO-0/1/2) nothing is packed: the engines copy from its
parameters' own storages (``ipc_pieces``), may keep them mapped (``ipc_keep``), and may answer
before their copies finished (``ipc_event``: rank 0's stream then waits on the CUDA IPC events
they answered with, so its next writes to the parameters come after the copies).

Armed syncs (``SenderConfig.arm``, synchronous RL): ``arm(version)`` after a rollout sends the
next update's header ahead (``RolloutClient.arm_weights``); the engines pause and wait on the
group's store. At ``sync(version)`` rank 0 signals them first (``WeightGroup.signal``: one store
message, straight to each engine's waiting thread) and broadcasts without waiting for the
daemon's acceptance; the update's request follows as usual and finishes the load (canary,
version). When the sync is not the armed one (another version, plan, bucket size or group, or
an engine did not arm) the engines are told to stand down and the sync goes the usual way. A
refusal after the signal (the pool changed meanwhile) drops the group, and the sync is done
again unarmed (every rank: ``ResendUnarmed``).

One sender per daemon: joining a group replaces the daemon's previous group.

Not here: what is sent and under which names (``gather``), rank 0's threads and the outcome
all-reduce (``transfer``), the group and the bucket layout
(``treadle.rollout.engine.group`` / ``weights``), loading weights (the engines).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import operator
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from treadle.common.config import ConfigError
from treadle.common.errors import BadRequest
from treadle.common.log import get_logger
from treadle.common.records import WeightUpdate
from treadle.rollout.client import WeightGroupStale
from treadle.rollout.engine.group import GroupSpec, WeightGroup
from treadle.rollout.engine.ipc import encode_buckets, share_storages
from treadle.rollout.engine.weights import bucket_ranges, plan_buckets, send_order
from treadle.trainer.weights.gather import (
    Item,
    Kept,
    Planner,
    bucket_bytes,
    gathered,
    host_copy,
    packed,
    prepare_pulls,
    prompt_logprobs,
)
from treadle.trainer.weights.peers import PeerReads
from treadle.trainer.weights.transfer import (
    ResendUnarmed,
    Transfer,
    WeightSyncFailed,
    outcome_group,
    raise_outcome,
    share_outcome,
)

log = get_logger(__name__)

__all__ = ["SenderConfig", "SyncReport", "WeightSender", "WeightSyncFailed"]

ENGINE_DTYPES = ("float32", "bfloat16", "float16", "float64")
EXACT_CANARY_TOL = 1e-3  # same dtype on both sides: logprobs agree to ~1e-5 (PLATFORM.md)
NARROWED_CANARY_TOL = 0.1  # an fp32 trainer vs a bf16 engine differ by ~5e-2 (PLATFORM.md)


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderConfig:
    """How the trainer sends its weights to the rollout engines."""

    transport: Literal["collective", "inline", "cuda_ipc"] = "collective"
    # a gloo/nccl group; tensors in the message; or CUDA IPC handles for engines on rank 0's GPU
    backend: Literal["gloo", "nccl"] = "gloo"  # the group's backend (collective)
    bucket_bytes: int = 256 << 20  # bytes per broadcast; 0: one tensor per broadcast (the baseline).
    # Rank 0 keeps about four buckets of memory between syncs: two send buffers, and two gather
    # grids or (peer reads) two staging buffers
    gather: Literal["coalesced", "per_parameter"] = "coalesced"  # ZeRO-3: one flat all-gather a bucket,
    # or DeepSpeed's GatheredParameters (the baseline; see ``gather``)
    dtype: str | None = None  # the engines' dtype ("bfloat16", ...); None: the trainer's parameter dtype
    lora: Literal["merged", "adapter"] = "merged"  # LoRA models: send W + scaling * B @ A under the base names
    host: str = "127.0.0.1"  # where rank 0 hosts the group's TCPStore (reachable from the engines)
    port: int = 0  # the TCPStore's port; 0: a free one, picked at each join
    timeout_s: float = 300.0  # joining, and each broadcast
    canary_token_ids: tuple[int, ...] = ()  # prompt whose logprobs the engines must reproduce; (): none
    canary_tolerance: float | None = None  # None: 1e-3, or 0.1 when ``dtype`` narrows the trainer's
    mode: Literal["wait", "abort"] = "wait"  # in-flight samples: finish on the old weights, or stop now
    # (partial rollout: the agents' sampler resumes them on the new weights)
    peer_reads: bool = True  # collective transport, ZeRO-3 on GPUs of one host: rank 0 copies the other
    # ranks' partitions itself over CUDA IPC (its copy engine; nothing runs on their GPUs, where an
    # engine may be receiving) instead of NCCL gathers, and packs while the daemon accepts; gathers
    # where it cannot, saying why once (``weights.peers``). On 2xH200: 13.6 ms against 22.3 ms a
    # 1.5B sync (docs/benchmarks.md)
    ramp: int = 0  # > 0: the first buckets are smaller, bucket_bytes / 2**ramp doubling up to bucket_bytes,
    # and tensors larger than a bucket are sent last, so that the first broadcast starts after packing a
    # few MB, not a full bucket (``plan_buckets``, ``send_order``); 0: full buckets in the model's order.
    # Off until measured on GPUs (docs/benchmarks.md, GPU weight sync, eighth run)
    ipc_in_place: bool = True  # cuda_ipc: when every tensor is a parameter as it lies in rank 0's memory
    # (no LoRA merge, the engines' dtype; ZeRO-0/1/2, or ZeRO-3 on one rank, whose partitions are the whole
    # tensors) the engines copy straight from that memory: nothing is packed (``_in_place``)
    ipc_keep: bool = True  # cuda_ipc in place: the engines keep rank 0's parameter memory mapped from one
    # sync to the next (their next load maps nothing); off when the trainer frees that memory between syncs
    # (--ds.enable_sleep: kept mapped, it could not be freed)
    ipc_event: bool = True  # cuda_ipc in place, kept: the engines answer once their copies are queued, each
    # with a CUDA IPC event recorded after them, and rank 0's stream waits on those events before anything
    # it runs next (the optimizer's writes): the copies overlap the answer's way back; off: the engines
    # answer once their copies are done
    direct: bool = True  # cuda_ipc: send the update straight to the engines' workers (this host, as cuda_ipc
    # is) and tell the daemon afterwards, sparing its front end's relay: two hops, ~0.9 ms on an H200 host
    # (``treadle.rollout.direct``); relayed where the workers cannot be reached from here
    header_reuse: bool = True  # cuda_ipc in place: name the update's header (``WeightUpdate.header_id``), so a
    # direct update leaves it out for the engines that keep it (338 tensors: ~24 KB, ~2,400 objects decoded)
    arm: bool = False  # collective transport, synchronous RL: arm the engines for the next sync after each
    # rollout (``WeightSender.arm``): they pause while the trainer trains and receive the first bucket on rank
    # 0's signal over the group's store, without waiting for the update's request to reach them

    def __post_init__(self) -> None:
        if self.transport not in ("collective", "inline", "cuda_ipc"):
            raise ConfigError(f"--transport must be collective, inline or cuda_ipc, got {self.transport!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"--backend must be gloo or nccl, got {self.backend!r}")
        if not 0 <= self.ramp <= 16:
            raise ConfigError(f"--ramp must be 0-16 (the first bucket is bucket_bytes / 2**ramp), got {self.ramp}")
        if self.bucket_bytes < 0:
            raise ConfigError(f"--bucket_bytes must be >= 0 (0: one tensor per broadcast), got {self.bucket_bytes}")
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(ENGINE_DTYPES)} (or unset), got {self.dtype!r}")
        if self.lora == "adapter":
            raise ConfigError("--lora adapter: the rollout engines load full weights only (no LoRA adapters "
                              "yet); use --lora merged, which sends W + scaling * B @ A under the base names")
        if self.lora != "merged":
            raise ConfigError(f"--lora must be merged or adapter, got {self.lora!r}")
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
    buckets: int  # broadcasts (collective) or 1 (inline)
    seconds: float  # the whole sync, canary included
    gather_seconds: float  # gathering and packing (waits for a free buffer excluded)
    send_seconds: float  # broadcasting (collective) or the inline request; 0 on ranks > 0
    accept_seconds: float = 0.0  # collective, rank 0: announcing the update until the daemon accepted it
    answer_seconds: float = 0.0  # collective, rank 0: the last byte sent until the daemon's answer (its load)
    updated: list[str]  # engine ids that loaded the version (rank 0; empty elsewhere)
    failed: list[str]  # engine ids that did not (rank 0; empty elsewhere)
    # rank 0: per engine that loaded it, seconds from the start of ``sync`` until the update
    # reached the daemon's front end (received) and the engine (called), its load started
    # (loading: drained, paused), ended (loaded) and the canary was checked (done); wall clocks
    # of two hosts, so only as good as their sync
    engine_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    # rank 0, seconds from the start of ``sync``: the kept plan checked (planned), and for an
    # in-place cuda_ipc sync the parameters' handles checked (placed) and the header made (headed)
    stamps: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class _Placed:
    """Rank 0, cuda_ipc in place: ``_in_place``'s answer for a plan, while its tensors' memory
    stays where it was (``ptrs``)."""

    items: list[Item]  # the plan
    zero: list[bool]  # per item: its tensor is a ZeRO-3 parameter (its memory: ds_tensor)
    sharded: list[torch.Tensor]  # those tensors
    whole: list[torch.Tensor]  # and the others
    ptrs: list[int] = field(default_factory=list)  # where that memory lay (sharded first)
    shared: tuple[list[bytes], list[tuple[int, int, int]]] | None = None  # handles and pieces, or None: pack
    header_id: str = ""  # the name of the header they make (``WeightUpdate.header_id``), new with them

    @classmethod
    def of(cls, items: list[Item], zero3: bool) -> _Placed:
        firsts = [it.sources[0] for it in items]
        zero = [zero3 and hasattr(p, "ds_id") for p in firsts]
        return cls(items=items, zero=zero, sharded=[p for p, z in zip(firsts, zero, strict=True) if z],
                   whole=[p for p, z in zip(firsts, zero, strict=True) if not z])

    def memory(self) -> list[torch.Tensor]:
        """Per item, the tensor holding its bytes on this rank."""
        return [it.sources[0].ds_tensor if z else it.sources[0] for it, z in zip(self.items, self.zero, strict=True)]


_DATA_PTR, _DS_TENSOR = torch.Tensor.data_ptr, operator.attrgetter("ds_tensor")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Arming:
    """Rank 0: the engines armed (or being armed) for the next sync by ``arm``."""

    version: int
    items: list[Item]  # the plan the header was made from
    buckets: tuple[int, int]  # its (bucket_bytes, ramp)
    group: WeightGroup  # the engines wait in this group
    answer: concurrent.futures.Future[Any]  # the daemon's ``arm_weights`` answer


@dataclass(frozen=True, slots=True)
class _Layout:
    """What a sync's header and buffers take from the plan (made once per kept plan)."""

    sizes: list[int]  # tensors per bucket
    largest: int  # bytes of the largest bucket
    total: int  # bytes of every bucket together
    nbytes: int  # bytes of the tensors (``total`` less the alignment padding)
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


class WeightSender:
    """Sends one trained model's weights to a rollout daemon, one version per ``sync``."""

    def __init__(self, model_or_engine: Any, *, config: SenderConfig, client: Any, zero_stage: int,
                 is_main: bool) -> None:
        """``model_or_engine``: a DeepSpeed engine or a plain (maybe peft-wrapped) module;
        ``client``: a ``SyncRolloutClient`` on rank 0 (None elsewhere)."""
        self.config = config
        self._module = model_or_engine.module if hasattr(model_or_engine, "zero_optimization_stage") else model_or_engine
        self._zero3, self._is_main, self._client = zero_stage == 3, is_main, client
        if is_main and client is None:
            raise ValueError("WeightSender on rank 0 needs the rollout client (client=None)")
        first = next(self._module.parameters(), None)
        if first is not None and hasattr(first, "ds_id") and not self._zero3:
            raise ValueError(f"the model's parameters are ZeRO-3 partitions but zero_stage={zero_stage}")
        self._dtype = getattr(torch, config.dtype) if config.dtype else None
        if config.transport == "cuda_ipc" and not torch.cuda.is_available():
            raise ConfigError("--transport cuda_ipc needs CUDA: the trainer's rank 0 shares GPU buffers with "
                              "engines on its GPU (use collective or inline without a GPU)")
        on_gpu = config.backend == "nccl" or config.transport == "cuda_ipc"
        self._device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self._group: WeightGroup | None = None
        self._buffers: list[torch.Tensor] = []
        self._stream: Any = None  # rank 0, GPU: the CUDA stream the broadcasts run on
        self._ipc_buffer: torch.Tensor | None = None
        self._ipc_shared: dict[int, tuple[Any, bytes]] = {}  # cuda_ipc in place: the storages shared, their handles
        self._placed: _Placed | None = None  # cuda_ipc in place: ``_in_place``'s answer, kept
        self._events: dict[bytes, Any] = {}  # the engines' CUDA IPC events by handle (``ipc_event``), opened
        self._outcomes: Any = False  # the gloo group outcomes are shared over; False: not made yet
        self._peers: PeerReads | None = None
        self._kept = Kept()  # rank 0's grids and views, from one sync to the next
        self._plan = Planner()  # the tensors to send, kept while the model's stay the same
        self._laid: dict[Any, tuple[list[Item], _Layout]] = {}  # (id(plan), bucket bytes) -> (plan, layout)
        self._ordered: dict[Any, tuple[list[Item], list[Item]]] = {}  # (id(plan), bucket bytes) -> (plan, in send order)
        self._coalesce = config.gather == "coalesced"
        self._arming: _Arming | None = None
        self._arm_refused = False  # the daemon cannot arm (its backend, or a keeper in the group): stop asking
        self._closed = False
        self._stamps: dict[str, float] = {}  # rank 0: this sync's own stamps (``_stamp``)

    # ------------------------------------------------------------------ public

    def sync(self, version: int) -> SyncReport:
        """Make the engines serve the model's current weights as ``version``; every rank calls it."""
        if self._closed:
            raise RuntimeError("WeightSender.sync after close()")
        start, wall = time.perf_counter(), time.time()
        self._stamps = {}
        items = self._in_send_order(self._plan(self._module, self._dtype))
        canary = self._canary()
        self._stamp("planned")
        run = {"inline": self._sync_inline, "cuda_ipc": self._sync_ipc}.get(self.config.transport, self._sync_collective)
        try:
            answer, buckets, gather_s, send_s, *phases = run(version, items, canary)
        except ResendUnarmed as e:  # on every rank alike (the outcome is shared)
            log.warning("resending weight version %d unarmed: %s", version, e.message)
            answer, buckets, gather_s, send_s, *phases = run(version, items, canary)
        answer = answer or {}
        report = SyncReport(version=version, tensors=len(items), bytes=self._layout(items).nbytes,
                            buckets=buckets, seconds=time.perf_counter() - start, gather_seconds=gather_s,
                            send_seconds=send_s, **(phases[0] if phases else {}), updated=list(answer.get("updated", [])),
                            failed=sorted(answer.get("failed", {})),
                            engine_seconds={engine: {k: round(t - wall, 6) for k, t in stamps.items()}
                                            for engine, stamps in answer.get("loads", {}).items()},
                            stamps={k: round(t - wall, 6) for k, t in self._stamps.items()})
        if self._is_main:
            log.info("weights sent", extra={"fields": {
                "version": version, "tensors": report.tensors, "mb": round(report.bytes / 1e6, 1),
                "buckets": buckets, "s": round(report.seconds, 3), "gather_s": round(gather_s, 3),
                "send_s": round(send_s, 3), "accept_s": round(report.accept_seconds, 3),
                "answer_s": round(report.answer_seconds, 3), "updated": report.updated, "failed": report.failed,
                "engine_s": report.engine_seconds, "stamps": report.stamps}})
        return report

    def arm(self, version: int) -> None:
        """Synchronous RL, after a rollout and before training: arm the engines for
        ``sync(version)`` (``SenderConfig.arm``, collective transport). They pause until that
        sync, so nothing may generate in between. Every rank may call it; rank 0 acts, without
        waiting for the daemon. A failure to arm is logged and that sync goes the usual way."""
        if not (self.config.arm and self.config.transport == "collective" and self._is_main) \
                or self._arm_refused or self._closed:
            return
        self._signal_armed(None, None)  # an arming no sync used: its engines stand down
        try:
            items = self._in_send_order(self._plan(self._module, self._dtype))
            if self._group is None:
                self._join()
            update = self._header(version, items, None, sizes=self._layout(items).sizes,
                                  group=self._group.spec.as_dict())
            answer = self._client.submit("arm_weights", update)
        except Exception as e:
            log.warning("could not arm the engines for weight version %d: %s", version, e)
            return
        self._arming = _Arming(version=version, items=items, buckets=(self.config.bucket_bytes, self.config.ramp),
                               group=self._group, answer=answer)

    def release(self) -> None:
        """Drop the memory kept from one sync to the next: the send buffers, the cuda_ipc buffer, the
        gathers' grids and views, and the peers' shares and mappings (which keep the partitions'
        storage alive). For a trainer about to offload its states while colocated engines generate
        (--ds.enable_sleep): kept, they would pin that GPU memory. Every rank calls it (each drops
        its own); the next sync makes them again (the peers' shares are exchanged anew)."""
        self._buffers, self._ipc_buffer, self._kept, self._ipc_shared, self._placed = [], None, Kept(), {}, None
        if self._peers is not None:
            self._peers.close()

    def close(self) -> None:
        """Leave the daemon's weight group (rank 0) and drop the buffers; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._group is not None and self._is_main:
            with contextlib.suppress(Exception):
                self._client.leave_weight_group()
        self._drop_group()
        self._buffers, self._ipc_buffer, self._ipc_shared, self._placed = [], None, {}, None
        if self._peers is not None:
            self._peers.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transports

    def _sync_collective(self, version: int, items: list[Item], canary: np.ndarray | None) -> tuple:
        sizes = self._layout(items).sizes
        transfer, err, announced, go = None, None, time.perf_counter(), False
        if self._is_main:
            try:
                go = self._signal_armed(version, items)
                transfer = self._announce(version, items, sizes, canary, early=go)
            except Exception as e:
                err = e
                if go:  # the engines went and wait for buckets that will not come: free them
                    self._drop_group()
        peers = self._pulls(items, sizes)  # collective; the daemon accepts meanwhile
        if peers is None:  # gathers: every rank learns that the daemon accepted before anyone gathers
            if transfer is not None:
                try:
                    transfer = self._accepted(transfer, version, items, sizes, canary)
                except Exception as e:
                    transfer, err = None, e
            raise_outcome(self._share(err), err, version)  # a refusal: nothing gathered anywhere
        # With peer reads the other ranks take no part in the walk (they wait for the outcome
        # below), so rank 0 packs while the daemon accepts, and handles a refusal alone.
        gather_s = self._produce(items, sizes, transfer, peers)
        if peers is not None and transfer is not None:
            try:
                accepted = self._accepted(transfer, version, items, sizes, canary)
            except Exception as e:
                transfer, err = None, e
            else:
                if accepted is not transfer:  # rejoined: nothing was sent, walk again
                    transfer = accepted
                    gather_s += self._produce(items, sizes, transfer, peers)
        answer = None
        if transfer is not None:
            answer, err = transfer.result()
            if transfer.sent < len(sizes):  # the members are out of step: rebuild before the next
                self._drop_group()
            if go and _needs_rejoin(err):  # refused after the engines went: rejoin, send again unarmed
                self._drop_group()
                err = ResendUnarmed(f"the daemon refused the armed update: {err.message}")
        raise_outcome(self._share(err), err, version)
        if transfer is None:
            return answer, len(sizes), gather_s, 0.0
        return answer, len(sizes), gather_s, transfer.send_seconds, {
            "accept_seconds": max(0.0, transfer.accepted_at - announced),
            "answer_seconds": max(0.0, transfer.answered_at - transfer.sent_at)}

    def _sync_inline(self, version: int, items: list[Item], canary: np.ndarray | None) -> tuple:
        sizes = self._layout(items).sizes
        tensors: list[torch.Tensor] = []
        start = time.perf_counter()
        if self._is_main or self._zero3:
            for lo, hi in gathered(items, sizes, zero3=self._zero3, keep=self._is_main, coalesce=self._coalesce,
                                   only_first=True):
                if self._is_main:
                    tensors.extend(host_copy(it) for it in items[lo:hi])
        gather_s, answer, err, send_s = time.perf_counter() - start, None, None, 0.0
        if self._is_main:
            start = time.perf_counter()
            try:
                answer = self._client.update_weights(self._header(version, items, canary, tensors=tensors),
                                                     mode=self.config.mode)
            except Exception as e:
                err = e
            send_s = time.perf_counter() - start
        raise_outcome(self._share(err), err, version)
        return answer, 1, gather_s, send_s

    def _sync_ipc(self, version: int, items: list[Item], canary: np.ndarray | None) -> tuple:
        placed = self._in_place(items)
        if placed is not None:
            self._stamp("placed")
            return self._sync_in_place(version, items, canary, placed)
        sizes = self._layout(items).sizes
        spans: list[tuple[int, int]] = []  # (offset, bytes) of each bucket in the buffer
        failed: list[Exception] = []  # a packing error: finish the walk (the other ranks' gathers), then fail
        start = time.perf_counter()
        if self._is_main or self._zero3:
            buffer = self._ipc_buffer_for(items) if self._is_main else None
            offsets = dict(zip(bucket_ranges(sizes, len(items)), _running(sizes, items), strict=True))

            def dest(lo: int, hi: int) -> torch.Tensor:
                spans.append((offsets[lo, hi], bucket_bytes(items[lo:hi])))
                return buffer[offsets[lo, hi]:]

            # gathers, not peer reads: no engine receives on the other ranks' GPUs here, and on 2xH200
            # the two took the same time (docs/benchmarks.md)
            for _ in packed(items, sizes, dest, zero3=self._zero3, main=self._is_main, coalesce=self._coalesce,
                            on_error=failed.append, kept=self._kept):
                pass
            if self._is_main:  # the engines read the buffer from other processes
                torch.cuda.current_stream().synchronize()
        gather_s, answer, err, send_s = time.perf_counter() - start, None, None, 0.0
        if self._is_main and failed:
            log.error("packing a weight bucket failed", exc_info=failed[0])
            err = failed[0]
        elif self._is_main:
            start = time.perf_counter()
            try:
                update = self._header(version, items, canary, sizes=sizes, handles=encode_buckets(self._ipc_buffer, spans))
                answer = self._client.update_weights(update, mode=self.config.mode, direct=self.config.direct)
            except Exception as e:
                err = e
            send_s = time.perf_counter() - start
        raise_outcome(self._share(err), err, version)
        return answer, len(sizes), gather_s, send_s

    def _in_place(self, items: list[Item]) -> _Placed | None:
        """cuda_ipc with ``ipc_in_place``, rank 0: the handles of the storages holding ``items``'
        bytes and each item's place in them (``share_storages``; ``_Placed.shared``, with the
        header's name), when every item is one parameter as it is (no LoRA merge, no 4-bit
        weight), in the sent dtype, contiguous on this GPU, and whole (not ZeRO-3 on several
        ranks, whose partitions are slices); else None: pack. Every rank gets the same answer
        where it matters: under ZeRO-3 this path needs one rank, and otherwise the other ranks do
        nothing. The answer is kept while the plan and the memory its tensors lie in stay the
        same (the checks and views cost ~10 us a tensor: 3 ms a sync on a 1.5B model)."""
        if not (self.config.ipc_in_place and self._is_main):
            return None
        if self._zero3 and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            return None
        placed = self._placed
        if placed is None or placed.items is not items:
            placed = _Placed.of(items, self._zero3)
        # where their memory lies now (map() with C getters: ~0.02 ms for 338 tensors)
        ptrs = list(map(_DATA_PTR, map(_DS_TENSOR, placed.sharded))) + list(map(_DATA_PTR, placed.whole))
        if placed is not self._placed or ptrs != placed.ptrs:
            placed.ptrs, placed.shared = ptrs, self._share_in_place(items, placed.memory())
            placed.header_id = os.urandom(8).hex()
            self._placed = placed
        return placed if placed.shared is not None else None

    def _share_in_place(self, items: list[Item], own: list[torch.Tensor]
                        ) -> tuple[list[bytes], list[tuple[int, int, int]]] | None:
        sources = []
        for it, t in zip(items, own, strict=True):
            if it.merge is not None or len(it.sources) != 1 or getattr(it.sources[0], "quant_state", None) is not None:
                return None
            n = math.prod(it.shape)
            if t.dtype != it.dtype or t.device != self._device or not t.is_contiguous() or t.numel() < n:
                return None
            sources.append(t.detach().view(-1)[:n])
        self._ipc_shared, handles, pieces = share_storages(sources, self._ipc_shared)
        return handles, pieces

    def _sync_in_place(self, version: int, items: list[Item], canary: np.ndarray | None, placed: _Placed) -> tuple:
        """The cuda_ipc sync with nothing packed: rank 0 sends the storages of its parameters
        (shared once, while they stay where they are: ``placed``) and each tensor's place in them;
        the engines copy from there and unmap before they answer, and the parameters are not
        touched until then (``sync`` returns first); or, kept mapped and answering early
        (``ipc_event``), this rank's stream waits for their copies (``_wait_events``)."""
        start = time.perf_counter()
        torch.cuda.current_stream().synchronize()  # the optimizer's writes are done before another process reads
        answer, err = None, None
        try:
            keep = self.config.ipc_keep
            handles, pieces = placed.shared
            update = self._header(version, items, canary, handles=handles, pieces=pieces, keep=keep,
                                  event=keep and self.config.ipc_event,
                                  header_id=placed.header_id if self.config.header_reuse else "")
            self._stamp("headed")
            gather_s = time.perf_counter() - start
            answer = self._client.update_weights(update, mode=self.config.mode, direct=self.config.direct)
            self._wait_events(answer.get("events", {}))
        except Exception as e:
            err, gather_s = e, time.perf_counter() - start
        send_s = time.perf_counter() - start - gather_s
        raise_outcome(self._share(err), err, version)
        return answer, 1, gather_s, send_s

    def _stamp(self, name: str) -> None:
        """Rank 0: when this sync reached ``name`` (wall clock, as the engines' stamps)."""
        if self._is_main:
            self._stamps[name] = time.time()

    def _wait_events(self, events: dict[str, bytes]) -> None:
        """Make this rank's current stream wait for each engine's copies (their CUDA IPC events,
        opened once per handle: an engine records the same event at every load)."""
        stream = torch.cuda.current_stream(self._device)
        for handle in events.values():
            event = self._events.get(handle)
            if event is None:
                if len(self._events) >= 64:  # engines restarted many times: forget the old ones
                    self._events.clear()
                event = self._events[handle] = torch.cuda.Event.from_ipc_handle(self._device, handle)
            stream.wait_event(event)

    def _produce(self, items: list[Item], sizes: list[int], transfer: Transfer | None,
                 peers: PeerReads | None = None) -> float:
        """Walk the buckets (every rank under ZeRO-3, else rank 0 only; with ``peers``, prepared,
        rank 0 reads the other ranks' partitions); rank 0 packs each into a free buffer for
        ``transfer``. Returns the seconds spent, waits for a buffer excluded."""
        if not (self._is_main or self._zero3):
            return 0.0
        start, waited = time.perf_counter(), 0.0
        state = {"stopped": transfer is None, "buffer": None}

        def dest(lo: int, hi: int) -> torch.Tensor | None:
            nonlocal waited
            if state["stopped"]:  # gather anyway: the other ranks' gathers need this rank
                return None
            t = time.perf_counter()
            state["buffer"] = transfer.buffer()
            waited += time.perf_counter() - t
            state["stopped"] = state["buffer"] is None
            return state["buffer"]

        def failed(e: Exception) -> None:
            log.error("packing a weight bucket failed", exc_info=e)
            transfer.fail(e)
            state["stopped"] = True

        for _, _, flat in packed(items, sizes, dest, zero3=self._zero3, main=self._is_main, coalesce=self._coalesce,
                                 on_error=failed, peers=peers, kept=self._kept):
            if flat is not None:
                transfer.put(flat, state["buffer"])  # GPU: the broadcast waits for the copies
        return time.perf_counter() - start - waited

    # ------------------------------------------------------------------ rank 0: the daemon

    def _announce(self, version: int, items: list[Item], sizes: list[int], canary: np.ndarray | None,
                  early: bool = False) -> Transfer:
        """Send the update's header (joining the group first when there is none); the daemon
        accepts in the background (``_accepted``). ``early``: the engines were signalled, the
        broadcasts start without the acceptance."""
        buffers = self._buffers_for(items)
        if self._group is None:
            self._join()
        update = self._header(version, items, canary, sizes=sizes, group=self._group.spec.as_dict())
        if self._stream is None and buffers and buffers[0].is_cuda:
            self._stream = torch.cuda.Stream(buffers[0].device)  # made once: the broadcasts' stream
        return Transfer(self._client, update, self._group, len(sizes), buffers, self.config.mode, self._stream,
                        early=early)

    def _signal_armed(self, version: int | None, items: list[Item] | None) -> bool:
        """Rank 0: tell the engines armed by ``arm`` to go, when this sync is the one they armed
        for (same version, plan, bucket size and group; every member armed), else to stand down.
        True: they went."""
        arming, self._arming = self._arming, None
        if arming is None:
            return False
        try:
            answer = arming.answer.result(timeout=self.config.timeout_s)
        except Exception as e:
            if isinstance(e, BadRequest) and "cannot arm" in e.message:
                self._arm_refused = True  # every arm would be refused alike
            log.warning("the engines were not armed for weight version %d: %s", arming.version, e)
            return False
        if answer.get("failed"):
            log.warning("engines not armed for weight version %d: %s", arming.version, answer["failed"])
        go = (not answer.get("failed") and arming.version == version and arming.items is items
              and arming.buckets == (self.config.bucket_bytes, self.config.ramp) and arming.group is self._group)
        if arming.group is self._group:  # else the engines left that group, which disarmed them
            try:
                self._group.signal(arming.version, go)
            except Exception as e:
                log.warning("could not signal the armed engines: %s", e)
                return False
        return go

    def _accepted(self, transfer: Transfer, version: int, items: list[Item], sizes: list[int],
                  canary: np.ndarray | None) -> Transfer:
        """``transfer`` once the daemon accepted it; refused as stale (or without a group),
        announced again once after rejoining (a new ``Transfer``); any other refusal raised."""
        rejoined = False
        while not transfer.wait_accepted():
            _, err = transfer.result()
            if rejoined or not _needs_rejoin(err):
                raise err or WeightSyncFailed("the daemon answered the weight update without accepting it")
            log.warning("the daemon's weight group is not ours any more; rejoining",
                        extra={"fields": {"reason": err.message}})
            self._drop_group()
            transfer, rejoined = self._announce(version, items, sizes, canary), True
        return transfer

    def _join(self) -> None:
        cfg = self.config
        port = cfg.port or _free_port(cfg.host)
        joined, group = self._client.join_weight_group(cfg.host, port, backend=cfg.backend, timeout_s=cfg.timeout_s,
                                                       sender=_make_group)
        if group is None:
            raise WeightSyncFailed("the daemon joined the weight group, but the sender's side was not built")
        self._group = group
        log.info("joined the rollout weight group", extra={"fields": {
            "endpoint": f"{cfg.host}:{port}", "world_size": joined.get("world_size"), "members": joined.get("members")}})

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()

    def _header(self, version: int, items: list[Item], canary: np.ndarray | None, *, sizes: list[int] = (),
                group: dict[str, Any] | None = None, tensors: list[torch.Tensor] = (),
                handles: list[bytes] = (), pieces: list[tuple[int, int, int]] = (), keep: bool = False,
                event: bool = False, header_id: str = "") -> WeightUpdate:
        extra: dict[str, Any] = {}
        if canary is not None:
            extra = {"canary_token_ids": np.asarray(self.config.canary_token_ids, dtype=np.int32),
                     "canary_logprobs": canary, "canary_tolerance": self._canary_tolerance(items)}
        laid = self._layout(items)  # its lists are shared from one header to the next: never changed
        return WeightUpdate(version=version, names=laid.names, dtypes=laid.dtypes, shapes=laid.shapes,
                            transport=self.config.transport,
                            bucket_sizes=list(sizes), group=group or {}, tensors=list(tensors),
                            ipc_handles=list(handles), ipc_pieces=list(pieces), ipc_keep=keep, ipc_event=event,
                            header_id=header_id, **extra)

    def _layout(self, items: list[Item]) -> _Layout:
        """``items``' buckets and header lists, made once per plan (the kept plan is the same
        list from one sync to the next) and bucket size and ramp; a few are kept (a sender whose bucket
        size changes back and forth, as the GPU bench's does, does not remake them)."""
        key = (id(items), self.config.bucket_bytes, self.config.ramp)
        if key not in self._laid:
            if len(self._laid) >= 4:  # older plans (a new plan is a new list) or bucket sizes
                self._laid = {}
            sizes = plan_buckets([it.nbytes for it in items], self.config.bucket_bytes, self.config.ramp)
            per = [bucket_bytes(items[lo:hi]) for lo, hi in bucket_ranges(sizes, len(items))]
            laid = _Layout(sizes=sizes, largest=max(per, default=0), total=sum(per),
                           nbytes=sum(it.nbytes for it in items), names=[it.name for it in items],
                           dtypes=[it.dtype_name for it in items], shapes=[list(it.shape) for it in items])
            self._laid[key] = (items, laid)  # holding the plan: its id is not handed out again meanwhile
        return self._laid[key][1]

    def _in_send_order(self, planned: list[Item]) -> list[Item]:
        """``planned`` reordered by ``send_order`` (with ``ramp``), as one list kept per plan and
        bucket size: the same object from one sync to the next while the plan is kept, as the
        layouts and the armed check want."""
        if not self.config.ramp:
            return planned
        key = (id(planned), self.config.bucket_bytes)
        kept = self._ordered.get(key)
        if kept is None or kept[0] is not planned:
            if len(self._ordered) >= 4:
                self._ordered = {}
            order = send_order([it.nbytes for it in planned], self.config.bucket_bytes)
            kept = (planned, planned if order == sorted(order) else [planned[i] for i in order])
            self._ordered[key] = kept  # holding the plan: its id is not handed out again meanwhile
        return kept[1]

    def _buffers_for(self, items: list[Item]) -> list[torch.Tensor]:
        """Two buffers, each large enough for the largest bucket (kept for the next sync)."""
        need = self._layout(items).largest
        if len(self._buffers) != 2 or self._buffers[0].numel() < need:
            pin = self._device.type == "cpu" and torch.cuda.is_available()  # faster copies from the GPU
            self._buffers = []
            self._kept.clear()  # views into the old buffers go with them
            self._buffers = [torch.empty(need, dtype=torch.uint8, device=self._device, pin_memory=pin)
                             for _ in range(2)]
        return self._buffers

    def _share(self, err: BaseException | None) -> int:
        """``share_outcome`` over a CPU group, made at the first sync (every rank is there)."""
        return share_outcome(err, self._cpu_group())

    def _cpu_group(self) -> Any:
        """``outcome_group()``, made once (a collective: at a sync, where every rank is)."""
        if self._outcomes is False:
            self._outcomes = outcome_group()
        return self._outcomes

    def _pulls(self, items: list[Item], sizes: list[int]) -> PeerReads | None:
        """This sender's ``PeerReads``, prepared for this sync, when rank 0 reads the other ranks'
        partitions itself (``gather.prepare_pulls``: a collective, the same answer on every rank)."""
        if not (self.config.peer_reads and self._zero3 and self._coalesce):
            return None
        if self._peers is None:
            self._peers = PeerReads(self._cpu_group())  # None: the default group runs on the CPU already
        pull = prepare_pulls(items, sizes, self._peers, zero3=True, main=self._is_main, kept=self._kept)
        return self._peers if pull else None

    def _ipc_buffer_for(self, items: list[Item]) -> torch.Tensor:
        """One GPU buffer holding every bucket back to back (kept for the next sync)."""
        need = self._layout(items).total
        if self._ipc_buffer is None or self._ipc_buffer.numel() < need:
            self._ipc_buffer = None  # free the old one first (a full model copy), and the views into it
            self._kept.clear()
            self._ipc_buffer = torch.empty(need, dtype=torch.uint8, device=self._device)
        return self._ipc_buffer

    # ------------------------------------------------------------------ every rank

    def _canary(self) -> np.ndarray | None:
        if not self.config.canary_token_ids or not (self._is_main or self._zero3):
            return None
        return prompt_logprobs(self._module, self.config.canary_token_ids)

    def _canary_tolerance(self, items: list[Item]) -> float:
        if self.config.canary_tolerance is not None:
            return self.config.canary_tolerance
        narrowed = any(it.dtype.itemsize < it.sources[0].dtype.itemsize for it in items)
        return NARROWED_CANARY_TOL if narrowed else EXACT_CANARY_TOL

def _needs_rejoin(err: BaseException | None) -> bool:
    """Stale (the pool's membership changed), or no group at all (the daemon restarted, or
    another sender made it leave ours); either way nothing was broadcast."""
    return isinstance(err, WeightGroupStale) or (isinstance(err, BadRequest) and err.message.startswith("no weight group"))


def _make_group(spec: dict[str, Any]) -> WeightGroup:
    """The sender's side (rank 0) of the group the daemon accepted (runs in the client's thread)."""
    return WeightGroup(GroupSpec(**spec))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _running(sizes: list[int], items: list[Item]) -> list[int]:
    """Byte offset of each bucket when they lie back to back (the cuda_ipc buffer)."""
    out, offset = [], 0
    for lo, hi in bucket_ranges(sizes, len(items)):
        out.append(offset)
        offset += bucket_bytes(items[lo:hi])
    return out
