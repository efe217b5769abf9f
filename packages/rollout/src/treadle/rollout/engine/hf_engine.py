"""The HF backend: a transformers causal LM with a batched sampling loop and a KV cache.

The reference engine (its logprobs are the model's own) and the fallback where vLLM cannot run,
e.g. the receiving side of NCCL weight sync on a GPU machine without vLLM: nothing here is
CPU-specific (``device`` in the config). On a GPU it also takes ``cuda_ipc`` updates from a
sender on the same GPU (``treadle.common.ipc``): it maps the sender's buckets and copies from them.

Scheduling is static batching: when the loop is free it takes the queued requests (up to
``max_batch_samples`` samples), left-pads their prompts, prefills once and decodes step by step,
dropping finished rows from the cache; requests arriving meanwhile wait for the next batch. Each
sample is returned the moment it finishes. All model work (steps, scoring, weight loads,
collective receives) runs on one worker thread: serialised, and never on the event loop.

LoRA adapter updates (``WeightUpdate.adapter``) inject PEFT's LoRA layers into the model at the
first one (``inject_adapter_in_model``: the base weights stay, the forward adds the adapter's
product) and copy the adapter's tensors at each; a full update zeroes the adapter again.

What this module does not do: continuous batching, prefix caching or paged KV (vLLM's job).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from treadle.common import ipc
from treadle.common.errors import BadRequest, ServiceClosed
from treadle.common.log import get_logger
from treadle.common.records import (
    CollectiveWeights,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InlineWeights,
    IpcWeights,
    LoraAdapter,
    WeightGroupSpec,
    WeightUpdate,
)
from treadle.common.weights import WeightGroup, bucket_ranges, bucket_views, receive_buckets
from treadle.rollout.engine.base import Engine
from treadle.rollout.engine.sampling import (
    GREEDY_EPS,
    mask_stop_tokens,
    processed_logprobs,
    sample,
    top_logprobs,
)
from treadle.rollout.engine.state import SleepState
from treadle.rollout.engine.weights import (
    ADAPTER_PREFIX,
    WeightSpec,
    check_ipc_buckets,
    model_eos_ids,
    spec_from_checkpoint,
)

SCORE_LOGITS = 1 << 28
"""Logit elements one scoring forward may hold (fp32: 1 GiB): how many queued sequences go together."""

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class HfEngineConfig:
    """How to build an HF engine."""

    model: str  # HF model folder (safetensors)
    engine_id: str = "hf-0"
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int = 2048  # prompt + response tokens; capped by max_position_embeddings
    max_batch_samples: int = 64  # samples decoded together in one batch
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's generation_config; (): none
    seed: int = 0  # seeds the draws of samples that come without a seed
    initial_version: int = 0
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"HfEngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_batch_samples < 1:
            raise ValueError(f"HfEngineConfig.max_batch_samples must be >= 1, got {self.max_batch_samples}")


@dataclass(slots=True, eq=False)
class _Request:
    """A request inside the HF engine."""

    req: GenerateRequest
    version: int
    stops: frozenset[int]
    results: asyncio.Queue[GenerateResult] = field(default_factory=asyncio.Queue)
    prompt_lp: np.ndarray | None = None
    aborted: bool = False


@dataclass(slots=True, eq=False)
class _Row:
    """One sample of a request, one row of a batch."""

    r: _Request
    index: int
    gen: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)  # per token: its k alternatives (k = top_logprobs)
    top_lps: list[list[float]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Batch:
    """Decoding state of one batch (worker thread only). Row b of every tensor is rows[b]."""

    rows: list[_Row]
    cache: Any  # transformers DynamicCache
    mask: torch.Tensor  # int64 [B, L]: 1 on real tokens, 0 on left padding
    pos: torch.Tensor  # int64 [B]: position of each row's next token
    logits: torch.Tensor  # float32 [B, V]: next-token logits
    temperature: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B]
    top_p: torch.Tensor  # float32 [B]

    def select(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[j] for j in keep]
        self.cache.batch_select_indices(idx)
        for name in ("mask", "pos", "logits", "temperature", "top_k", "top_p"):
            setattr(self, name, getattr(self, name).index_select(0, idx))


class HfEngine(Engine):
    """Engine over ``transformers.AutoModelForCausalLM``."""

    backend = "hf"
    scores_at_temperature = True

    def __init__(self, config: HfEngineConfig) -> None:
        super().__init__(engine_id=config.engine_id, initial_version=config.initial_version)
        self.config = config
        self.device = torch.device(config.device)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{config.engine_id}-model")
        self._queue: collections.deque[_Request] = collections.deque()
        self._running: list[_Row] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._wgroup: WeightGroup | None = None
        self._uuid: str | None = None  # the GPU's UUID (``ipc.device_uuid``), read at start
        self._named: dict[str, torch.Tensor] | None = None  # ``_targets``
        self._adapter: LoraAdapter | None = None  # the LoRA layers injected into the model (``_adapt``)
        self._eos: tuple[int, ...] = ()
        self._fallback = torch.Generator(device=self.device).manual_seed(config.seed)
        self._to_score: collections.deque[tuple[np.ndarray, float, asyncio.Future[np.ndarray]]] = collections.deque()
        self._scorer: asyncio.Task[None] | None = None  # ``_drain_scores``
        self.model: Any = None

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the model thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> WeightSpec:
        from transformers import AutoModelForCausalLM

        cfg = self.config

        def load() -> Any:
            m = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype),
                                                     attn_implementation=cfg.attn_implementation)
            return m.to(self.device).eval().requires_grad_(False)

        self.model = await self._call(load)
        if self.device.type == "cuda":  # kept: checking a cuda_ipc update's GPU then takes no CUDA call
            self._uuid = await self._call(ipc.device_uuid, self.device)
        mcfg = self.model.config
        self.vocab_size = int(mcfg.vocab_size)
        self.max_model_len = min(cfg.max_model_len, int(getattr(mcfg, "max_position_embeddings", 1 << 30)))
        self._eos = model_eos_ids(cfg.model) if cfg.eos_token_ids is None else tuple(cfg.eos_token_ids)
        self._loop_task = asyncio.create_task(self._loop(), name=f"{cfg.engine_id}-loop")
        return spec_from_checkpoint(cfg.model, dtype=cfg.dtype)

    async def _close(self) -> None:
        await self._abort_all()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._scorer is not None:
            self._scorer.cancel()
            await asyncio.gather(self._scorer, return_exceptions=True)
        while self._to_score:  # scores asked for and never computed owe their callers an answer
            fut = self._to_score.popleft()[2]
            if not fut.done():
                fut.set_exception(ServiceClosed(f"engine {self.engine_id} closed"))
        for row in self._running:  # the cancelled batch's samples still owe their consumers a result
            row.r.results.put_nowait(self._result(row, "abort"))
        self._running = []
        if self._wgroup is not None:
            self._wgroup.close()
        self._pool.shutdown(wait=True)
        self.model = None

    # ------------------------------------------------------------------ generation

    async def _generate(self, req: GenerateRequest, version: int) -> AsyncIterator[GenerateResult]:
        r = _Request(req=req, version=version, stops=frozenset(req.sampling.stop_token_ids) | frozenset(self._eos))
        self._queue.append(r)
        self._wake.set()
        try:
            for _ in range(req.sampling.n):
                yield await r.results.get()
        finally:
            r.aborted = True  # a consumer that went away needs no more tokens

    async def _abort(self, key: str) -> int:
        return self._abort_where(lambda r: r.req.key == key)

    async def _abort_all(self) -> None:
        self._abort_where(lambda r: True)

    def _abort_where(self, pred: Callable[[_Request], bool]) -> int:
        """Flag matching requests: queued ones finish now, running ones at the next step."""
        n = sum(1 for row in self._running if not row.r.aborted and pred(row.r))
        for row in self._running:
            if pred(row.r):
                row.r.aborted = True
        for r in [r for r in self._queue if pred(r)]:
            self._queue.remove(r)
            for i in range(r.req.sampling.n):
                r.results.put_nowait(self._result(_Row(r=r, index=i, gen=None), "abort"))
            n += r.req.sampling.n
        return n

    def _result(self, row: _Row, reason: FinishReason) -> GenerateResult:
        r, sp = row.r, row.r.req.sampling
        tops: dict[str, np.ndarray] = {}
        if sp.top_logprobs:
            shape = (len(row.tokens), min(sp.top_logprobs, self.vocab_size))
            tops = {"top_token_ids": np.asarray(row.top_ids, dtype=np.int32).reshape(shape),
                    "top_logprobs": np.asarray(row.top_lps, dtype=np.float32).reshape(shape)}
        return GenerateResult(
            response_token_ids=np.asarray(row.tokens, dtype=np.int32),
            logprobs=np.asarray(row.logprobs, dtype=np.float32) if sp.logprobs else None,
            prompt_logprobs=r.prompt_lp if sp.prompt_logprobs else None,
            finish_reason=reason, index=row.index, key=r.req.key, weight_version=r.version,
            engine_id=self.engine_id, **tops)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            if not self._queue:
                self._wake.clear()
                continue
            batch = [self._queue.popleft()]
            used = batch[0].req.sampling.n
            while self._queue and used + self._queue[0].req.sampling.n <= self.config.max_batch_samples:
                used += self._queue[0].req.sampling.n
                batch.append(self._queue.popleft())
            await self._run_batch(batch)

    async def _run_batch(self, batch: list[_Request]) -> None:
        rows = [_Row(r=r, index=i, gen=self._generator(r, i)) for r in batch for i in range(r.req.sampling.n)]
        self._running = rows
        try:
            for r in batch:
                if r.req.sampling.prompt_logprobs:
                    r.prompt_lp = await self._call(self._score, np.asarray(r.req.prompt_token_ids))
            state = await self._call(self._prefill, rows)
            while state.rows:
                for row, reason in await self._call(self._advance, state):
                    row.r.results.put_nowait(self._result(row, reason))
                self._running = state.rows
        except Exception:  # a failed step must not kill the loop: fail this batch, keep serving
            log.exception("engine %s: batch failed", self.engine_id)
            for row in self._running:
                row.r.results.put_nowait(self._result(row, "error"))
        self._running = []  # not reached on cancellation: _close answers those rows

    def _generator(self, r: _Request, index: int) -> torch.Generator | None:
        seed = r.req.sampling.seed
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed + index)

    # ------------------------------------------------------------------ model thread

    @torch.inference_mode()
    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Left-pad the prompts, run them through the model, return the batch state."""
        from transformers import DynamicCache

        prompts = [np.asarray(row.r.req.prompt_token_ids, dtype=np.int64) for row in rows]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.from_numpy(p)
            mask[b, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        sps = [row.r.req.sampling for row in rows]
        f32 = dict(dtype=torch.float32, device=self.device)
        return _Batch(rows=rows, cache=out.past_key_values, mask=mask, pos=pos[:, -1] + 1,
                      logits=out.logits[:, -1].float(),
                      temperature=torch.tensor([sp.temperature for sp in sps], **f32),
                      top_k=torch.tensor([sp.top_k for sp in sps], dtype=torch.long, device=self.device),
                      top_p=torch.tensor([sp.top_p for sp in sps], **f32))

    @torch.inference_mode()
    def _advance(self, st: _Batch) -> list[tuple[_Row, FinishReason]]:
        """Sample one token per row, retire finished rows, run the next forward; returns the retired."""
        done: list[tuple[_Row, FinishReason]] = []
        live = [j for j, row in enumerate(st.rows) if not row.r.aborted]
        done += [(row, "abort") for row in st.rows if row.r.aborted]
        if len(live) < len(st.rows):
            st.select(live)
        if not st.rows:
            return done
        early = [(b, row.r.stops) for b, row in enumerate(st.rows) if len(row.tokens) < row.r.req.sampling.min_tokens]
        mask_stop_tokens(st.logits, [b for b, _ in early], [sorted(s) for _, s in early])
        lp = processed_logprobs(st.logits, st.temperature, st.top_k, st.top_p)
        tokens = sample(lp, st.temperature < GREEDY_EPS, [row.gen for row in st.rows], self._fallback)
        picked = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        ks = [row.r.req.sampling.top_logprobs for row in st.rows]
        if max(ks):  # alternatives from the same processed logprobs the token was drawn from
            top_lp, top_id = (t.tolist() for t in top_logprobs(lp, max(ks)))
        keep = []
        for b, (row, tok) in enumerate(zip(st.rows, tokens.tolist(), strict=True)):
            row.tokens.append(tok)
            row.logprobs.append(picked[b])
            if ks[b]:
                row.top_ids.append(top_id[b][:ks[b]])
                row.top_lps.append(top_lp[b][:ks[b]])
            if tok in row.r.stops and len(row.tokens) > row.r.req.sampling.min_tokens:
                done.append((row, "stop"))
            elif len(row.tokens) >= row.r.req.sampling.max_tokens:
                done.append((row, "length"))
            else:
                keep.append(b)
        if len(keep) < len(st.rows):
            st.select(keep)
        if st.rows:
            self._decode(st, torch.tensor([row.tokens[-1] for row in st.rows], device=self.device))
        return done

    def _decode(self, st: _Batch, tokens: torch.Tensor) -> None:
        st.mask = torch.cat([st.mask, torch.ones_like(st.mask[:, :1])], dim=1)
        out = self.model(input_ids=tokens.unsqueeze(1), attention_mask=st.mask, position_ids=st.pos.unsqueeze(1),
                         past_key_values=st.cache, use_cache=True, logits_to_keep=1)
        st.cache, st.logits, st.pos = out.past_key_values, out.logits[:, -1].float(), st.pos + 1

    @torch.inference_mode()
    def _score(self, ids: np.ndarray, temperature: float = 1.0) -> np.ndarray:
        """float32 [P-1]: log p(ids[t] | ids[:t]) for t >= 1 at ``temperature``, from one forward pass."""
        return self._score_rows([ids], [temperature])[0]

    async def _prompt_logprobs(self, ids: np.ndarray, temperature: float) -> np.ndarray:
        """Queued and scored with whatever else is queued, in one padded forward (``_drain_scores``):
        a reference daemon gets a micro-batch's sequences at once."""
        fut: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._to_score.append((np.asarray(ids), temperature, fut))
        if self._scorer is None or self._scorer.done():
            self._scorer = asyncio.create_task(self._drain_scores())
        return await fut

    async def _drain_scores(self) -> None:
        """Score the queued sequences, as many a forward as ``score_rows`` fit in ``SCORE_LOGITS``."""
        while self._to_score:
            take = [self._to_score.popleft()]
            width = len(take[0][0])
            while self._to_score and len(take) < self.config.max_batch_samples:
                wider = max(width, len(self._to_score[0][0]))
                if (len(take) + 1) * wider * self.vocab_size > SCORE_LOGITS:
                    break
                take.append(self._to_score.popleft())
                width = wider
            try:
                out = await self._call(self._score_rows, [ids for ids, _, _ in take], [t for _, t, _ in take])
            except Exception as e:  # noqa: BLE001  (each caller gets the failure; the engine keeps serving)
                for *_, fut in take:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (*_, fut), lp in zip(take, out, strict=True):
                if not fut.done():
                    fut.set_result(lp)

    @torch.inference_mode()
    def _score_rows(self, rows: Sequence[np.ndarray], temperatures: Sequence[float]) -> list[np.ndarray]:
        """Each row's ``_score``, all in one right-padded forward (causal: padding after a row
        changes none of its logits; a forward of rows of one length takes no mask)."""
        width = max(len(r) for r in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for k, r in enumerate(rows):
            x[k, :len(r)] = torch.as_tensor(np.asarray(r, dtype=np.int64))
            mask[k, :len(r)] = 1
        x = x.to(self.device)
        padded = any(len(r) < width for r in rows)
        logits = self.model(input_ids=x, attention_mask=mask.to(self.device) if padded else None,
                            use_cache=False).logits
        out = []
        for k, (r, t) in enumerate(zip(rows, temperatures, strict=True)):
            row = logits[k, :len(r) - 1].float()
            lp = torch.log_softmax(row / t if t != 1.0 else row, dim=-1).gather(1, x[k, 1:len(r)].unsqueeze(1))
            out.append(lp.squeeze(1).cpu().numpy().astype(np.float32))
        return out

    # ------------------------------------------------------------------ weights

    def _targets(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by name, listed once (a walk of the module tree
        costs a few ms on a 1.5B model, ahead of the first bucket); listed again after ``to()``
        (sleep, wake), which replaces the buffers, and after LoRA layers were injected: a base
        weight then under its checkpoint name (``.base_layer`` dropped), an adapter tensor under
        its PEFT file name (``base_model.model.`` + the name, the adapter's name dropped)."""
        if self._named is None:
            named = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
            self._named = {_served_name(n): t for n, t in named.items()}
        return self._named

    def _check_adapter(self, adapter: LoraAdapter) -> None:
        if self._adapter is not None and adapter != self._adapter:
            raise BadRequest(f"engine {self.engine_id} serves a LoRA adapter of rank {self._adapter.rank} on "
                             f"{self._adapter.target_modules}; one of rank {adapter.rank} on {adapter.target_modules} "
                             "needs a new engine")
        try:
            import peft  # noqa: F401, PLC0415
        except ImportError:
            raise BadRequest("the hf backend serves LoRA adapters through peft, which is not installed") from None

    def _adapt(self, update: WeightUpdate) -> None:
        """Model thread, before a load: an adapter update's first injects PEFT's LoRA layers (A, B
        at their init: loaded next); a full update drops the adapter (B = 0: the delta is 0)."""
        a = update.adapter
        if a is not None and self._adapter is None:
            from peft import LoraConfig, inject_adapter_in_model  # noqa: PLC0415

            inject_adapter_in_model(LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=list(a.target_modules),
                                               lora_dropout=0.0), self.model)
            self.model.eval().requires_grad_(False)
            self._adapter, self._named = a, None
        elif a is None and self._adapter is not None:
            with torch.no_grad():
                for name, t in self._targets().items():
                    if ".lora_B." in name:
                        t.zero_()

    @torch.inference_mode()
    def _copy(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """``tensors`` into the named parameters/buffers by one multi-tensor copy (a few kernel
        launches, not one per tensor); the tied head is skipped (it follows its embedding)."""
        targets, skip = self._targets(), self.weight_spec.skip
        pairs = [(targets[n], t) for n, t in zip(names, tensors, strict=True) if n not in skip]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])

    def _copy_buckets(self, update: CollectiveWeights, buckets: Iterable[tuple[int, int, list[torch.Tensor]]]) -> None:
        """One ``_copy`` per bucket as it arrives (``receive_buckets``: lazy, so a bucket is
        copied while the next one is on the wire)."""
        for lo, hi, views in buckets:
            self._copy(update.names[lo:hi], views)

    async def _load(self, update: InlineWeights, tensors: list[Any]) -> None:
        await self._call(self._adapt, update)
        await self._call(self._copy, update.names, tensors)

    def _my_handles(self, update: IpcWeights) -> list[bytes]:
        """``update``'s handles on this engine's GPU, checked against the layout."""
        if self.device.type != "cuda" or self._uuid is None:
            raise ipc.IpcHandleError(f"cuda_ipc needs an engine on a CUDA device colocated with the sender; "
                                     f"engine {self.engine_id} runs on {self.device}")
        return check_ipc_buckets(update, self._uuid)

    async def _check_ipc(self, update: IpcWeights) -> None:
        self._my_handles(update)

    def _copy_ipc(self, update: IpcWeights) -> None:
        """Map the sender's buckets on this GPU, copy each one's tensors into the model, wait, unmap."""
        flats = flat = None
        try:
            flats = ipc.open_handles(self._my_handles(update), self.device)
            for (lo, hi), flat in zip(bucket_ranges(update.bucket_sizes, len(update.names)), flats, strict=True):
                self._copy(update.names[lo:hi], bucket_views(flat, update.dtypes[lo:hi], update.shapes[lo:hi]))
        finally:
            # The copies run asynchronously: they must have read the sender's memory before it is
            # unmapped (the last reference dropped here) and before the sender writes to it again
            # (once we answer).
            if flats is not None:
                torch.cuda.synchronize(self.device)
            flats = flat = None

    async def _load_ipc(self, update: IpcWeights) -> None:
        await self._call(self._adapt, update)
        await self._call(self._copy_ipc, update)

    async def _join_group(self, spec: WeightGroupSpec) -> None:
        # Its own thread: joining blocks until every member joined; generation keeps going.
        self._wgroup = await asyncio.to_thread(WeightGroup, spec)

    def _buckets(self, update: CollectiveWeights) -> Iterable[tuple[int, int, list[torch.Tensor]]]:
        assert self._wgroup is not None
        return receive_buckets(self._wgroup, update.dtypes, update.shapes, update.bucket_sizes, device=str(self.device))

    async def _receive(self, update: CollectiveWeights) -> None:
        await self._call(self._adapt, update)
        await self._call(self._copy_buckets, update, self._buckets(update))

    async def _discard(self, update: CollectiveWeights) -> None:
        await self._call(lambda: collections.deque(self._buckets(update), maxlen=0))

    async def _leave_group(self) -> None:
        group, self._wgroup = self._wgroup, None
        if group is not None:  # off the loop: health checks keep being answered however long it takes
            await asyncio.to_thread(group.close)

    # ------------------------------------------------------------------ control

    async def _pause(self) -> None:
        pass  # nothing is in flight and model work is serialised on one thread

    async def _resume(self) -> None:
        self._wake.set()

    async def _sleep_backend(self, level: int) -> SleepState:
        if self.device.type == "cpu":
            return SleepState(level=level, memory_released=False,
                              note="HF engine on CPU: nothing to release; generation paused only")
        self._named = None  # ``to()`` replaces the buffers
        await self._call(lambda: (self.model.to("cpu"), torch.cuda.empty_cache()))
        return SleepState(level=level, memory_released=True,
                          note="HF engine: weights moved to host memory (level 2 treated as 1)")

    async def _wake_backend(self, level: int) -> None:
        if self.device.type != "cpu":
            self._named = None
            await self._call(lambda: self.model.to(self.device))

    async def _reset_prefix_cache(self) -> None:
        pass  # no prefix cache: every batch starts from an empty KV cache

    async def _weight_digest(self) -> str:
        def digest() -> str:
            h = hashlib.sha256()
            for name, t in sorted(self.model.state_dict().items()):
                h.update(name.encode())
                h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            return h.hexdigest()

        return await self._call(digest)

    def _load_counts(self) -> tuple[int, int]:
        return len(self._running), sum(r.req.sampling.n for r in self._queue)


def _served_name(name: str) -> str:
    """A parameter's name in updates: ``x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``;
    ``x.q_proj.lora_A.default.weight`` -> ``base_model.model.x.q_proj.lora_A.weight`` (PEFT's file
    name); any other name as it is."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("lora_A", "lora_B"):
            return ADAPTER_PREFIX + ".".join(parts[:i + 1] + parts[i + 2:])
    return name.replace(".base_layer.", ".")
