"""The rollout engine interface (one engine per process in the daemon) and what backends share.

An ``Engine`` is token in, token out: ``generate`` takes a ``GenerateRequest`` and yields one
``GenerateResult`` per sample as each finishes, with the sampled tokens' logprobs under the
sampling distribution (temperature, top-k, top-p applied) and the weight version that produced
every one of its tokens. Weights change only through ``update_weights`` (tensors in hand, or
with ``transport="cuda_ipc"`` the handles of a colocated sender's GPU buckets) or
``receive_weights`` (buckets broadcast over a group joined with ``join_weight_group``).

Shared here, so every backend behaves alike:
- an admission gate, closed during weight loads and sleep: a request waits at the gate, then
  runs entirely on the version current when it passed it (in-flight samples either finish on
  the old version first, ``mode="wait"``, or are aborted, ``mode="abort"``; never mixed);
- the checks that refuse a bad update before the model is touched (``weights.WeightSpec``),
  monotonic versions, the canary, and the "broken" state after a failed load or canary;
- request validation, per-sample accounting and ``stats()``;
- armed receives (``arm_weights``, synchronous RL): the engine pauses while the trainer trains and
  its backend waits for the sender's signal on the group's store, then receives with the header
  it was armed with; the update's ``receive_weights`` only finishes the load (canary, version).

Sampling contract: sample ``i`` of a request with ``seed=s`` uses seed ``s + i`` (vLLM's rule);
greedy (``temperature == 0``) logprobs are the plain ``log_softmax`` of the logits. A sample ends
with "stop" on a token of ``stop_token_ids`` or of the engine's EOS ids (never before
``min_tokens``; the stop token is kept), with "length" at ``max_tokens`` (a request whose
prompt + ``max_tokens`` exceeds the engine's ``max_model_len`` is refused up front).

What this module does not do: transport, routing, failover (the daemon), or import torch/vLLM.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

from treadle.common.errors import BadRequest, Busy, EngineDead, ServiceClosed
from treadle.common.log import get_logger
from treadle.common.records import HEADER_FIELDS, GenerateRequest, GenerateResult, WeightUpdate
from treadle.rollout.engine.group import GroupSpec, NoSignal
from treadle.rollout.engine.state import RATE_WINDOW_S, EngineStats, Rate, SleepState
from treadle.rollout.engine.weights import (
    CanaryMismatch,
    WeightMismatch,
    WeightSpec,
    as_tensor,
    bucket_ranges,
    canary_error,
)
from treadle.rollout.errors import HeaderUnknown, tagged

log = get_logger(__name__)
PauseMode = Literal["wait", "abort"]
ARM_TIMEOUT_S = 6 * 3600.0  # an armed engine waits this long for the signal (a dead sender ends it at once)


@dataclass(slots=True, kw_only=True)
class _Armed:
    """An engine armed for ``update`` (``Engine.arm_weights``)."""

    update: WeightUpdate
    load: asyncio.Future[bool]  # the backend's wait and receive: True received, False stood down
    stamps: dict[str, float] = field(default_factory=dict)  # the backend's: "signalled" (and "loading")
    expiry: asyncio.TimerHandle | None = None  # received, but the update never came: give up


def _layout(u: WeightUpdate) -> tuple[Any, ...]:
    return u.version, list(u.names), list(u.dtypes), [list(s) for s in u.shapes], list(u.bucket_sizes)


class Engine(ABC):
    """One rollout engine; subclasses implement the ``_``-prefixed hooks below."""

    backend: ClassVar[str] = ""
    arms: ClassVar[bool] = False  # the backend implements ``_arm``

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
        self._load_stamps: dict[str, float] = {}  # a backend's own stamps inside a load (set on its model thread)
        # the last load's CUDA IPC event (``WeightUpdate.ipc_event``): its handle, recorded after
        # the copies the engine answered before they finished; b"": it answered after them
        self.last_event = b""
        self._checked: tuple[Any, ...] = ()  # the last update header ``check_header`` passed
        self._header: tuple[str, dict[str, Any]] | None = None  # the last accepted header that had a name, its fields
        self._sleep: SleepState | None = None
        self._group: GroupSpec | None = None
        self._armed: _Armed | None = None
        self._background: set[asyncio.Task[Any]] = set()
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

    async def prompt_logprobs(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 [P-1]: ``log p(token_t | tokens_<t)`` for t = 1..P-1, temperature 1."""
        if self._closed or not self._started:
            raise ServiceClosed(f"engine {self.engine_id} is {'closed' if self._closed else 'not started'}")
        ids = self._check_tokens(token_ids, 0)
        if len(ids) < 2:
            raise BadRequest("prompt_logprobs needs >= 2 tokens")
        await self._admit()
        self._in_flight += 1  # a weight swap waits for it: the scores are of one version
        self._drained.clear()
        try:
            return await self._prompt_logprobs(ids)
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
        header = (update.names, update.dtypes, update.shapes)
        if header != self._checked:  # the last header that passed passes again (lists compared in C)
            self.weight_spec.check_header(*header)
            self._checked = header

    async def update_weights(self, update: WeightUpdate, tensors: Sequence[Any] | None = None,
                             *, mode: PauseMode = "wait") -> int:
        """Load named tensors (``update.tensors`` unless given); returns the new version.

        Checked before anything is touched; generation is paused during the load (``mode``:
        in-flight samples finish on the old weights first, or are aborted) and resumed after.
        """
        called = time.time()
        update = self._with_header(update)
        if update.transport == "cuda_ipc":
            return await self._update_ipc(update, mode, called)
        ts = [as_tensor(t) for t in (update.tensors if tensors is None else tensors)]
        async with self._control:
            self.check_update(update)
            self.weight_spec.check_tensors(update.names, update.dtypes, update.shapes, ts)
            self._keep_header(update)
            await self._swap(update, mode, lambda: self._load(update, ts), called)
            return self._version

    async def _update_ipc(self, update: WeightUpdate, mode: PauseMode, called: float) -> int:
        """Load a cuda_ipc update: every check (header, handle count, colocation) before the gate closes."""
        async with self._control:
            self.check_update(update)
            buckets = len(bucket_ranges(update.bucket_sizes, len(update.names)))
            if not update.ipc_pieces and len(update.ipc_handles) != buckets:
                raise BadRequest(f"cuda_ipc update: {len(update.ipc_handles)} handles for {buckets} buckets")
            await self._check_ipc(update)
            self._keep_header(update)
            await self._swap(update, mode, lambda: self._load_ipc(update), called)
            return self._version

    @property
    def header_id(self) -> str:
        """The name of the update header this engine keeps (``WeightUpdate.header_id``), or ""."""
        return self._header[0] if self._header is not None else ""

    def _with_header(self, update: WeightUpdate) -> WeightUpdate:
        """``update`` with its header put back from the one kept (``header_kept``); raises
        ``HeaderUnknown`` when the engine keeps another one, or none."""
        if not update.header_kept:
            return update
        if self.header_id != update.header_id:
            raise tagged(HeaderUnknown, f"engine {self.engine_id} keeps header {self.header_id or 'none'!r}, "
                                        f"weight version {update.version} names {update.header_id!r}: send the header")
        try:
            return msgspec.structs.replace(update, header_kept=False, **self._header[1])
        except ValueError as e:  # the tensors an inline update carries do not fit the kept header
            raise BadRequest(f"weight version {update.version} with the kept header {update.header_id!r}: {e}") from None

    def _keep_header(self, update: WeightUpdate) -> None:
        """Keep ``update``'s header (checked) when its sender named it, to put back into a later
        update that leaves it out."""
        if update.header_id:
            self._header = (update.header_id, {f: getattr(update, f) for f in HEADER_FIELDS})  # not the tensors

    async def join_weight_group(self, group: GroupSpec | dict[str, Any]) -> None:
        """Join the sender's broadcast group (blocks until every member joined)."""
        spec = group if isinstance(group, GroupSpec) else GroupSpec.from_dict(group)
        async with self._control:
            if self._group is not None:
                raise BadRequest(f"engine {self.engine_id} is already in a weight group: leave it first")
            await self._join_group(spec)
            self._group = spec

    async def receive_weights(self, update: WeightUpdate, *, mode: PauseMode = "wait") -> int:
        """Receive ``update``'s buckets from the group and load them; returns the new version.

        A refused header is still drained from the group (received and discarded) so that the
        sender's broadcasts complete; then ``WeightMismatch`` is raised.
        """
        called = time.time()
        async with self._control:
            if self._group is None:
                raise BadRequest(f"engine {self.engine_id} has no weight group: join_weight_group first")
            armed, self._armed = self._armed, None
            if armed is not None:
                try:
                    await self._finish_armed(armed, update, called)
                finally:
                    self._gate.set()
                return self._version
            try:
                self.check_update(update)
            except BadRequest:
                await self._discard(update)
                raise
            await self._swap(update, mode, lambda: self._receive(update), called)
            return self._version

    async def arm_weights(self, update: WeightUpdate, *, timeout_s: float = ARM_TIMEOUT_S) -> None:
        """Get ready for ``update`` (a collective one, the next version) before the sender starts it.

        For synchronous RL, after a rollout and before training: the engine closes its gate
        (in-flight samples finish first; new requests wait until the update is done) and its
        backend waits for the sender's signal on the group's store (``WeightGroup.signal``). On
        "go" it receives the buckets with this header's layout at once, so the first broadcast
        does not wait for the update's request to travel trainer -> daemon -> engine. That
        request (``receive_weights`` of the same version) then checks its header against this
        one, waits for the receive, checks the canary and bumps the version. Disarmed, gate
        reopened and weights untouched, by "no" (the sender's plan changed: the update comes
        as usual), leaving the group, a dead sender or ``timeout_s`` without a signal. Weights
        that arrived without their request: on leaving the group (the sender rejoins and
        resends after a refusal) the gate stays closed until the next update; ``timeout_s``
        after the receive the engine is broken (its weights changed without a version).
        """
        async with self._control:
            if not self.arms:
                raise BadRequest(f"the {self.backend} backend cannot arm a weight receive; send updates as usual")
            if self._group is None:
                raise BadRequest(f"engine {self.engine_id} has no weight group: join_weight_group first")
            if (old := self._armed) is not None:
                await asyncio.wait([old.load], timeout=5.0)  # the sender's "no" to it may be on its way
                if self._armed is old:
                    raise BadRequest(f"engine {self.engine_id} is already armed for weight version "
                                     f"{old.update.version}")
            if update.transport != "collective":
                raise BadRequest(f"only a collective update can be armed, got transport {update.transport!r}")
            self.check_update(update)
            self._gate.clear()
            try:
                await self._drained.wait()
                await self._pause()
                stamps: dict[str, float] = {}
                armed = _Armed(update=update, load=self._arm(update, timeout_s, stamps), stamps=stamps)
            except BaseException:
                await self._resume()
                self._gate.set()
                raise
            self._armed = armed
            armed.load.add_done_callback(lambda _: self._arm_ended(armed, timeout_s))

    def _arm_ended(self, armed: _Armed, timeout_s: float) -> None:
        """The backend's wait/receive ended before the update claimed it."""
        if self._armed is not armed:
            return  # claimed by ``receive_weights``, or disarmed
        if armed.load.cancelled() or armed.load.exception() is not None or not armed.load.result():
            self._armed = None  # no signal, or "no": serve on until the update comes as usual
            self._later(self._disarm(armed, "the armed wait ended", locked=False))
        else:  # received: the update's request is on its way, but not forever
            armed.expiry = asyncio.get_running_loop().call_later(
                timeout_s, lambda: self._later(self._expire(armed, timeout_s)))

    def _later(self, coro: Any) -> None:
        """Run ``coro`` in a task of its own, kept until it ends (the loop holds tasks weakly)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _expire(self, armed: _Armed, timeout_s: float) -> None:
        async with self._control:
            if self._armed is armed:
                self._armed = None
                await self._disarm(armed, f"no update request within {timeout_s:g} s")

    async def _disarm(self, armed: _Armed, why: str, *, locked: bool = True, hold: bool = False) -> None:
        """Let go of ``armed`` (no longer ``self._armed``): wait for its backend work to end and
        reopen the gate (unless the engine was armed again meanwhile). Weights that arrived
        without their update: ``hold`` keeps the gate closed until the next update (the sender
        resends after a refusal), else the engine is broken; a receive that failed half way
        leaves it broken."""
        if not locked:
            async with self._control:
                return await self._disarm(armed, why, hold=hold)
        if armed.expiry is not None:
            armed.expiry.cancel()
        v = armed.update.version
        try:
            if await armed.load:
                if hold:
                    log.warning("engine %s holds weight version %d (armed) without its update (%s): no work "
                                "until the next update", self.engine_id, v, why)
                    return
                self._broken = f"weight version {v} arrived (armed) but its update did not ({why}): send a weight update"
        except NoSignal as e:
            log.warning("engine %s disarmed for weight version %d: %s", self.engine_id, v, e)
        except BaseException as e:  # noqa: BLE001 - the receive itself failed half way
            self._broken = f"receiving weight version {v} (armed) failed half way: {e!r}"
        if self._armed is None:
            await self._resume()
            self._gate.set()

    async def _finish_armed(self, armed: _Armed, update: WeightUpdate, called: float) -> None:
        """``receive_weights`` of an armed engine (paused since ``arm_weights``; the caller
        reopens the gate)."""
        if armed.expiry is not None:
            armed.expiry.cancel()
        try:
            went = await armed.load
        except NoSignal:  # timed out or closed before the signal: the header says what comes
            went = False
        except BaseException as e:
            self._broken = f"receiving weight version {armed.update.version} (armed) failed half way: {e!r}"
            await self._resume()
            raise
        if not went:  # stood down: the usual receive, still paused
            try:
                self.check_update(update)
            except BadRequest:
                await self._discard(update)
                await self._resume()
                raise
            await self._loaded(update, lambda: self._receive(update), {"called": called, "loading": time.time()})
            return
        if _layout(update) != _layout(armed.update):
            self._broken = (f"weight version {armed.update.version} arrived with the armed header, but the update "
                            f"(version {update.version}) has another: send a weight update")
            await self._resume()
            raise WeightMismatch(f"engine {self.engine_id}: {self._broken}")
        await self._loaded(update, _nothing, {"called": called, **armed.stamps})

    async def leave_weight_group(self) -> None:
        async with self._control:
            if self._group is not None:
                self._group = None
                await self._leave_group()  # an armed wait ends here (its group is closed)
                armed, self._armed = self._armed, None
                if armed is not None:
                    await self._disarm(armed, "left the weight group", hold=True)

    async def sleep(self, level: int = 1) -> SleepState:
        """Stop serving and give memory back where the backend can (level 1: weights kept
        somewhere cheap; level 2: weights dropped, the next weight update restores them)."""
        if level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 or 2, got {level}")
        async with self._control:
            if self._armed is not None:
                raise BadRequest(f"engine {self.engine_id} is armed for weight version "
                                 f"{self._armed.update.version}: it sleeps after that update")
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

    async def _swap(self, update: WeightUpdate, mode: PauseMode, load: Any, called: float) -> None:
        """Close the gate, drain (``mode``), pause, load, resume, check the canary, bump the
        version; stamps ``last_load`` (``called``: when the update reached the engine)."""
        if mode not in ("wait", "abort"):
            raise BadRequest(f"pause mode must be 'wait' or 'abort', got {mode!r}")
        self._gate.clear()
        try:
            if mode == "abort":
                await self._abort_all()
            await self._drained.wait()
            await self._pause()
            await self._loaded(update, load, {"called": called, "loading": time.time()})
        finally:
            self._gate.set()

    async def _loaded(self, update: WeightUpdate, load: Any, stamps: dict[str, float]) -> None:
        """Paused, gate closed: ``await load()``, resume, check the canary, bump the version."""
        self._load_stamps, self.last_event = {}, b""
        try:
            await load()
        except BaseException as e:
            self._broken = f"loading weight version {update.version} failed half way: {e!r}"
            raise
        finally:
            await self._resume()
        stamps.update(self._load_stamps)
        stamps["loaded"] = time.time()
        await self._verify(update)
        self.last_load = {**stamps, "done": time.time()}

    async def _verify(self, update: WeightUpdate) -> None:
        """Score the canary (the gate is still closed, so nothing else runs on new weights)."""
        if update.canary_token_ids is not None and update.canary_logprobs is not None:
            ids = np.asarray(update.canary_token_ids, dtype=np.int64)
            got = await self._prompt_logprobs(ids)
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
    async def _prompt_logprobs(self, ids: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    async def _abort_all(self) -> None:
        """Abort every in-flight sample (they are still yielded, finish_reason "abort")."""

    @abstractmethod
    async def _pause(self) -> None:
        """Nothing is in flight (the gate is closed): stop the scheduler, drop KV/prefix caches."""

    @abstractmethod
    async def _resume(self) -> None: ...

    @abstractmethod
    async def _load(self, update: WeightUpdate, tensors: list[Any]) -> None: ...

    async def _check_ipc(self, update: WeightUpdate) -> None:
        """Refuse a cuda_ipc update this engine cannot open (default: the backend takes none)."""
        raise BadRequest(f"the {self.backend} backend does not take cuda_ipc weight updates: send them "
                         "collective (NCCL) or inline")

    async def _load_ipc(self, update: WeightUpdate) -> None:
        """Open each bucket's handle, load its tensors, release the handles (after ``_check_ipc``)."""
        raise BadRequest(f"the {self.backend} backend does not take cuda_ipc weight updates")

    def _arm(self, update: WeightUpdate, timeout_s: float, stamps: dict[str, float]) -> asyncio.Future[bool]:
        """Start waiting for the sender's signal for ``update`` (``arms`` backends): on go, stamp
        ``stamps["signalled"]`` and ``["loading"]`` and receive with ``update``'s header, True; on
        no, False; ``NoSignal`` when the wait ends without one."""
        raise BadRequest(f"the {self.backend} backend cannot arm a weight receive")

    @abstractmethod
    async def _join_group(self, spec: GroupSpec) -> None: ...

    @abstractmethod
    async def _receive(self, update: WeightUpdate) -> None: ...

    @abstractmethod
    async def _discard(self, update: WeightUpdate) -> None:
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


async def _nothing() -> None:
    """The load of an armed receive that already arrived."""
