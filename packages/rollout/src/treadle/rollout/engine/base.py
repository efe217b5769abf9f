"""The rollout engine interface (one engine per process in the daemon) and what backends share.

An ``Engine`` is token in, token out: ``generate`` takes a ``GenerateRequest`` and yields one
``GenerateResult`` per sample as each finishes, with the sampled tokens' logprobs under the
sampling distribution (temperature, top-k, top-p applied) and the weight version that produced
every one of its tokens. Weights change only through ``update_weights`` (an ``InlineWeights``
with its tensors, or an ``IpcWeights`` with the CUDA IPC handles of a colocated sender's GPU
buckets) or ``receive_weights`` (a ``CollectiveWeights``: its buckets broadcast over a group
joined with ``join_weight_group``).

Shared here, so every backend behaves alike:
- an admission gate, closed during weight loads and sleep: a request waits at the gate, then
  runs entirely on the version current when it passed it (in-flight samples either finish on
  the old version first, ``mode="wait"``, or are aborted, ``mode="abort"``; never mixed);
- the checks that refuse a bad update before the model is touched (``weights.WeightSpec``),
  monotonic versions, the canary, and the "broken" state after a failed load or canary;
- request validation, per-sample accounting and ``stats()``.

An update may instead carry a LoRA adapter (``WeightUpdate.adapter``): checked against the
tensors such an adapter needs (``weights.adapter_spec``), carried by the same transports and
hooks, served on top of the base weights (``_check_adapter`` says whether a backend can).

Each backend receives weights through one set of hooks, one per transport: ``_load`` (inline),
``_check_ipc`` / ``_load_ipc`` (cuda_ipc), ``_join_group`` / ``_receive`` / ``_discard`` /
``_leave_group`` (collective).

Sampling contract: sample ``i`` of a request with ``seed=s`` uses seed ``s + i`` (vLLM's rule);
greedy (``temperature == 0``) logprobs are the plain ``log_softmax`` of the logits; with
``top_logprobs = k`` a result also carries, per token, the k most likely tokens of that same
distribution and their logprobs (``[R, k]``, most likely first). A sample ends
with "stop" on a token of ``stop_token_ids`` or of the engine's EOS ids (never before
``min_tokens``; the stop token is kept), with "length" at ``max_tokens`` (a request whose
prompt + ``max_tokens`` exceeds the engine's ``max_model_len`` is refused up front).

What this module does not do: transport, routing, failover (the daemon), or import torch/vLLM.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, ClassVar, Literal

import numpy as np

from treadle.common.errors import (
    BadRequest,
    Busy,
    CanaryMismatch,
    EngineDead,
    NoWeightGroup,
    ServiceClosed,
)
from treadle.common.log import get_logger
from treadle.common.records import (
    CollectiveWeights,
    GenerateRequest,
    GenerateResult,
    InlineWeights,
    IpcWeights,
    LoraAdapter,
    WeightGroupSpec,
    WeightUpdate,
)
from treadle.rollout.engine.state import RATE_WINDOW_S, EngineStats, Rate, SleepState
from treadle.rollout.engine.weights import (
    FLOAT_DTYPES,
    WeightSpec,
    adapter_spec,
    as_tensor,
    canary_error,
    canary_gap,
)

log = get_logger(__name__)
PauseMode = Literal["wait", "abort"]


class Engine(ABC):
    """One rollout engine; subclasses implement the ``_``-prefixed hooks below."""

    backend: ClassVar[str] = ""
    scores_at_temperature: ClassVar[bool] = False
    """Whether ``prompt_logprobs`` takes a temperature other than 1 (vLLM scores raw logits)."""

    def __init__(self, *, engine_id: str, initial_version: int = 0) -> None:
        self.engine_id = engine_id
        self._version = initial_version
        self._gate = asyncio.Event()  # set: requests may enter
        self._control = asyncio.Lock()  # one weight load / sleep / wake / group op at a time
        self._gated = 0
        self._in_flight = 0  # admitted requests the backend has not finished
        self._drained = asyncio.Event()  # set: nothing in flight
        self._drained.set()
        self._started = self._closed = False
        self._broken = ""
        # wall-clock stamps of the last weight load (time.time(): comparable across processes on
        # a host): called (the update reached the engine), loading (drained and paused: the load
        # starts), loaded, done (canary checked); the daemon hands them to the sender
        self.last_load: dict[str, float] = {}
        self.last_canary_gap: float | None = None  # the last update's canary max |logprob gap|; None: none sent
        self._checked: tuple[Any, ...] = ()  # the last update header ``check_header`` passed
        self._sleep: SleepState | None = None
        self._group: WeightGroupSpec | None = None
        self._tokens = self._samples = 0
        self._rate = Rate(RATE_WINDOW_S)
        self._spec: WeightSpec | None = None
        self.vocab_size = 0  # set by _start
        self.max_model_len = 0  # set by _start

    # ------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> int:
        """Version of the weights every newly admitted request runs on."""
        return self._version

    @property
    def weight_spec(self) -> WeightSpec:
        if self._spec is None:
            raise ServiceClosed(f"engine {self.engine_id} is not started")
        return self._spec

    async def start(self) -> None:
        """Load the model and open the gate; idempotent."""
        if self._started:
            return
        self._spec = await self._start()
        self._started = True
        self._gate.set()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Yield each of ``req.sampling.n`` samples as it finishes (in finishing order)."""
        self._check_request(req)
        await self._admit()
        self._check_request(req)  # the engine may have broken or closed while we waited
        # In flight from admission until the backend finished every sample: released before the
        # last yield, so a consumer that stops iterating after n results cannot block a drain.
        self._in_flight += 1
        self._drained.clear()
        left = req.sampling.n
        try:
            async for res in self._generate(req, self._version):
                left -= 1
                if left == 0:
                    self._release()
                self._tokens += len(res.response_token_ids)
                self._samples += 1
                self._rate.add(len(res.response_token_ids))
                yield res
        finally:
            if left > 0:
                self._release()

    async def abort(self, key: str) -> int:
        """Abort every in-flight request with this key; returns how many samples were aborted.

        Aborted samples are still yielded by their ``generate``, with finish_reason "abort".
        """
        return await self._abort(key) if key else 0

    async def prompt_logprobs(self, token_ids: Sequence[int] | np.ndarray, temperature: float = 1.0) -> np.ndarray:
        """float32 [P-1]: ``log p(token_t | tokens_<t)`` for t = 1..P-1 at ``temperature`` (the
        logits divided by it, as a trainer scores a reference at its sampling temperature)."""
        if self._closed or not self._started:
            raise ServiceClosed(f"engine {self.engine_id} is {'closed' if self._closed else 'not started'}")
        ids = self._check_tokens(token_ids, 0)
        if len(ids) < 2:
            raise BadRequest("prompt_logprobs needs >= 2 tokens")
        if not temperature > 0:
            raise BadRequest(f"prompt_logprobs at temperature {temperature}: scores need a temperature > 0")
        if temperature != 1.0 and not self.scores_at_temperature:
            raise BadRequest(f"engine {self.engine_id}: this backend scores prompts from raw logits (temperature 1), "
                             f"asked for {temperature}: serve the model with --backend hf")
        await self._admit()
        self._in_flight += 1  # a weight swap waits for it: the scores are of one version
        self._drained.clear()
        try:
            return await self._prompt_logprobs(ids, temperature)
        finally:
            self._release()

    def check_update(self, update: WeightUpdate) -> None:
        """Raise ``WeightMismatch`` / ``BadRequest`` unless this engine would accept ``update``."""
        if not self._started:
            raise ServiceClosed(f"engine {self.engine_id} is not started")
        if update.version <= self._version:
            raise BadRequest(f"weight update version {update.version} is not newer than the engine's "
                             f"{self._version}: versions must increase")
        if self._sleep is not None:
            raise BadRequest(f"engine {self.engine_id} is asleep: wake it before loading weights")
        header = (update.names, update.dtypes, update.shapes, update.adapter)
        if header != self._checked:  # the last header that passed passes again (lists compared in C)
            self._spec_of(update).check_header(*header[:3])
            self._checked = header

    def _spec_of(self, update: WeightUpdate) -> WeightSpec:
        """What ``update`` must carry: the model's tensors, or those of its LoRA adapter (refused
        by a backend that cannot serve it, ``_check_adapter``)."""
        a = update.adapter
        if a is None:
            return self.weight_spec
        self._check_adapter(a)
        dtype = next(t.dtype for t in self.weight_spec.required.values() if t.dtype in FLOAT_DTYPES)  # the serving dtype
        return adapter_spec(self.weight_spec, a.rank, a.target_modules, dtype)

    async def update_weights(self, update: InlineWeights | IpcWeights, tensors: Sequence[Any] | None = None,
                             *, mode: PauseMode = "wait") -> int:
        """Load an inline update's tensors (``update.tensors`` unless given) or a cuda_ipc update's
        buckets; returns the new version.

        Checked before anything is touched (header; tensors or handles); generation is paused
        during the load (``mode``: in-flight samples finish on the old weights first, or are
        aborted) and resumed after.
        """
        called = time.time()
        async with self._control:
            self.check_update(update)
            if isinstance(update, IpcWeights):
                await self._check_ipc(update)
                await self._swap(update, mode, lambda: self._load_ipc(update), called)
            elif isinstance(update, InlineWeights):
                ts = [as_tensor(t) for t in (update.tensors if tensors is None else tensors)]
                self._spec_of(update).check_tensors(update.names, update.dtypes, update.shapes, ts)
                await self._swap(update, mode, lambda: self._load(update, ts), called)
            else:
                raise BadRequest(f"update_weights takes inline or cuda_ipc updates, not {update.transport!r} "
                                 "(a collective one is received: receive_weights)")
            return self._version

    async def join_weight_group(self, spec: WeightGroupSpec) -> None:
        """Join the sender's broadcast group as ``spec.rank`` (blocks until every member joined)."""
        async with self._control:
            if self._group is not None:
                raise BadRequest(f"engine {self.engine_id} is already in a weight group: leave it first")
            await self._join_group(spec)
            self._group = spec

    async def receive_weights(self, update: CollectiveWeights, *, mode: PauseMode = "wait") -> int:
        """Receive ``update``'s buckets from the group and load them; returns the new version.

        A refused header is still drained from the group (received and discarded) so that the
        sender's broadcasts complete; then ``WeightMismatch`` / ``BadRequest`` is raised.
        """
        called = time.time()
        if not isinstance(update, CollectiveWeights):
            raise BadRequest(f"receive_weights takes collective updates, not {update.transport!r}")
        async with self._control:
            if self._group is None:
                raise NoWeightGroup(f"engine {self.engine_id} has no weight group: join_weight_group first")
            try:
                self.check_update(update)
            except BadRequest:
                await self._discard(update)
                raise
            await self._swap(update, mode, lambda: self._receive(update), called)
            return self._version

    async def leave_weight_group(self) -> None:
        async with self._control:
            if self._group is not None:
                self._group = None
                await self._leave_group()

    async def sleep(self, level: int = 1) -> SleepState:
        """Stop serving and give memory back where the backend can (level 1: weights kept
        somewhere cheap; level 2: weights dropped, the next weight update restores them)."""
        if level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 or 2, got {level}")
        async with self._control:
            if self._sleep is None:
                self._gate.clear()
                await self._drained.wait()
                await self._pause()
                self._sleep = await self._sleep_backend(level)
            return self._sleep

    async def wake(self) -> None:
        async with self._control:
            if self._sleep is not None:
                await self._wake_backend(self._sleep.level)
                await self._resume()
                if self._sleep.weights_dropped:
                    self._broken = "weights were dropped by sleep(level=2): send a weight update"
                self._sleep = None
                self._gate.set()

    async def reset_prefix_cache(self) -> None:
        await self._reset_prefix_cache()

    async def weight_digest(self) -> str:
        """A hex digest of every weight byte the engine computes with, in its own layout.

        Equal digests mean bit-identical weights between engines of the same backend and
        config (a pool consistency check); not comparable across backends.
        """
        return await self._weight_digest()

    def stats(self) -> EngineStats:
        running, waiting = self._load_counts()
        return EngineStats(engine_id=self.engine_id, backend=self.backend, weight_version=self._version,
                           running=running, waiting=waiting, gated=self._gated,
                           tokens_generated=self._tokens, samples_finished=self._samples,
                           tokens_per_s=self._rate.per_s(), paused=not self._gate.is_set(),
                           sleeping=self._sleep is not None, broken=self._broken)

    async def close(self) -> None:
        """Abort everything, release the model and processes; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._gate.set()  # let gated requests through to see the closed engine and fail
        await self._close()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ shared machinery

    async def _admit(self) -> None:
        if not self._gate.is_set():
            self._gated += 1
            try:
                await self._gate.wait()
            finally:
                self._gated -= 1
        if self._closed:
            raise ServiceClosed(f"engine {self.engine_id} is closed")

    def _check_request(self, req: GenerateRequest) -> None:
        if self._closed or not self._started:
            raise ServiceClosed(f"engine {self.engine_id} is {'closed' if self._closed else 'not started'}")
        if self._broken:
            raise EngineDead(f"engine {self.engine_id}: {self._broken}")
        if req.min_version > self._version:
            raise Busy(f"engine {self.engine_id} holds weight version {self._version} < "
                       f"min_version {req.min_version}")
        if req.sampling.temperature == 0 and req.sampling.n > 1:
            raise BadRequest(f"greedy sampling (temperature 0) makes identical samples: n must be 1, got {req.sampling.n}")
        self._check_tokens(req.prompt_token_ids, req.sampling.max_tokens)
        for t in req.sampling.stop_token_ids:
            if not 0 <= t < self.vocab_size:
                raise BadRequest(f"stop token id {t} outside the vocabulary [0, {self.vocab_size})")

    def _check_tokens(self, token_ids: Sequence[int] | np.ndarray, max_tokens: int) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise BadRequest("empty prompt: a prompt needs >= 1 token")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise BadRequest(f"prompt token ids must lie in [0, {self.vocab_size}), got "
                             f"[{ids.min()}, {ids.max()}]")
        if ids.size + max_tokens > self.max_model_len:
            raise BadRequest(f"prompt ({ids.size} tokens) + max_tokens ({max_tokens}) exceeds the "
                             f"engine's max_model_len {self.max_model_len}")
        return ids

    def _release(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._drained.set()

    async def _swap(self, update: WeightUpdate, mode: PauseMode, load: Callable[[], Awaitable[None]],
                    called: float) -> None:
        """Close the gate, drain (``mode``), pause, ``await load()``, resume, check the canary,
        bump the version; stamps ``last_load`` (``called``: when the update reached the engine)."""
        if mode not in ("wait", "abort"):
            raise BadRequest(f"pause mode must be 'wait' or 'abort', got {mode!r}")
        self._gate.clear()
        try:
            if mode == "abort":
                await self._abort_all()
            await self._drained.wait()
            await self._pause()
            stamps = {"called": called, "loading": time.time()}
            try:
                await load()
            except BaseException as e:
                self._broken = f"loading weight version {update.version} failed half way: {e!r}"
                raise
            finally:
                await self._resume()
            stamps["loaded"] = time.time()
            await self._verify(update)
            self.last_load = {**stamps, "done": time.time()}
        finally:
            self._gate.set()

    async def _verify(self, update: WeightUpdate) -> None:
        """Score the canary (the gate is still closed, so nothing else runs on new weights)."""
        self.last_canary_gap = None
        if update.canary_token_ids is not None and update.canary_logprobs is not None:
            ids = np.asarray(update.canary_token_ids, dtype=np.int64)
            got = await self._prompt_logprobs(ids, 1.0)
            self.last_canary_gap = canary_gap(update.canary_logprobs, got)
            err = canary_error(update.canary_logprobs, got, update.canary_tolerance)
            if err is not None:
                self._broken = f"weight version {update.version} failed its canary: {err}"
                raise CanaryMismatch(self._broken)
        self._broken = ""
        self._version = update.version

    # ------------------------------------------------------------------ backend hooks

    @abstractmethod
    async def _start(self) -> WeightSpec:
        """Load the model; set ``vocab_size`` and ``max_model_len``; return the weight spec."""

    @abstractmethod
    def _generate(self, req: GenerateRequest, version: int) -> AsyncIterator[GenerateResult]:
        """Run ``req`` (already validated and admitted), tagging results with ``version``."""

    @abstractmethod
    async def _abort(self, key: str) -> int: ...

    @abstractmethod
    async def _prompt_logprobs(self, ids: np.ndarray, temperature: float) -> np.ndarray: ...

    @abstractmethod
    async def _abort_all(self) -> None:
        """Abort every in-flight sample (they are still yielded, finish_reason "abort")."""

    @abstractmethod
    async def _pause(self) -> None:
        """Nothing is in flight (the gate is closed): stop the scheduler, drop KV/prefix caches."""

    @abstractmethod
    async def _resume(self) -> None: ...

    @abstractmethod
    async def _load(self, update: InlineWeights, tensors: list[Any]) -> None:
        """Copy ``tensors`` (checked against the header) into the model."""

    def _check_adapter(self, adapter: LoraAdapter) -> None:
        """Refuse a LoRA adapter update this engine cannot serve, before anything is touched
        (default: the backend serves none)."""
        raise BadRequest(f"the {self.backend} backend does not serve LoRA adapters: send merged weights")

    async def _check_ipc(self, update: IpcWeights) -> None:
        """Refuse a cuda_ipc update this engine cannot open, before anything is touched (default:
        the backend takes none)."""
        raise BadRequest(f"the {self.backend} backend does not take cuda_ipc weight updates: send them "
                         "collective (NCCL) or inline")

    async def _load_ipc(self, update: IpcWeights) -> None:
        """Open each bucket's handle, load its tensors, wait for the copies, drop every view (after
        ``_check_ipc``)."""
        raise BadRequest(f"the {self.backend} backend does not take cuda_ipc weight updates")

    @abstractmethod
    async def _join_group(self, spec: WeightGroupSpec) -> None: ...

    @abstractmethod
    async def _receive(self, update: CollectiveWeights) -> None:
        """Receive ``update``'s buckets from the group and load them as they arrive."""

    @abstractmethod
    async def _discard(self, update: CollectiveWeights) -> None:
        """Receive ``update``'s buckets and discard them (a refused collective update)."""

    @abstractmethod
    async def _leave_group(self) -> None: ...

    @abstractmethod
    async def _sleep_backend(self, level: int) -> SleepState: ...

    @abstractmethod
    async def _wake_backend(self, level: int) -> None: ...

    @abstractmethod
    async def _reset_prefix_cache(self) -> None: ...

    @abstractmethod
    async def _weight_digest(self) -> str: ...

    @abstractmethod
    def _load_counts(self) -> tuple[int, int]:
        """(running, waiting) samples."""

    @abstractmethod
    async def _close(self) -> None: ...

