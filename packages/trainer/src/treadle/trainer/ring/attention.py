"""Ring attention as a transformers attention implementation, and the kernel choice behind it.

``register()`` adds ``"treadle_ring"`` to transformers' ``AttentionInterface``; a model loaded
with ``attn_implementation="treadle_ring"`` (``models.loading`` does so when
``--ds.ring_attn_size > 1``) calls ``ring_attention_forward`` in every attention layer. The
mask interface does not know the name, so transformers builds no mask: the ring kernels derive
causality per packed sequence themselves. The forward must be given the rank's ``RingShard``
(``shard.model_inputs()`` passes it as the ``ring_shard`` keyword, which transformers forwards
to attention); a call without one fails loudly rather than attend across sequences.

Kernels (``RingGroup.backend``): ring-flash-attn's zigzag varlen function on CUDA where it is
installed, for bf16 / fp16 tensors; otherwise (and for fp32, which flash-attention lacks) the
pure-PyTorch ring (``ring.torch_ring``, any dtype and device: PyTorch's fused CPU kernels on
CPU, PyTorch's own FlashAttention-2 varlen kernels for bf16 / fp16 on CUDA, explicit fp32 math
elsewhere; ``ring.blocks``). Both see the same zigzag layout (``ring.layout``).
``--ds.ring_attn_head_stride`` key/value heads go around the ring per pass, with their query
heads; a stride equal to the key/value heads is one pass per layer.

Not here: cutting batches and gathering results (``ring.shard``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from treadle.common.config import ConfigError
from treadle.trainer.ring.shard import RING_KWARG, RingShard

RING_ATTN_NAME = "treadle_ring"
"""The attention implementation name models are loaded with under ring attention."""


def _flash(q: Tensor, k: Tensor, v: Tensor, shard: RingShard, scale: float) -> Tensor:
    """ring-flash-attn: q [H, T, d], k, v [Hk, T, d] -> [H, T, d]."""
    from ring_flash_attn import zigzag_ring_flash_attn_varlen_func  # noqa: PLC0415

    def tokens_first(t: Tensor) -> Tensor:
        return t.transpose(0, 1).contiguous()

    out = zigzag_ring_flash_attn_varlen_func(tokens_first(q), tokens_first(k), tokens_first(v), shard.cu_seqlens,
                                             shard.layout.max_seqlen, softmax_scale=scale, causal=True,
                                             group=shard.ring.group)
    return out.transpose(0, 1)


def _torch(q: Tensor, k: Tensor, v: Tensor, shard: RingShard, scale: float) -> Tensor:
    from treadle.trainer.ring.torch_ring import RingAttention  # noqa: PLC0415

    return RingAttention.apply(q, k, v, shard.plan, shard.ring, scale)


KERNELS = {"torch": _torch, "flash": _flash}
"""Backend name -> kernel (q [H, T, d], k, v [Hk, T, d], shard, scale) -> [H, T, d]."""


def head_stride_error(stride: int, heads: int, heads_kv: int) -> str | None:
    """Why ``--ds.ring_attn_head_stride`` ``stride`` cannot split a model of ``heads`` query and
    ``heads_kv`` key/value heads, or None when it can (pure)."""
    if heads % heads_kv or heads_kv % stride:
        return (f"--ds.ring_attn_head_stride {stride} must divide the {heads_kv} key/value heads "
                f"(and those the {heads} query heads)")
    return None


def check_head_stride(stride: int, paths: list[str]) -> None:
    """``head_stride_error`` for each model folder of ``paths`` (their config.json), before any
    weights load; ConfigError naming the first that fails."""
    from transformers import AutoConfig  # noqa: PLC0415

    for path in paths:
        c = AutoConfig.from_pretrained(path)
        heads = getattr(c, "num_attention_heads", None)
        if heads is None:
            continue
        if error := head_stride_error(stride, heads, getattr(c, "num_key_value_heads", None) or heads):
            raise ConfigError(f"{error} of {path}")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, shard: RingShard, scale: float) -> Tensor:
    """Causal attention of each packed sequence over the whole ring: q [H, T_local, d], k, v
    [Hk, T_local, d] (Hk divides H; query head h uses key head h // (H / Hk)) -> [H, T_local, d]."""
    heads, heads_kv = q.shape[0], k.shape[0]
    stride = shard.ring.head_stride
    if error := head_stride_error(stride, heads, heads_kv):
        raise ValueError(error)
    half = q.dtype in (torch.float16, torch.bfloat16)
    kernel, group = KERNELS["flash" if shard.ring.backend == "flash" and half else "torch"], heads // heads_kv
    if stride == heads_kv:
        return kernel(q, k, v, shard, scale)
    outs = [kernel(q[h * group:(h + stride) * group], k[h:h + stride], v[h:h + stride], shard, scale)
            for h in range(0, heads_kv, stride)]
    return torch.cat(outs, dim=0)


def ring_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature: query [1, H, T, d], key / value [1, Hk, T, d] ->
    ([1, T, H, d], no weights)."""
    shard = kwargs.get(RING_KWARG)
    if not isinstance(shard, RingShard):
        raise RuntimeError("this model was loaded for ring attention: call it on a ring shard "
                           "(treadle.trainer.ring.shard_batch(...).model_inputs())")
    if dropout > 0.0:
        raise ValueError("ring attention has no attention dropout; set the model's attention_dropout to 0")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("ring attention does not implement sliding-window attention")
    if query.shape[0] != 1:
        raise ValueError("ring attention runs on one packed row")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ring_attention(query[0], key[0], value[0], shard, scale)
    return out.transpose(0, 1)[None], None


def register() -> str:
    """Make ``"treadle_ring"`` a transformers attention implementation (idempotent); returns the name."""
    from transformers import AttentionInterface  # noqa: PLC0415

    AttentionInterface.register(RING_ATTN_NAME, ring_attention_forward)
    return RING_ATTN_NAME
