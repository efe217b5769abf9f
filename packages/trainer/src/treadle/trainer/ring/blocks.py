"""The local compute of ring attention: which query rows meet which keys at each ring step, and
the attention of one tile of them, forward (with its log-sum-exp) and backward.

Plan (``plan``): step s holds the K/V of ring rank j = r - s. Under the zigzag split (``layout``)
our own block is seen whole; an earlier rank's block only through its early chunks (by all our
queries); a later rank's whole block only by our late chunks. Nothing else is visible, so half
of every off-diagonal step is skipped exactly. Inside a step, queries go in tiles; since the
slots of a sequence are in position order (early chunk, then late chunk), the keys a tile can
see form one contiguous range: from the first key of the tile's first sequence to the last
key not after the tile's last query. Tiles are sized by ``TILE_BUDGET``. Every query row of a
tile sees at least one key (itself at step 0, an early chunk of its sequence otherwise), so no
softmax row is empty.

Tile kernels (``TILE_KERNELS``): q ``[Hk, G, n, d]``, k / v ``[Hk, m, d]``, mask ``[n, m]`` bool
(key visible: same sequence, ``pos_k <= pos_q``); results in fp32:

- ``math``: explicit fp32 scores, any device. Forward ``o = softmax(S) V``, ``lse =
  logsumexp(S)``; backward from the *merged* output and lse of the whole ring: ``P = exp(S -
  lse)``, ``D = rowsum(dO * O)``, ``dV = P^T dO``, ``dS = P (dO V^T - D)``, ``dQ = dS K scale``,
  ``dK = dS^T Q scale`` (flash-attention's recomputation).
- ``cpu_flash``: the same through PyTorch's fused CPU flash-attention kernels (fp32), which take
  an additive mask and return / accept the log-sum-exp (2-3x faster on CPU than ``math``).

- ``cuda_flash``: bf16 / fp16 on CUDA, PyTorch's own FlashAttention-2 varlen kernels
  (``aten._flash_attention_forward`` / ``_backward``, which return / take the log-sum-exp) with no
  mask: inside a tile a sequence's visible keys are all of its keys in the tile (off the
  diagonal step) or, on the diagonal step, its keys up to each query with the queries the last
  of those keys, which is the kernels' bottom-right causal mask. One varlen segment per
  sequence (``flash_segments``); a tile whose query and key sequences do not pair up falls back
  to ``math``, and so does fp32 (flash attention has no fp32).

On CUDA without ring-flash-attn the ring runs ``cuda_flash`` for half-precision tensors and
``math`` for fp32 (correct, slow: no tensor cores in fp32). PyTorch's memory-efficient CUDA
kernels with an additive mask were tried as a tile kernel on an H200 (torch 2.11): as fast as
whole-sequence SDPA in fp32, but their backward faulted (illegal memory access) in bf16 inside
the ring, so they are not used.

Not here: passing blocks around the ring (``torch_ring``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.trainer.ring.layout import RingLayout

TILE_BUDGET = {("math", "cuda"): 1 << 22, ("math", "cpu"): 1 << 20, ("cpu_flash", "cpu"): 1 << 20,
               ("cuda_flash", "cuda"): 1 << 40}
"""(query, key) pairs per tile, by (kernel, device type); 1 << 20 for others. Bounds a step's
working memory (``math``: about 5 fp32 tensors of that size per head; ``cpu_flash``: the
tile's mask) and sets how many kernel calls a step takes (GPUs want fewer, larger ones)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    """One ring step: local query rows against key slots of the block held."""

    rows: Tensor
    """[n] long: local query slots."""
    cols: Tensor
    """[m] long: key slots of the block."""
    seq_q: Tensor
    """[n] sequence of each query row."""
    pos_q: Tensor
    """[n] position of each query row in its sequence."""
    seq_k: Tensor
    """[m] sequence of each key."""
    pos_k: Tensor
    """[m] position of each key in its sequence."""
    tiles: tuple[tuple[int, int, int, int], ...]
    """(row start, row end, key start, key end) of each query tile and the keys it can see."""
    diagonal: bool = False
    """Step 0: our own block (causal within each sequence); else every key of a tile's sequence is visible."""

    def mask(self, a: int, b: int, lo: int, hi: int) -> Tensor:
        """[b - a, hi - lo] bool: key visible to query (same sequence, not in its future)."""
        same = self.seq_q[a:b, None] == self.seq_k[None, lo:hi]
        return same & (self.pos_k[None, lo:hi] <= self.pos_q[a:b, None])


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Every ring step's block, and the tile kernel to run them with."""

    blocks: tuple[Block, ...]
    """One per ring step (R)."""
    kernel: str
    """``TILE_KERNELS`` key."""


def _tiles(key_q: Tensor, key_k: Tensor, seq_start_q: Tensor, budget: int) -> tuple[tuple[int, int, int, int], ...]:
    """Query tiles and their key ranges; ``key_*`` = seq * span + pos (non-decreasing in slot order)."""
    n, m = key_q.numel(), key_k.numel()
    size = max(16, budget // max(1, m))
    out = []
    for a in range(0, n, size):
        b = min(n, a + size)
        lo = int(torch.searchsorted(key_k, seq_start_q[a:a + 1]))
        hi = int(torch.searchsorted(key_k, key_q[b - 1:b], right=True))
        out.append((a, b, lo, hi))
    return tuple(out)


def plan(layout: RingLayout, device: torch.device, *, budget: int | None = None, kernel: str | None = None) -> Plan:
    """The R steps of ``layout`` (index tensors on ``device``). ``kernel``: default ``cpu_flash``
    on CPU, ``cuda_flash`` on CUDA where PyTorch has its flash kernels, else ``math``; ``budget``:
    pairs per tile (default ``TILE_BUDGET``)."""
    kernel = kernel or default_kernel(device)
    budget = budget or TILE_BUDGET.get((kernel, device.type), 1 << 20)
    r, size = layout.rank, layout.size
    span = int(layout.positions.max()) + 1 if layout.local_length else 1
    every = torch.arange(layout.local_length)
    blocks = []
    for step in range(size):
        j = (r - step) % size
        rows, cols = (every, every) if step == 0 else (every, layout.front) if j < r else (layout.back, every)
        seq_q, seq_k, pos_q, pos_k = layout.seq[rows], layout.seq[cols], layout.positions[r][rows], layout.positions[j][cols]
        tiles = _tiles(seq_q * span + pos_q, seq_k * span + pos_k, seq_q * span, budget)
        blocks.append(Block(rows=rows.to(device), cols=cols.to(device), seq_q=seq_q.to(device), pos_q=pos_q.to(device),
                            seq_k=seq_k.to(device), pos_k=pos_k.to(device), tiles=tiles, diagonal=step == 0))
    return Plan(blocks=tuple(blocks), kernel=kernel)


def default_kernel(device: torch.device) -> str:
    """``cpu_flash`` on CPU; ``cuda_flash`` on CUDA where PyTorch has its flash kernels; else ``math``."""
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda" and hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "cuda_flash"
    return "math"


# -- tile kernels ------------------------------------------------------------------------------
# Inputs in the model's dtype (q, do [Hk, G, n, d]; k, v [Hk, m, d]); out and lse are the ring's
# fp32 running results; every result is returned in fp32.


def _math_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    q, k, v = q.float(), k.float(), v.float()
    s = torch.matmul(q, k[:, None].transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v[:, None]), lse


def _math_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    do, q, k, v = do.float(), q.float(), k.float(), v.float()
    s = torch.matmul(q, k[:, None].transpose(-1, -2)) * scale
    p = torch.exp(s.masked_fill(~mask, float("-inf")) - lse[..., None])
    ds = p * (torch.matmul(do, v[:, None].transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k[:, None]) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(1) * scale
    dv = torch.matmul(p.transpose(-1, -2), do).sum(1)
    return dq, dk, dv


def _heads(t: Tensor) -> Tensor:
    """[Hk, G, n, d] -> [1, Hk G, n, d], contiguous (the fused kernels read raw strides; an
    incoming gradient may be an expanded, stride-0 tensor)."""
    return t.reshape(1, -1, *t.shape[2:]).contiguous()


def _expand(kv: Tensor, group: int) -> Tensor:
    """[Hk, m, d] -> [1, Hk G, m, d]: each key head repeated for its G query heads."""
    return kv[:, None].expand(-1, group, -1, -1).reshape(1, -1, *kv.shape[1:])


def _per_key_head(g: Tensor, heads_kv: int) -> Tensor:
    """[1, Hk G, m, d] gradients of the repeated key heads -> [Hk, m, d] fp32 (summed over each group)."""
    return g.float().reshape(heads_kv, -1, *g.shape[2:]).sum(1)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[1, 1, n, m] additive mask: 0 where visible, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))[None, None]


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    q, k, v, group = q.float(), k.float(), v.float(), q.shape[1]
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads(q), _expand(k, group), _expand(v, group), 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])


def _cpu_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor,
                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    do, q, k, v = do.float(), q.float(), k.float(), v.float()
    heads_kv, group = q.shape[:2]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _heads(do), _heads(q), _expand(k, group), _expand(v, group), _heads(out), lse.reshape(1, -1, lse.shape[-1]),
        0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale)
    return dq.reshape(q.shape), _per_key_head(dk, heads_kv), _per_key_head(dv, heads_kv)


Segments = tuple[Tensor, Tensor, int, int]
"""(cu_seqlens_q, cu_seqlens_k int32, max_q, max_k) of a tile: one segment per sequence."""


def flash_segments(seq_q: Tensor, seq_k: Tensor) -> Segments | None:
    """One varlen segment per sequence of a tile's queries and keys (each sorted by sequence);
    None when they do not hold the same sequences in the same order (such a tile needs a mask)."""
    sq, cq = torch.unique_consecutive(seq_q, return_counts=True)
    sk, ck = torch.unique_consecutive(seq_k, return_counts=True)
    if sq.shape != sk.shape or not bool(torch.equal(sq, sk)):
        return None

    def cu(counts: Tensor) -> Tensor:
        return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)

    return cu(cq), cu(ck), int(cq.max()), int(ck.max())


def _tokens_first(t: Tensor) -> Tensor:
    """[Hk, G, n, d] or [Hk, n, d] -> [n, heads, d], contiguous (flash attention's varlen layout)."""
    return t.reshape(-1, *t.shape[-2:]).transpose(0, 1).contiguous()


_NO_RNG: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _no_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    """The (rng_state, unused) pair a dropout-free flash forward returns, which its backward takes back."""
    if device not in _NO_RNG:
        x = torch.zeros(1, 1, 8, dtype=torch.bfloat16, device=device)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
        _NO_RNG[device] = tuple(torch.ops.aten._flash_attention_forward(x, x, x, cu, cu, 1, 1, 0.0, False, False)[2:4])
    return _NO_RNG[device]


def _cuda_forward(q: Tensor, k: Tensor, v: Tensor, seg: Segments, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    cu_q, cu_k, max_q, max_k = seg
    o, lse = torch.ops.aten._flash_attention_forward(_tokens_first(q), _tokens_first(k), _tokens_first(v), cu_q, cu_k,
                                                     max_q, max_k, 0.0, causal, False, scale=scale)[:2]
    return o.transpose(0, 1).reshape(q.shape).float(), lse.reshape(q.shape[:-1]).float()


def _cuda_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Segments,
                   causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    cu_q, cu_k, max_q, max_k = seg
    half = q.dtype
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _tokens_first(do.to(half)), _tokens_first(q), _tokens_first(k), _tokens_first(v), _tokens_first(out.to(half)),
        lse.reshape(-1, lse.shape[-1]).contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, *_no_rng(q.device),
        scale=scale)
    return (dq.transpose(0, 1).reshape(q.shape).float(), dk.transpose(0, 1).float(), dv.transpose(0, 1).float())


Forward = Callable[[Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
Backward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor, Tensor]]
TILE_KERNELS: dict[str, tuple[Forward, Backward]] = {
    "math": (_math_forward, _math_backward),
    "cpu_flash": (_cpu_forward, _cpu_backward),
}
"""Kernel name -> (forward(q, k, v, mask, scale) -> (o, lse), backward(do, q, k, v, out, lse, mask, scale) -> (dq, dk, dv))."""


# -- a whole step --------------------------------------------------------------------------------


def _merge(out: Tensor, lse: Tensor, rows: Tensor, o_new: Tensor, lse_new: Tensor) -> None:
    """Fold a partial (o_new, lse_new) for ``rows`` into the running (out, lse), in place:
    lse = logaddexp(lse_a, lse_b), out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)."""
    lse_old, o_old = lse[..., rows], out[..., rows, :]
    total = torch.logaddexp(lse_old, lse_new)  # finite: every row sees a key in the tile
    out[..., rows, :] = o_old * torch.exp(lse_old - total)[..., None] + o_new * torch.exp(lse_new - total)[..., None]
    lse[..., rows] = total


def _flash_tile(q: Tensor, kernel: str, blk: Block, a: int, b: int, lo: int, hi: int) -> Segments | None:
    """The tile's segments when it runs on ``cuda_flash`` (half precision, sequences pairing up), else None."""
    if kernel != "cuda_flash" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    return flash_segments(blk.seq_q[a:b], blk.seq_k[lo:hi])


def forward_step(q: Tensor, kv: Tensor, blk: Block, kernel: str, scale: float, out: Tensor, lse: Tensor) -> None:
    """Attention of q[rows] over kv[cols] merged into (out, lse). q [Hk, G, T, d] and kv [2, Hk, T, d]
    in the model's dtype; out [Hk, G, T, d] and lse [Hk, G, T] fp32."""
    for a, b, lo, hi in blk.tiles:
        rows, cols = blk.rows[a:b], blk.cols[lo:hi]
        seg = _flash_tile(q, kernel, blk, a, b, lo, hi)
        if seg is not None:
            o, tile_lse = _cuda_forward(q[:, :, rows], kv[0][:, cols], kv[1][:, cols], seg, blk.diagonal, scale)
        else:
            fwd = TILE_KERNELS["math" if kernel == "cuda_flash" else kernel][0]
            o, tile_lse = fwd(q[:, :, rows], kv[0][:, cols], kv[1][:, cols], blk.mask(a, b, lo, hi), scale)
        _merge(out, lse, rows, o, tile_lse)


def backward_step(do: Tensor, q: Tensor, out: Tensor, lse: Tensor, kv: Tensor, blk: Block, kernel: str, scale: float,
                  dq: Tensor, dkv: Tensor) -> None:
    """Gradients of one step, added into dq [Hk, G, T, d] and dkv [2, Hk, T, d] (fp32)."""
    for a, b, lo, hi in blk.tiles:
        rows, cols = blk.rows[a:b], blk.cols[lo:hi]
        seg = _flash_tile(q, kernel, blk, a, b, lo, hi)
        if seg is not None:
            gq, gk, gv = _cuda_backward(do[:, :, rows], q[:, :, rows], kv[0][:, cols], kv[1][:, cols],
                                        out[:, :, rows], lse[..., rows], seg, blk.diagonal, scale)
        else:
            bwd = TILE_KERNELS["math" if kernel == "cuda_flash" else kernel][1]
            gq, gk, gv = bwd(do[:, :, rows], q[:, :, rows], kv[0][:, cols], kv[1][:, cols],
                             out[:, :, rows], lse[..., rows], blk.mask(a, b, lo, hi), scale)
        dq.index_add_(2, rows, gq)
        dkv[0].index_add_(1, cols, gk)
        dkv[1].index_add_(1, cols, gv)
