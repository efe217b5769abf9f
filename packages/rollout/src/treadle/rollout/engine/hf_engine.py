"""The HF backend: a transformers causal LM with a batched sampling loop and a KV cache.

The reference engine (its logprobs are the model's own) and the fallback where vLLM cannot run,
e.g. the receiving side of NCCL weight sync on a GPU machine without vLLM: nothing here is
CPU-specific (``device`` in the config). On a GPU it also takes ``cuda_ipc`` updates from a
sender on the same GPU (``engine.ipc``): it maps the sender's buckets and copies from them.

Scheduling is static batching: when the loop is free it takes the queued requests (up to
``max_batch_samples`` samples), left-pads their prompts, prefills once and decodes step by step,
dropping finished rows from the cache; requests arriving meanwhile wait for the next batch. Each
sample is returned the moment it finishes. All model work (steps, scoring, weight loads,
collective receives) runs on one worker thread: serialised, and never on the event loop.

What this module does not do: continuous batching, prefix caching or paged KV (vLLM's job).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from treadle.common.log import get_logger
from treadle.common.records import FinishReason, GenerateRequest, GenerateResult, WeightUpdate
from treadle.rollout.engine.base import Engine
from treadle.rollout.engine.group import GroupSpec, WeightGroup, receive_flats
from treadle.rollout.engine.sampling import GREEDY_EPS, mask_stop_tokens, processed_logprobs, sample
from treadle.rollout.engine.state import SleepState
from treadle.rollout.engine.weights import (
    WeightMismatch,
    WeightSpec,
    bucket_layout,
    bucket_ranges,
    mirror_spans,
    model_eos_ids,
    span_views,
    spec_from_checkpoint,
    tensor_nbytes,
    word_dtype,
    word_views,
)

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
    arms = True

    def __init__(self, config: HfEngineConfig) -> None:
        super().__init__(engine_id=config.engine_id, initial_version=config.initial_version)
        self.config = config
        self.device = torch.device(config.device)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{config.engine_id}-model")
        self._calls = 0  # ``_call``s in flight on the model thread
        self._queue: collections.deque[_Request] = collections.deque()
        self._running: list[_Row] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._wgroup: WeightGroup | None = None
        self._uuid: str | None = None  # the GPU's UUID (``ipc.device_uuid``), read at start
        self._named: tuple[Any, dict[str, Any], dict[str, Any]] | None = None  # ``_targets``
        self._mapped: _Mapped | None = None  # the sender's storages kept mapped (``ipc_keep``)
        self._event: tuple[Any, bytes] | None = None  # the CUDA IPC event early answers hand out, its handle
        self._mirror: _Mirror | None = None  # the parameters laid out as a sender's storages (``_mirrored``)
        self._eos: tuple[int, ...] = ()
        self._fallback = torch.Generator(device=self.device).manual_seed(config.seed)
        self.model: Any = None

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the model thread."""
        self._calls += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._calls -= 1

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
            from treadle.rollout.engine.ipc import device_uuid

            self._uuid = await self._call(device_uuid, self.device)
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
        for row in self._running:  # the cancelled batch's samples still owe their consumers a result
            row.r.results.put_nowait(self._result(row.r, row.index, row.tokens, row.logprobs, "abort"))
        self._running = []
        self._unmap()
        self._mirror = None
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
                r.results.put_nowait(self._result(r, i, [], [], "abort"))
            n += r.req.sampling.n
        return n

    def _result(self, r: _Request, index: int, tokens: list[int], logprobs: list[float],
                reason: FinishReason) -> GenerateResult:
        sp = r.req.sampling
        return GenerateResult(
            response_token_ids=np.asarray(tokens, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32) if sp.logprobs else None,
            prompt_logprobs=r.prompt_lp if sp.prompt_logprobs else None,
            finish_reason=reason, index=index, key=r.req.key, weight_version=r.version,
            engine_id=self.engine_id)

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
                    row.r.results.put_nowait(self._result(row.r, row.index, row.tokens, row.logprobs, reason))
                self._running = state.rows
        except Exception:  # a failed step must not kill the loop: fail this batch, keep serving
            log.exception("engine %s: batch failed", self.engine_id)
            for row in self._running:
                row.r.results.put_nowait(self._result(row.r, row.index, row.tokens, row.logprobs, "error"))
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
        keep = []
        for b, (row, tok) in enumerate(zip(st.rows, tokens.tolist(), strict=True)):
            row.tokens.append(tok)
            row.logprobs.append(picked[b])
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
    def _score(self, ids: np.ndarray) -> np.ndarray:
        """float32 [P-1]: log p(ids[t] | ids[:t]) for t >= 1, from one forward pass."""
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.device).unsqueeze(0)
        logits = self.model(input_ids=x, use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:].unsqueeze(1)).squeeze(1)
        return lp.cpu().numpy().astype(np.float32)

    async def _prompt_logprobs(self, ids: np.ndarray) -> np.ndarray:
        return await self._call(self._score, ids)

    # ------------------------------------------------------------------ weights

    @torch.inference_mode()
    def _copy_in(self, buckets: Any) -> None:
        """Copy lists of ``(name, tensor)`` pairs into the model's parameters/buffers (a tied head
        follows), one multi-tensor copy per list (a bucket): a few kernel launches per bucket
        instead of one per tensor. ``buckets`` may be lazy (buckets still arriving)."""
        params = self._targets()
        skip = self.weight_spec.skip
        for bucket in buckets:
            pairs = [(params[name], t) for name, t in bucket if name not in skip]
            if pairs:
                torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])

    @torch.inference_mode()
    def _copy_flats(self, update: WeightUpdate, flats: Iterable[torch.Tensor]) -> None:
        """Copy ``update``'s packed buckets (flat uint8 ``bucket_layout`` buffers; may be lazy:
        buckets still arriving) into the model: each bucket is cut into its tensors' bytes by one
        split (``word_views``, as 8-byte words where the sizes allow) and copied into the
        parameters' bytes, seen as the same words, by one multi-tensor copy (``_word_pairs``)."""
        for (lo, hi), flat in zip(bucket_ranges(update.bucket_sizes, len(update.names)), flats, strict=True):
            size, pieces = word_views(flat, update.dtypes[lo:hi], update.shapes[lo:hi])
            pairs: _Pairs = {}
            self._word_pairs(pairs, size, range(lo, hi), pieces, update)
            _copy_pairs(pairs)

    @torch.inference_mode()
    def _copy_pieces(self, update: WeightUpdate, storages: list[torch.Tensor]) -> _Pairs:
        """Copy ``update``'s tensors from the sender's own memory (``ipc_pieces``: each tensor's
        bytes in one of the mapped ``storages``, flat uint8) into the model: one copy a storage
        where the parameters are laid out as the sender's are (``_mirrored``), else as
        ``_copy_flats`` does from buckets: one split a storage (``span_views``), one multi-tensor
        copy a word size. Returns the copies made, to do again for the same pieces of the same
        storages (``_Mapped``)."""
        spans: dict[int, list[int]] = collections.defaultdict(list)  # storage -> the tensors in it
        skip = self.weight_spec.skip  # left out before the split: a tied name's bytes may overlap its twin's
        for i, (k, _, _) in enumerate(update.ipc_pieces):
            if update.names[i] not in skip:
                spans[k].append(i)
        pairs: _Pairs = {}
        mirrored = self._mirrored(update, storages, spans)
        if mirrored is not None:
            pairs[0] = mirrored
            _copy_pairs(pairs)
            return pairs
        for k, idx in spans.items():
            size, views = span_views(storages[k], [update.ipc_pieces[i][1:] for i in idx])
            self._word_pairs(pairs, size, idx, views, update)
        _copy_pairs(pairs)
        return pairs

    def _mirrored(self, update: WeightUpdate, storages: list[torch.Tensor], spans: dict[int, list[int]]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """``(destinations, sources)``: one copy a storage, from the span of each mapped storage
        that holds the sent tensors into a buffer of the engine's own where its parameters lie as
        they do in the sender's (``_Mirror``: the parameters' data rebound to views of it, made at
        the first in-place update of a layout; their old values are not kept: every sent byte is
        copied in). None, to copy tensor by tensor, where the layout does not allow it (a tensor
        whose bytes are not aligned to its dtype, overlapping tensors, storages whose span is
        mostly other bytes: ``mirror_spans``) or for an update without ``ipc_keep``."""
        m = self._mirror
        if m is not None and m.names == update.names and m.pieces == update.ipc_pieces and m.intact():
            return m.bufs, [storages[k][lo:hi] for k, lo, hi in m.spans]
        if not update.ipc_keep:  # a sender that frees its memory between syncs sleeps us too (which drops
            return None  # the mirror): laying it out again at every sync would cost more than it saves
        plan = mirror_spans(update.dtypes, update.ipc_pieces, spans)
        if plan is None:
            return None
        self._mirror = None
        targets = self._targets()
        laid: list[tuple[int, int, int, torch.Tensor]] = []
        with torch.inference_mode(False):  # the parameters' data must not become inference tensors
            for k, lo, hi in plan:
                buf = torch.empty(hi - lo, dtype=torch.uint8, device=self.device)  # every sent byte is copied in next
                for i in spans[k]:
                    _, off, nbytes = update.ipc_pieces[i]
                    t = targets[update.names[i]]
                    t.data = buf[off - lo:off - lo + nbytes].view(t.dtype).view(t.shape)
                laid.append((k, lo, hi, buf))
        self._named[2].clear()  # word views of the parameters' old storages, now freed
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the old storages go back to the device (a model's worth), once
        first = [targets[update.names[spans[k][0]]] for k, _, _, _ in laid]
        self._mirror = _Mirror(names=update.names, pieces=update.ipc_pieces, spans=[(k, lo, hi) for k, lo, hi, _ in laid],
                               bufs=[b for *_, b in laid], firsts=first,
                               at=[b.data_ptr() + update.ipc_pieces[spans[k][0]][1] - lo for k, lo, _, b in laid])
        log.info("engine %s: parameters laid out as the sender's storages (%d spans, %.1f MB): an in-place "
                 "update is one copy a span", self.engine_id, len(laid), sum(hi - lo for _, lo, hi in plan) / 1e6)
        return self._mirror.bufs, [storages[k][lo:hi] for k, lo, hi in self._mirror.spans]

    def _word_pairs(self, pairs: _Pairs, size: int, indices: Iterable[int], pieces: Iterable[torch.Tensor],
                    update: WeightUpdate) -> None:
        """Add to ``pairs`` the copies of ``update``'s tensors ``indices``, whose bytes are
        ``pieces`` (``size``-byte words), into the parameters' bytes seen as the same words (views
        made once per model, ``_named[2]``). A parameter of another dtype than the header's, or
        whose bytes cannot be seen as those words (not expected: the header was checked against
        the engine's), gets a typed copy (``pairs[0]``). Tied names (``skip``) get none."""
        targets, words, skip = self._targets(), self._named[2], self.weight_spec.skip
        for i, piece in zip(indices, pieces, strict=True):
            name, dtype = update.names[i], update.dtypes[i]
            if name in skip:
                continue
            key = (name, dtype, size)
            if key not in words:
                words[key] = _as_words(targets[name], dtype, size)
            dst, src = pairs.setdefault(0 if words[key] is None else size, ([], []))
            if words[key] is None:
                dst.append(targets[name])
                src.append(piece.view(torch.uint8).view(getattr(torch, dtype)).view(targets[name].shape))
            else:
                dst.append(words[key])
                src.append(piece)

    def _targets(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by name, listed once (a walk of the module tree
        costs a few ms on a 1.5B model, ahead of the first bucket's receive); the same objects
        for the model's life (``to()`` and in-place loads keep them). ``_named[2]`` keeps their
        word views for ``_copy_flats``, made at first use, until ``to()`` moves their storage
        (``_drop_words``)."""
        if self._named is None or self._named[0] is not self.model:
            self._named = (self.model, dict(self.model.named_parameters()) | dict(self.model.named_buffers()), {})
        return self._named[1]

    def _drop_words(self) -> None:
        """Forget the word views: ``to()`` moves the parameters' data to new storage (sleep, wake),
        the views would still point into (and keep alive) the old one."""
        if self._named is not None:
            self._named[2].clear()
        self._mirror = None  # the parameters no longer lie in its buffers
        self._unmap()  # its copies write into those views

    def _unmap(self) -> None:
        """Drop the kept mapping (unmapping the sender's storages) once the copies made from it
        have read them: an early answer (``ipc_event``) left them running."""
        if self._mapped is not None:
            torch.cuda.synchronize(self.device)
            self._mapped = None

    def _record_event(self) -> bytes:
        """Record the engine's CUDA IPC event after the queued copies; its handle (made once)."""
        if self._event is None:
            with torch.cuda.device(self.device):
                event = torch.cuda.Event(interprocess=True)
                self._event = (event, bytes(event.ipc_handle()))
        self._event[0].record(torch.cuda.current_stream(self.device))
        return self._event[1]

    async def _load(self, update: WeightUpdate, tensors: list[Any]) -> None:
        await self._call(self._copy_in, [list(zip(update.names, tensors, strict=True))])

    async def _check_ipc(self, update: WeightUpdate) -> None:
        from treadle.rollout.engine.ipc import check_colocated, loads

        if self._mapped is not None and self._mapped.serves(update):
            return  # checked when it was mapped, and its storages have not changed
        handles = [loads(h) for h in update.ipc_handles]
        if update.ipc_pieces:  # the sender's own tensors: each piece inside its storage, of its tensor's size
            for i, (k, off, nbytes) in enumerate(update.ipc_pieces):
                need = tensor_nbytes(update.dtypes[i], update.shapes[i])
                if nbytes != need or off + nbytes > handles[k].numel:
                    raise WeightMismatch(f"cuda_ipc piece of {update.names[i]}: {nbytes} bytes at {off} of a "
                                         f"{handles[k].numel}-byte storage; the tensor has {need}")
            for h in {h.device_uuid: h for h in handles}.values():  # one per GPU
                check_colocated(h, self.device, mine=self._uuid)
            return
        offsets = bucket_ranges(update.bucket_sizes, len(update.names))
        for h, (lo, hi) in zip(handles, offsets, strict=True):
            need = bucket_layout(update.dtypes[lo:hi], update.shapes[lo:hi])[1]
            if h.numel != need:
                raise WeightMismatch(f"cuda_ipc bucket of tensors [{lo}, {hi}) has {h.numel} bytes, its "
                                     f"layout needs {need}")
        if handles:
            check_colocated(handles[0], self.device, mine=self._uuid)

    @torch.inference_mode()
    def _copy_ipc(self, update: WeightUpdate) -> None:
        """Map the sender's buckets or storages, copy their tensors into the model, wait, unmap;
        or, for an in-place update the sender lets us keep (``ipc_keep``), keep them mapped with
        the copies' views (``_Mapped``), and map nothing the next time the same handles come;
        with ``ipc_event`` too, record the event the answer hands out instead of waiting."""
        from treadle.rollout.engine.ipc import open_handles

        kept = self._mapped
        if kept is not None and kept.handles != update.ipc_handles:
            self._unmap()  # other storages: unmapped here (the last reference to the old ones)
            kept = None
        self._mapped = None
        flats: list[torch.Tensor] = []
        done = False
        try:
            flats.extend(kept.storages if kept is not None else open_handles(update.ipc_handles, self.device))
            self._load_stamps["mapped"] = time.time()
            if kept is not None and kept.serves(update):
                pairs = kept.pairs
                _copy_pairs(pairs)
            elif update.ipc_pieces:
                kept = None  # its copies' views of the parameters' storages, which a mirror would free
                pairs = self._copy_pieces(update, flats)
            else:
                self._copy_flats(update, flats)
            self._load_stamps["copying"] = time.time()  # the copies are queued
            done = True
        finally:
            # The copies run asynchronously: they must have read the sender's memory before it is
            # unmapped (the last reference dropped) and before the sender writes to it again: we
            # answer once they are done, or (``ipc_event``: the storages stay mapped) at once,
            # with an event recorded after them that the sender's stream waits on.
            if done and update.ipc_event:
                self.last_event = self._record_event()
            else:
                torch.cuda.synchronize(self.device)
                self._load_stamps["copied"] = time.time()
            if done and update.ipc_pieces and update.ipc_keep:
                self._mapped = _Mapped(handles=list(update.ipc_handles), storages=flats, names=update.names,
                                       pieces=update.ipc_pieces, pairs=pairs)
            flats = []

    async def _load_ipc(self, update: WeightUpdate) -> None:
        if update.ipc_event and self._calls == 0 and self._mapped is not None and self._mapped.serves(update):
            # A kept mapping's copies are only queued, with the event after them: done here, on
            # the loop, while the model thread is idle (no call in flight, and none can start
            # before this returns), which spares two thread hops (~0.5 ms on an H200 host).
            with torch.cuda.device(self.device):
                self._copy_ipc(update)
            return
        await self._call(self._copy_ipc, update)

    async def _join_group(self, spec: GroupSpec) -> None:
        # Its own thread: joining blocks until every member joined; generation keeps going.
        self._wgroup = await asyncio.to_thread(WeightGroup, spec)

    def _buckets(self, update: WeightUpdate) -> Iterator[torch.Tensor]:
        assert self._wgroup is not None
        return receive_flats(self._wgroup, update.dtypes, update.shapes, update.bucket_sizes, device=str(self.device))

    async def _receive(self, update: WeightUpdate) -> None:
        await self._call(self._copy_flats, update, self._buckets(update))

    def _arm(self, update: WeightUpdate, timeout_s: float, stamps: dict[str, float]) -> asyncio.Future[bool]:
        group = self._wgroup
        assert group is not None

        def wait_then_receive() -> bool:  # on the model thread: nothing else runs while armed
            if not group.wait_signal(update.version, timeout_s):
                return False
            stamps["signalled"] = stamps["loading"] = time.time()
            self._copy_flats(update, self._buckets(update))
            return True

        return asyncio.get_running_loop().run_in_executor(self._pool, wait_then_receive)

    async def _discard(self, update: WeightUpdate) -> None:
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
        self._drop_words()  # they hold the GPU storage (and would copy into it after the wake)
        await self._call(lambda: (self.model.to("cpu"), torch.cuda.empty_cache()))
        return SleepState(level=level, memory_released=True,
                          note="HF engine: weights moved to host memory (level 2 treated as 1)")

    async def _wake_backend(self, level: int) -> None:
        if self.device.type != "cpu":
            self._drop_words()
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


_Pairs = dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]
"""A load's copies: word size -> (destinations, sources); 0: typed copies, one by one."""


@dataclass(slots=True, kw_only=True)
class _Mapped:
    """A sender's storages kept mapped after an in-place update that allows it
    (``WeightUpdate.ipc_keep``: the sender keeps them alive and in place until its next update),
    with the copies made from them: the next update of the same handles, names and pieces maps
    nothing and makes no views. Dropped at any other update, at sleep and wake (the copies'
    destinations move) and at close; dropping it unmaps the storages."""

    handles: list[bytes]
    storages: list[torch.Tensor]
    names: list[str]
    pieces: list[tuple[int, int, int]]
    pairs: _Pairs

    def serves(self, update: WeightUpdate) -> bool:
        """``update`` names the same handles and the same tensors in the same places: its copies
        are this mapping's."""
        return self.handles == update.ipc_handles and self.names == update.names and self.pieces == update.ipc_pieces


@dataclass(slots=True, kw_only=True)
class _Mirror:
    """The model's parameters laid out as a sender's storages are (``_mirrored``): each span
    ``(storage, lo, hi)`` of the sender's memory has a buffer of the engine's own whose bytes
    lie as they do there, and the parameters are views of those buffers. Valid while the
    parameters stay in them (``to()`` at sleep or wake moves them: dropped there)."""

    names: list[str]
    pieces: list[tuple[int, int, int]]
    spans: list[tuple[int, int, int]]
    bufs: list[torch.Tensor]
    firsts: list[torch.Tensor]  # the first parameter laid in each buffer
    at: list[int]  # and where its data was put

    def intact(self) -> bool:
        """The parameters still lie in the buffers (checked on each buffer's first)."""
        return all(t.data_ptr() == a for t, a in zip(self.firsts, self.at, strict=True))


def _copy_pairs(pairs: _Pairs) -> None:
    """Run ``_word_pairs``' copies: one multi-tensor copy a word size, the typed ones one by one."""
    for size, (dst, src) in pairs.items():
        if size:
            torch._foreach_copy_(dst, src)
        else:
            for d, t in zip(dst, src, strict=True):
                d.copy_(t)


def _as_words(t: torch.Tensor, dtype: str, size: int) -> torch.Tensor | None:
    """``t``'s bytes as a 1-d view of ``size``-byte words, when ``t`` is contiguous, of ``dtype``
    and its bytes can be seen so; else None."""
    if str(t.dtype).removeprefix("torch.") != dtype or not t.is_contiguous():
        return None
    try:
        return t.detach().view(-1).view(torch.uint8).view(word_dtype(size))
    except RuntimeError:  # its size or offset is not a multiple of the word
        return None
