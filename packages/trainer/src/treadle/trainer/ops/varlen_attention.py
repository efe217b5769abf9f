"""Packed-row attention for transformers models where flash-attn is not installed: ``"treadle_varlen"``.

transformers' SDPA path turns a packed row (no attention mask, positions restarting at 0 for each
sequence, ``data.batching.pack_batch``) into a materialised block-diagonal mask ``[R, 1, T, T]``
and one attention over the whole row: at 16 sequences of 2,048 tokens that is a 1 GiB mask and
16x the attention work of the sequences alone, with a kernel that cannot skip masked blocks.
``register()`` adds ``"treadle_varlen"`` to transformers' ``AttentionInterface``; a model loaded
with that name attends causally within each sequence only, and finds the sequences from
``position_ids``: a sequence starts at every position 0 and at every row start. A padded batch's
rows hold one sequence each and right padding only follows real tokens, so padded batches need
no mask either (padding positions compute values that the losses mask out). transformers' mask
interface does not know the name, so it builds no mask.

Kernels, the first that fits (``kernel_name``): FlashAttention-4's variable-length kernels
(``flash_attn.cute``, the ``flash-attn-4`` package) on Hopper and Blackwell GPUs where that package
is installed ("fa4_varlen": Hopper-native forward and backward; PyTorch's own varlen attention is
FlashAttention-2); PyTorch's variable-length flash attention (``torch.nn.attention.varlen``) for
bf16 / fp16 on CUDA ("flash_varlen"); otherwise (CPU, fp32, or a torch without it) causal SDPA
sequence by sequence ("sdpa_by_sequence"), which computes the same values. ``register(kernel)``
(``--ds.varlen_kernel``) names where the search starts, ruling out the faster ones.

Compiled layers (``--ds.compile_layers``) keep the attention inside their graph when the model
is called with transformers' flash-attention kwargs (``cu_seq_lens_q`` / ``max_length_q``, which
``SeqBatch.model_inputs`` passes for packed rows): FlashAttention-4 runs as the custom operators
``treadle::fa4_varlen_fwd`` / ``_bwd`` and PyTorch's varlen kernel is one already. Without those
kwargs the sequences are found from ``position_ids`` (read back to the host once per forward
pass, the other layers reuse the answer: a one-entry memo keyed by the tensor itself), and that
part is excluded from compilation; so is the by-sequence fallback. A graph break there costs
more than the break: the gradients of the tensors crossing it arrive in another memory layout
than the compiled backward expects, and AOTAutograd copies each (3 copies of a [T, H, d] tensor
per layer, 2.5% of the 1.35B step on an H200).

Not here: ring attention (``ring.attention``); choosing the implementation (``models.loading``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

VARLEN_ATTN_NAME = "treadle_varlen"


@dataclass(frozen=True, slots=True)
class Segments:
    """The sequences of ``R`` rows of ``T`` tokens, flattened to ``R * T`` tokens."""

    bounds: tuple[int, ...]
    """S + 1 flat offsets: sequence k is tokens [bounds[k], bounds[k + 1])."""
    cu: Tensor
    """[S + 1] int32 ``bounds`` on the tokens' device (flash attention's cu_seqlens)."""
    max_len: int
    """Longest sequence."""


def segments(position_ids: Tensor) -> Segments:
    """Sequences of ``position_ids`` ``[R, T]``: one starts at each 0 and at each row start."""
    r, t = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    flat = torch.nonzero(starts.reshape(-1)).reshape(-1).tolist()
    bounds = (*flat, r * t)
    max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    cu = torch.tensor(bounds, dtype=torch.int32, device=position_ids.device)
    return Segments(bounds=bounds, cu=cu, max_len=max_len)


def segments_of(cu: Tensor, max_len: int) -> Segments:
    """The ``Segments`` of flash attention's ``cu_seqlens`` (read back to the host)."""
    return Segments(bounds=tuple(cu.tolist()), cu=cu, max_len=max_len)


class _Memo:
    """The segments of the last tensor seen (``position_ids``, or ``cu_seqlens``); holding the
    tensor keeps its memory from being reused by a different one, and its version counter
    catches in-place changes."""

    __slots__ = ("key", "version", "value")

    def __init__(self) -> None:
        self.key: Tensor | None = None
        self.version = -1
        self.value: Segments | None = None

    def get(self, key: Tensor, make: Callable[[], Segments]) -> Segments:
        if self.key is not key or self.version != key._version or self.value is None:
            self.key, self.version, self.value = key, key._version, make()
        return self.value


_MEMO = _Memo()


@functools.cache
def _varlen_kernel() -> tuple[Any, frozenset[str]] | None:
    """PyTorch's varlen flash attention and its keyword names, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def _fa4_kernel() -> tuple[Any, Any] | None:
    """flash-attn-4's varlen-capable forward and backward (``flash_attn.cute.interface``'s
    ``_flash_attn_fwd`` / ``_flash_attn_bwd``, which its own autograd function calls), or None
    where it is not installed (or its CUDA libraries do not load, or a release renamed them)."""
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - ImportError, or a failing native library: use another kernel
        return None
    return _flash_attn_fwd, _flash_attn_bwd


@torch.library.custom_op("treadle::fa4_varlen_fwd", mutates_args=())
def _fa4_fwd(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> tuple[Tensor, Tensor]:
    """FlashAttention-4's causal varlen forward on contiguous q ``[N, H, d]``, k / v ``[N, Hk, d]``
    -> (out ``[N, H, d]``, log-sum-exp ``[H, N]`` fp32)."""
    out, lse, *_ = _fa4_kernel()[0](q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                   max_seqlen_k=max_len, softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


@_fa4_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:2], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("treadle::fa4_varlen_bwd", mutates_args=())
def _fa4_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu: Tensor, max_len: int,
             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-4's varlen backward of ``_fa4_fwd`` -> (dq, dk, dv), contiguous like q, k, v."""
    dq, dk, dv = _fa4_kernel()[1](q, k, v, out, dout, lse, scale, True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 max_seqlen_q=max_len, max_seqlen_k=max_len)
    return dq, dk, dv


@_fa4_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu: Tensor, max_len: int,
      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu, max_len, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu)
    ctx.max_len, ctx.scale = max_len, scale


def _fa4_grad(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = _fa4_bwd(dout.contiguous(), q, k, v, out, lse, cu, ctx.max_len, ctx.scale)
    return dq, dk, dv, None, None, None


_fa4_fwd.register_autograd(_fa4_grad, setup_context=_fa4_setup)


def _fa4(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    out, _ = _fa4_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu, max_len, scale)
    return out


def _flash(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    kernel, names = _varlen_kernel()  # type: ignore[misc]
    kw: dict[str, Any] = {"scale": scale}
    # The causal switch moved from is_causal to window_size=(-1, 0) between PyTorch releases.
    kw.update({"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True})
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in names:
            kw["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return kernel(q, k, v, cu, cu, max_len, max_len, **kw)


@torch.compiler.disable
def _sequence_by_sequence(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    return _by_sequence(q, k, v, _MEMO.get(cu, lambda: segments_of(cu, max_len)), scale)


def _by_sequence(q: Tensor, k: Tensor, v: Tensor, seg: Segments, scale: float) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for a, b in zip(seg.bounds[:-1], seg.bounds[1:], strict=True):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


KERNELS = ("fa4_varlen", "flash_varlen", "sdpa_by_sequence")
"""Fastest first."""
_RUN = {"fa4_varlen": _fa4, "flash_varlen": _flash, "sdpa_by_sequence": _sequence_by_sequence}
_start = KERNELS[0]  # where ``kernel_name`` starts looking (``register``)


def _fits(kernel: str, q: Tensor) -> bool:
    """Whether ``kernel`` is installed and runs tensors like ``q``: the flash kernels need bf16 /
    fp16 on CUDA; FA4 also Hopper / Blackwell and a head dim that is a multiple of 8 up to 128
    (both archs' common range)."""
    return _fits_spec(kernel, q.device, q.dtype, q.shape[-1])


def _fits_spec(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if kernel == "sdpa_by_sequence":
        return True
    if not (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)):
        return False
    if kernel == "flash_varlen":
        return _varlen_kernel() is not None
    return (torch.cuda.get_device_capability(device)[0] in (9, 10) and head_dim % 8 == 0 and head_dim <= 128
            and _fa4_kernel() is not None)


@torch.compiler.assume_constant_result
def _kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    # a constant to dynamo: it guards on the tensors' device, dtype and head dim already
    return next(k for k in KERNELS[KERNELS.index(_start):] if _fits_spec(k, device, dtype, head_dim))


def kernel_name(q: Tensor) -> str:
    """The kernel ``varlen_attention`` uses for tensors like ``q``: the first of ``KERNELS``, from
    the one ``register`` named, that fits them."""
    return _kernel_for(q.device, q.dtype, q.shape[-1])


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    """Causal attention within each sequence: q ``[N, H, d]``, k / v ``[N, Hk, d]`` (Hk divides H),
    sequence j = tokens [cu[j], cu[j + 1]) (``cu`` int32 on their device, ``max_len`` the longest)
    -> ``[N, H, d]``."""
    return _RUN[kernel_name(q)](q, k, v, cu, max_len, scale)


@torch.compiler.disable
def _found_segments(positions: Tensor, rows: int) -> Segments:
    """The sequences of ``positions`` (read back to the host; memoised for the forward pass)."""
    if positions.shape[0] == rows:
        return _MEMO.get(positions, lambda: segments(positions))
    return segments(positions.expand(rows, -1))


def varlen_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature: query ``[R, H, T, d]``, key / value ``[R, Hk, T, d]`` ->
    (``[R, T, H, d]``, no weights). The sequences: ``cu_seq_lens_q`` / ``max_length_q`` for one
    packed row when given, else found from ``position_ids``."""
    if dropout > 0.0:
        raise ValueError(f"{VARLEN_ATTN_NAME} attention has no attention dropout; set attention_dropout to 0")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN_ATTN_NAME} attention does not implement sliding-window attention")
    r, h, t, d = query.shape
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None or max_len is None or r != 1:
        positions = kwargs.get("position_ids")
        if positions is None:
            raise RuntimeError(f"{VARLEN_ATTN_NAME} attention finds sequences from position_ids; "
                               "call the model with position_ids")
        seg = _found_segments(positions, r)
        cu, max_len = seg.cu, seg.max_len
    flat = [x.transpose(1, 2).reshape(r * t, x.shape[1], d) for x in (query, key, value)]
    out = varlen_attention(*flat, cu, max_len, scaling if scaling is not None else d ** -0.5)
    return out.reshape(r, t, h, d), None


def register(kernel: str = "auto") -> str:
    """Make ``"treadle_varlen"`` a transformers attention implementation (idempotent) whose kernel
    is the fastest that fits from ``kernel`` on (one of ``KERNELS``; "auto": the first); returns
    the name. The choice is the process's: models loaded later with another kernel change it for
    all (a trainer's models share one ``DeepSpeedConfig``)."""
    from transformers import AttentionInterface  # noqa: PLC0415

    global _start
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"varlen attention kernel {kernel!r}: expected auto or one of {', '.join(KERNELS)}")
    _start = KERNELS[0] if kernel == "auto" else kernel
    AttentionInterface.register(VARLEN_ATTN_NAME, varlen_attention_forward)
    return VARLEN_ATTN_NAME
