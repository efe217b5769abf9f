"""The DeepSpeed engine of a trained model, built from the typed config; process-group set-up.

``ds_config`` turns ``DeepSpeedConfig`` + ``OptimizerConfig`` + the batch plan into DeepSpeed's
JSON dict (pure, testable without DeepSpeed). ``build_engine`` adds the optimizer (torch AdamW,
or DeepSpeed's CPU Adam when optimizer states are offloaded; Muon: ``strategy.muon``) and the learning-rate schedule and
calls ``deepspeed.initialize``. ZeRO stages 0-3, parameter / optimizer offload, bf16 / fp16 /
fp32, clipping, AutoTP (``tensor_parallel.autotp_size``: DeepSpeed shards the model inside
``initialize``) and deepcompile (``compile.deepcompile`` + ``engine.compile()``; CUDA only) are
switches of the same code; the accelerator (CUDA + NCCL, or CPU + gloo) comes from DeepSpeed's
accelerator detection. ``build_frozen_engine`` wraps a frozen model (the reference) in a ZeRO-3
engine without optimizer.

ZeRO-3's communication knobs default to what measured fastest on 2xH200 (docs/benchmarks.md,
"GPU trainer throughput"): larger prefetch buckets and a higher persistence threshold than
DeepSpeed's own defaults. Compiled layers (``--ds.compile_layers``, on by default for ZeRO-3 on
CUDA: ``compiles_layers``) mark each decoder layer a ZeRO-3 *leaf module* (its parameters are
gathered in one piece and no hooks run inside it) and compile the layer's ``forward`` with
``torch.compile``; without the leaf marking dynamo would trace into ZeRO-3's per-submodule
hooks, which it cannot. ``overlap_comm`` unset is DeepSpeed's own default (on for ZeRO-3).

Under ring attention (``ring.group``) the engine still spans every rank: ring peers hold
partial gradients of the same parameters, and DeepSpeed's all-rank reduction sums them; only
the batch bookkeeping differs (``train_batch_size`` counts each sample once per ring rank).

Gradient accumulation is driven by the trainer: it marks the accumulation boundary itself and
scales each micro-batch's loss (``trainers.base``), so the number of micro-batches may vary
from step to step (dynamic batching) while DeepSpeed still reduces gradients once per step.

Not here: model math (``models``), the training loop (``trainers``), checkpoints (``checkpoint``).
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from treadle.common.config import ConfigError
from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.config.optim import OptimizerConfig

_NEVER = 1 << 62  # steps_per_print: DeepSpeed's own progress lines would duplicate ours
# DeepSpeed's own defaults, written out so the dict names every knob of ZeRO-3's communication.
_REDUCE_BUCKET = 500_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class DistInfo:
    """This process's place in the data-parallel group."""

    rank: int
    """Global rank."""
    world: int
    """Number of ranks."""
    local_rank: int
    """Rank on this host (picks the accelerator device)."""
    device: torch.device
    """Where this rank computes."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(launched_by_deepspeed: bool = False) -> DistInfo:
    """Join (or, for a plain single process, create) the process group; idempotent.

    Under ``torchrun`` or the ``deepspeed`` launcher the rendezvous variables are already set;
    a plain ``python -m ...`` run becomes a one-rank group on a free local port. The
    variables are set here (not read) because DeepSpeed itself requires ``LOCAL_RANK`` & co.
    """
    import os  # noqa: PLC0415  (only to hand DeepSpeed the variables it reads itself)

    import deepspeed  # noqa: PLC0415
    import deepspeed.comm as dist  # noqa: PLC0415
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    if not (torch.distributed.is_torchelastic_launched() or launched_by_deepspeed or torch.distributed.is_initialized()):
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
            os.environ.setdefault(name, value)
    accel = get_accelerator()
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
    local_rank = dist.get_local_rank()
    if accel.device_name() != "cpu":
        accel.set_device(local_rank)
    device = torch.device(accel.current_device_name())
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device)


def shutdown_distributed() -> None:
    """Leave the process group if one is open (safe to call twice, or after a failure)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def all_reduce(values: Sequence[float], device: torch.device, op: str = "sum", group: Any = None) -> list[float]:
    """Element-wise sum (or max) of ``values`` over all ranks (or those of ``group``), in float64."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        rop = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
        torch.distributed.all_reduce(t, op=rop, group=group)
    return t.tolist()


def _zero_section(ds: DeepSpeedConfig) -> dict[str, Any]:
    pin = torch.cuda.is_available()  # pinned host memory only means something next to a GPU
    zero: dict[str, Any] = {
        "stage": ds.zero_stage, "overlap_comm": ds.zero_stage == 3 if ds.overlap_comm is None else ds.overlap_comm,
        "contiguous_gradients": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if ds.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if ds.param_offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if ds.zpg > 1:
        zero["zero_hpz_partition_size"] = ds.zpg
    if ds.zero_stage == 3:
        zero.update({"reduce_bucket_size": _REDUCE_BUCKET, "stage3_max_live_parameters": ds.zero3_max_live_parameters,
                     "stage3_max_reuse_distance": ds.zero3_max_reuse_distance,
                     "stage3_prefetch_bucket_size": ds.zero3_prefetch_bucket_size,
                     "stage3_param_persistence_threshold": ds.zero3_param_persistence_threshold})
    if ds.zero_stage == 3 and ds.compile_layers:
        # ZeRO-3's memory-efficient linear replaces F.linear process-wide with an autograd function
        # whose backward reads each weight's ds_id: dynamo guards on it and recompiles every layer
        # (seen on 2xH200: the recompile limit hit after 8 of 24 layers, the rest ran uncompiled).
        zero["memory_efficient_linear"] = False
    return zero


def ds_config(ds: DeepSpeedConfig, optim: OptimizerConfig | None, *, micro_batch: int, grad_accum: int,
              world: int) -> dict[str, Any]:
    """DeepSpeed's config dict; ``optim`` None builds an inference-only (frozen) engine."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world,
        "gradient_clipping": optim.max_norm if optim is not None else 0.0,
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": _zero_section(ds),
        "bf16": {"enabled": ds.param_dtype == "bf16"},
        "fp16": {"enabled": ds.param_dtype == "fp16", "initial_scale_power": 16},
    }
    if optim is not None and optim.optim == "muon":
        # DeepSpeed's ZeRO-3 refuses Muon with reduce-scatter (Newton-Schulz needs whole gradients),
        # and ZeRO-Offload refuses a client optimizer other than its CPU Adam unless told it is
        # meant: Muon's AdamW half is that CPU Adam (strategy.muon).
        if ds.zero_stage == 3:
            cfg["zero_optimization"]["reduce_scatter"] = False
        if ds.adam_offload:
            cfg["zero_force_ds_cpu_optimizer"] = False
    if ds.grad_accum_dtype is not None:
        cfg["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype}
    if ds.tensor_parallel_size > 1:
        # The log-prob code needs every rank to see the whole vocabulary's logits: a
        # vocabulary-parallel LM head (DeepSpeed's default for tied embeddings) would leave each
        # rank a slice. DeepSpeed's batch check counts ranks differently under ZeRO-3 + AutoTP
        # (all ranks, then the data-parallel ones), so it derives train_batch_size itself.
        cfg["tensor_parallel"] = {"autotp_size": ds.tensor_parallel_size, "vocab_parallel_lm_head": False}
        del cfg["train_batch_size"]
    if ds.deepcompile:
        cfg["compile"] = {"deepcompile": True}
    return cfg


def build_optimizer(model: torch.nn.Module, optim: OptimizerConfig, *, offload: bool,
                    movable: bool = False) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; biases and norm weights (1-D) get no weight decay.
    ``offload``: DeepSpeed's CPU Adam (--ds.adam_offload). ``movable`` (--ds.enable_sleep on a
    GPU): DeepSpeed's FusedAdam, the only optimizer ZeRO-3's ``offload_states`` moves (it asserts
    so; torch's fused AdamW failed there on an H200 at the first offload). ``--optim muon``:
    ``strategy.muon.build_muon`` (``movable`` is refused with it at parse time)."""
    if optim.optim == "muon":
        from treadle.trainer.strategy.muon import build_muon  # noqa: PLC0415

        return build_muon(model, optim, offload=offload)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.adam.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kw = {"lr": optim.adam.lr, "betas": optim.adam.betas, "eps": optim.adam.eps}
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415  (JIT-builds its op on first use)

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
    if movable:
        from deepspeed.ops.adam import FusedAdam  # noqa: PLC0415  (JIT-builds its CUDA op on first use)

        from treadle.common.env import scoped_environ  # noqa: PLC0415

        # Read, not set by treadle: the machine's own arch list, rewritten for the build only.
        arch = jit_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        with scoped_environ({} if arch is None else {"TORCH_CUDA_ARCH_LIST": arch}):
            return FusedAdam(groups, adam_w_mode=True, **kw)
    return torch.optim.AdamW(groups, fused=torch.cuda.is_available(), **kw)


_ARCH = re.compile(r"(\d+)\.(\d+)[a-z]?(\+PTX)?")


def jit_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT op builder can read it, or None to leave it be.

    DeepSpeed (0.19) sorts the entries by ``int()`` of each number, so an arch-specific entry such
    as ``9.0a`` (what the H200 image sets) fails the build with "invalid literal for int() with
    base 10: '0a'". The suffix only unlocks arch-specific instructions, which DeepSpeed's fused
    ops do not use: ``9.0a`` becomes ``9.0`` (``+PTX`` stays), repeats are dropped. Unset or
    already-readable lists give None; an entry that is no arch at all is left for DeepSpeed to
    report, so it gives None too.
    """
    if not value or not value.strip():
        return None
    entries = value.replace(";", " ").split()
    matches = [_ARCH.fullmatch(e) for e in entries]
    if not all(matches):
        return None
    out = list(dict.fromkeys(f"{m[1]}.{m[2]}{m[3] or ''}" for m in matches))
    return None if out == entries else ";".join(out)


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimizerConfig, total_steps: int) -> Any:
    """transformers' schedule ``optim.lr_scheduler`` over ``total_steps`` optimizer steps."""
    from transformers import get_scheduler  # noqa: PLC0415

    warmup = math.ceil(optim.lr_warmup_ratio * total_steps)
    extra: dict[str, Any] = {}
    if optim.lr_scheduler in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        extra = {"min_lr_rate": optim.min_lr_ratio}
    elif optim.lr_scheduler == "warmup_stable_decay":
        extra = {"num_decay_steps": max(1, (total_steps - warmup) // 10), "min_lr_ratio": optim.min_lr_ratio}
    return get_scheduler(optim.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         scheduler_specific_kwargs=extra or None)


def grad_accum_steps(batch_size: int, micro_batch: int, world: int) -> int:
    """Nominal micro-batches per rank per step; ConfigError when the batch does not divide."""
    if batch_size % (micro_batch * world):
        raise ConfigError(f"--train.batch_size {batch_size} must be a multiple of --train.micro_batch_size "
                          f"{micro_batch} x {world} ranks")
    return batch_size // (micro_batch * world)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model: modules of the classes it names in
    ``_no_split_modules`` (none for other models)."""
    names = next((set(m._no_split_modules) for m in model.modules() if getattr(m, "_no_split_modules", None)), set())
    return [m for m in model.modules() if type(m).__name__ in names]


def compiles_layers(ds: DeepSpeedConfig, accelerator: str, model: torch.nn.Module) -> bool:
    """Whether ``build_engine`` compiles ``model``'s decoder layers: ``--ds.compile_layers`` where
    given; unset, for ZeRO-3 on CUDA (measured there: docs/benchmarks.md, "GPU trainer
    throughput") unless LoRA, ring attention, AutoTP, 4-bit weights, parameter offload or
    deepcompile is on (never tried together) or Liger's kernels are (compiled around them, the
    step died of an illegal memory access on an H200), and only for models with decoder-layer classes."""
    if ds.compile_layers is not None:
        return ds.compile_layers
    untried = (ds.lora.rank > 0 or ds.ring_attn_size > 1 or ds.tensor_parallel_size > 1 or ds.load_in_4bit
               or ds.param_offload or ds.deepcompile or ds.use_liger_kernel)
    return accelerator == "cuda" and ds.zero_stage == 3 and not untried and bool(decoder_layers(model))


def compile_layers(model: torch.nn.Module, ds: DeepSpeedConfig) -> int:
    """Under ZeRO-3 mark ``model``'s decoder layers leaf modules, then compile each layer's forward;
    returns how many. Call before ``deepspeed.initialize`` (it places ZeRO-3's hooks).

    The bound ``forward`` is compiled, not the module: the module's ``__call__`` runs DeepSpeed's
    gather/release hooks, which must stay outside the compiled graph. The layers share one code
    object, so dynamo should compile it once per input shape; should anything still make it
    compile per layer, dynamo's process-wide recompile limit is raised to the layer count (plus
    room for other shapes) so that no layer silently falls back to running uncompiled.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(f"--ds.compile_layers: {type(model).__name__} names no decoder-layer class "
                          "(_no_split_modules); leave the flag off for this model")
    import torch._dynamo.config as dynamo_config  # noqa: PLC0415

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 2 * len(layers) + 8)
    if ds.zero_stage == 3:
        from deepspeed.utils import set_z3_leaf_modules  # noqa: PLC0415

        set_z3_leaf_modules(model, sorted({type(m) for m in layers}, key=lambda c: c.__name__))
    from torch._dynamo.exc import TorchDynamoException  # noqa: PLC0415

    from treadle.trainer.ops.compiled import CompiledOrEager  # noqa: PLC0415

    failed = [False]  # one failed compile leaves every layer eager
    for layer in layers:
        layer.forward = CompiledOrEager(layer.forward, "decoder layers", catch=(TorchDynamoException,), failed=failed,
                                        hint="; --ds.compile_layers False skips the attempt")
    return len(layers)


def build_engine(model: torch.nn.Module, ds: DeepSpeedConfig, optim: OptimizerConfig, *, micro_batch: int,
                 grad_accum: int, world: int, total_steps: int) -> Any:
    """A training ``DeepSpeedEngine`` around ``model`` with its optimizer and schedule (compiled
    by deepcompile when ``--ds.deepcompile``; with ``--ds.compile_layers``, compiled decoder layers)."""
    import deepspeed  # noqa: PLC0415
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    check_deepcompile(ds, get_accelerator().device_name())
    check_autotp(ds, model)
    ds = replace(ds, compile_layers=compiles_layers(ds, get_accelerator().device_name(), model))
    if ds.compile_layers:
        compile_layers(model, ds)
    optimizer = build_optimizer(model, optim, offload=ds.adam_offload,
                                movable=ds.enable_sleep and get_accelerator().device_name() == "cuda")
    scheduler = build_scheduler(optimizer, optim, total_steps)
    config = ds_config(ds, optim, micro_batch=micro_batch, grad_accum=grad_accum, world=world)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if ds.deepcompile:
        engine.compile()  # the config only enables it: without compile() DeepSpeed runs eagerly
    return engine


def check_deepcompile(ds: DeepSpeedConfig, accelerator: str) -> None:
    """ConfigError unless deepcompile can run: DeepSpeed 0.19 enables it only on the ``cuda``
    accelerator (``deepspeed.compile.util.is_deepcompile_supported``) and for ZeRO stages 1-3
    (stage 0 silently falls back to plain torch.compile)."""
    if not ds.deepcompile:
        return
    if accelerator != "cuda":
        raise ConfigError(f"--ds.deepcompile needs CUDA: DeepSpeed's deepcompile runs only on the cuda accelerator, "
                          f"this run's is {accelerator}; drop the flag")
    if ds.zero_stage == 0:
        raise ConfigError("--ds.deepcompile needs --ds.zero_stage 1, 2 or 3 (DeepSpeed compiles its ZeRO passes)")


def check_autotp(ds: DeepSpeedConfig, model: torch.nn.Module) -> None:
    """ConfigError for AutoTP layouts DeepSpeed 0.19 cannot train: under ZeRO-3 a rank left without
    an attention shard (more tensor-parallel ranks than key/value heads) fails in the first forward."""
    size = ds.tensor_parallel_size
    heads = getattr(getattr(model, "config", None), "num_key_value_heads", None)
    if size > 1 and ds.zero_stage == 3 and heads is not None and size > heads:
        raise ConfigError(f"--ds.tensor_parallel_size {size} exceeds the model's {heads} key/value heads: "
                          "with --ds.zero_stage 3 every tensor-parallel rank needs an attention shard; "
                          f"use at most {heads} or ZeRO stage 0-2")


def frozen_config(ds: DeepSpeedConfig, *, offload: bool, world: int, hidden_size: int | None) -> dict[str, Any]:
    """DeepSpeed config of a frozen model sharded with ZeRO-3 (no optimizer): the reference policy.

    ``offload`` keeps the parameter shards in CPU memory (ZeRO param offload). Tensors smaller
    than 10 x hidden size (norms, biases) stay whole on every rank, the rule transformers'
    DeepSpeed integration uses for ``stage3_param_persistence_threshold="auto"``: gathering them
    for every forward costs more latency than their memory is worth.
    """
    zero: dict[str, Any] = {"stage": 3}
    if hidden_size:
        zero["stage3_param_persistence_threshold"] = 10 * hidden_size
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
        "steps_per_print": _NEVER, "wall_clock_breakdown": False, "zero_optimization": zero,
        "bf16": {"enabled": ds.param_dtype == "bf16"}, "fp16": {"enabled": ds.param_dtype == "fp16"},
    }


def build_frozen_engine(model: torch.nn.Module, ds: DeepSpeedConfig, *, offload: bool, world: int) -> Any:
    """A ZeRO-3 ``DeepSpeedEngine`` around frozen ``model``, in eval mode (collective: every rank
    calls it, and afterwards every rank must run the same number of forwards)."""
    import deepspeed  # noqa: PLC0415

    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    config = frozen_config(ds, offload=offload, world=world, hidden_size=hidden)
    engine, *_ = deepspeed.initialize(model=model.eval().requires_grad_(False), config=config)
    engine.eval()
    return engine
