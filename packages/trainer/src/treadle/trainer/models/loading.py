"""Loading transformers models and tokenizers the way the ``ds`` / ``actor`` config says.

Resolves the attention kernel (flash-attention where installed on CUDA; packed rows on CUDA
without it: ``treadle_varlen``, PyTorch's varlen flash kernel, since SDPA would materialise a
block-diagonal mask over the whole row; else SDPA; unless the user named one; ring attention
when ``--ds.ring_attn_size > 1``), the parameter dtype,
gradient checkpointing, LoRA adapters (peft) and Liger's kernels (``--ds.use_liger_kernel``). The
model is returned on the CPU: placing it is DeepSpeed's job (``strategy.deepspeed``).

Not here: distributed wiring, optimizers, saving (``checkpoint.export``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from treadle.common.config import ConfigError
from treadle.trainer.config.deepspeed import DeepSpeedConfig, LoraConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attn_implementation(requested: str | None, *, packing: bool = False, cuda: bool | None = None,
                        varlen_kernel: str = "auto") -> str:
    """The attention kernel to use: ``requested``, or flash_attention_2 on CUDA with flash-attn,
    else on CUDA with ``packing`` treadle_varlen (``ops.varlen_attention``, registered here with
    ``varlen_kernel``), else sdpa.

    On 2xH200, packed 32k-token rows ran 5x slower with SDPA than with treadle_varlen and the
    1.35B model ran out of memory (docs/benchmarks.md, "GPU trainer throughput").
    """
    from treadle.trainer.ops.varlen_attention import VARLEN_ATTN_NAME, register  # noqa: PLC0415

    cuda = torch.cuda.is_available() if cuda is None else cuda
    # FlashAttention-2's compiled module: flash-attn-4 installs a ``flash_attn`` package too (``.cute``)
    flash = importlib.util.find_spec("flash_attn_2_cuda") is not None and cuda
    if requested is None:
        requested = "flash_attention_2" if flash else VARLEN_ATTN_NAME if packing and cuda else "sdpa"
    if requested == VARLEN_ATTN_NAME:
        return register(varlen_kernel)
    if requested.startswith("flash_attention") and not flash:
        raise ConfigError(f"--ds.attn_implementation {requested} needs CUDA and the flash-attn package; "
                          "use sdpa (or leave the flag unset to choose automatically)")
    return requested


def ring_attn_implementation(requested: str | None) -> str:
    """The ring-attention implementation (``ring.attention``), registered with transformers.

    The ring picks its own kernel (ring-flash-attn on CUDA where installed, else PyTorch), so a
    user-named kernel other than flash_attention_2 (which the ring kernel on CUDA is) is an error.
    """
    from treadle.trainer.ring.attention import register  # noqa: PLC0415

    if requested not in (None, "flash_attention_2"):
        raise ConfigError(f"--ds.attn_implementation {requested} cannot be combined with --ds.ring_attn_size > 1: "
                          "ring attention brings its own kernel (leave the flag unset)")
    return register()


def load_tokenizer(path: str, *, use_fast: bool = True, chat_template: str | None = None) -> Any:
    """The tokenizer of ``path``, with a pad token (EOS when it has none) and an optional chat template."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(path, use_fast=use_fast)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _common_kwargs(ds: DeepSpeedConfig) -> dict[str, Any]:
    ring = ds.ring_attn_size > 1
    if ring:
        attn = ring_attn_implementation(ds.attn_implementation)
    else:
        attn = attn_implementation(ds.attn_implementation, packing=ds.packing_samples, varlen_kernel=ds.varlen_kernel)
    kw: dict[str, Any] = {"dtype": DTYPES[ds.param_dtype], "attn_implementation": attn}
    if ds.experts_implementation is not None:
        kw["experts_implementation"] = ds.experts_implementation
    if ds.load_in_4bit:
        from transformers import BitsAndBytesConfig  # noqa: PLC0415

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("--ds.load_in_4bit needs bitsandbytes: pip install 'treadle-trainer[qlora]'")
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=DTYPES[ds.param_dtype])
    return kw


def load_causal_lm(path: str, ds: DeepSpeedConfig, *, trainable: bool, gradient_checkpointing: bool = False,
                   reentrant: bool = False) -> torch.nn.Module:
    """A ``AutoModelForCausalLM`` from ``path``: trainable (dropout as configured, checkpointing,
    LoRA) or frozen (eval mode, no gradients)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(path, **_common_kwargs(ds))
    model.config.use_cache = False
    if ds.use_liger_kernel:
        apply_liger(model)
    return prepare(model, ds, trainable=trainable, gradient_checkpointing=gradient_checkpointing, reentrant=reentrant)


def load_backbone(path: str, ds: DeepSpeedConfig) -> torch.nn.Module:
    """The base model (no LM head) of ``path`` (a causal LM or a sequence-classification model)."""
    from transformers import AutoModel  # noqa: PLC0415

    model = AutoModel.from_pretrained(path, **_common_kwargs(ds))
    model.config.use_cache = False
    if ds.use_liger_kernel:
        apply_liger(model)
    return model


LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}
"""What ``--ds.use_liger_kernel`` patches in: Liger's Triton RoPE, RMSNorm and SwiGLU-MLP kernels.
Its fused linear cross-entropy is left out: it replaces the forward's ``labels`` loss, which no
treadle loss calls (log-probs come from the logits, ``ops.logprobs``, at target columns only);
OpenRLHF's ``AutoLigerKernelForCausalLM`` likewise computes the actor's logits unfused."""


def liger_model_types() -> frozenset[str]:
    """The ``config.model_type`` values Liger has kernels for (needs liger-kernel)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: PLC0415

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def check_liger(paths: list[str], *, cuda: bool | None = None) -> None:
    """``--ds.use_liger_kernel``'s needs, checked before any weights load: CUDA (Triton kernels),
    the liger-kernel package, and a model type Liger patches for each of ``paths`` (read from
    their config.json; Liger itself would skip an unknown type silently)."""
    from transformers import AutoConfig  # noqa: PLC0415

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        raise ConfigError("--ds.use_liger_kernel needs CUDA: Liger's kernels are Triton GPU kernels (leave it off "
                          "on CPU)")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("--ds.use_liger_kernel needs liger-kernel: pip install 'treadle-trainer[liger]'")
    known = liger_model_types()
    for path in paths:
        kind = AutoConfig.from_pretrained(path).model_type
        if kind not in known:
            raise ConfigError(f"--ds.use_liger_kernel: Liger has no kernels for model type {kind!r} ({path}); "
                              f"it patches {', '.join(sorted(known))}")


def apply_liger(model: torch.nn.Module) -> None:
    """Patch Liger's kernels (``LIGER_KERNELS``) into the loaded ``model``: its norms' and MLPs'
    forwards (the instances only), and the RoPE function of its modeling module (module-wide:
    Liger has no per-instance RoPE; the same math, so a later model without Liger is unaffected in
    value). Liger also swaps the module's norm and MLP classes, which would patch every model
    loaded afterwards, with or without the flag: those class names are put back."""
    import inspect  # noqa: PLC0415

    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance  # noqa: PLC0415

    module = inspect.getmodule(type(model))
    classes = {k: v for k, v in vars(module).items() if inspect.isclass(v)} if module is not None else {}
    try:
        _apply_liger_kernel_to_instance(model=model, **LIGER_KERNELS)
    finally:
        for name, cls in classes.items():
            if getattr(module, name, cls) is not cls:
                setattr(module, name, cls)


def prepare(model: torch.nn.Module, ds: DeepSpeedConfig, *, trainable: bool, gradient_checkpointing: bool,
            reentrant: bool) -> torch.nn.Module:
    """Freeze, or enable checkpointing and LoRA on, a loaded model."""
    if not trainable:
        model.eval()
        model.requires_grad_(False)
        return model
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if ds.lora.rank > 0:
        model = add_lora(model, ds.lora, gradient_checkpointing=gradient_checkpointing)
    return model


def add_lora(model: torch.nn.Module, lora: LoraConfig, *, gradient_checkpointing: bool) -> torch.nn.Module:
    """``model`` with LoRA adapters (peft) on ``lora.target_modules``; only the adapters train."""
    from peft import LoraConfig as PeftLoraConfig  # noqa: PLC0415
    from peft import get_peft_model  # noqa: PLC0415

    if gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    targets = lora.target_modules[0] if lora.target_modules == ("all-linear",) else list(lora.target_modules)
    cfg = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                         bias="none")
    return get_peft_model(model, cfg)
