"""Ring attention in plain PyTorch: any device, any process-group backend (gloo on CPU included).

Each rank holds the queries, keys and values of its zigzag slots (``ring.layout``). K/V blocks
travel around the ring: at every step a rank sends the block it holds to the next rank and
receives the previous rank's, the exchange in flight while it computes on the block it has
(``blocks.forward_step``); partial results merge by their log-sum-exp (online softmax), so
after R steps each query has attended over its whole sequence, wherever the keys live.

Backward recomputes the scores step by step with the merged output and log-sum-exp
(``blocks.backward_step``). The dK/dV accumulated for a block travel with it around the ring
(each rank adds what its queries owe that block) and, one exchange after the last step, reach
the rank that owns it. Outputs, log-sum-exps and gradients accumulate in fp32 and are returned
in the inputs' dtypes.

Not here: the local compute (``ring.blocks``), choosing this kernel or ring-flash-attn and the
transformers hook (``ring.attention``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from treadle.trainer.ring.blocks import Plan, backward_step, forward_step
from treadle.trainer.ring.group import RingGroup


class _Exchange:
    """One send to the next rank and receive from the previous one, in flight. It holds the sent
    tensor until ``wait`` returns: the caller may drop its own reference while NCCL still reads it."""

    def __init__(self, ring: RingGroup, send: Tensor, tag: int) -> None:
        self.send, self.recv = send, torch.empty_like(send)
        self.reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, ring.next_rank, ring.group, tag),
                                            dist.P2POp(dist.irecv, self.recv, ring.prev_rank, ring.group, tag)])

    def wait(self) -> Tensor:
        """The received tensor, once both directions are done."""
        for req in self.reqs:
            req.wait()
        self.send = None
        return self.recv


def ring_forward(q: Tensor, k: Tensor, v: Tensor, plan: Plan, ring: RingGroup, scale: float) -> tuple[Tensor, Tensor]:
    """(out [Hk, G, T, d] fp32, lse [Hk, G, T] fp32) of q [H, T, d] over the ring's k, v [Hk, T, d]."""
    heads_kv, length, dim = k.shape
    qf = q.reshape(heads_kv, -1, length, dim)
    out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(qf.shape[:-1], float("-inf"), device=q.device)
    kv = torch.stack([k, v])
    for step, blk in enumerate(plan.blocks):
        pending = _Exchange(ring, kv, tag=0) if step + 1 < len(plan.blocks) else None
        forward_step(qf, kv, blk, plan.kernel, scale, out, lse)
        if pending is not None:
            kv = pending.wait()
    return out, lse


def ring_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: Plan, ring: RingGroup,
                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the dtypes of q, k, v, from dO [H, T, d] and the forward's (out, lse)."""
    heads_kv, length, dim = k.shape
    qf = q.reshape(heads_kv, -1, length, dim)
    dof = do.reshape(qf.shape)
    dq = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    travelling = None  # dK/dV owed so far to the block we hold, arriving from the previous rank
    for step, blk in enumerate(plan.blocks):
        pending = _Exchange(ring, kv, tag=0) if step + 1 < len(plan.blocks) else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        backward_step(dof, qf, out, lse, kv, blk, plan.kernel, scale, dq, dkv)
        if travelling is not None:
            dkv += travelling.wait()
        travelling = _Exchange(ring, dkv, tag=1)  # after the last step this brings our own dK/dV home
        if pending is not None:
            kv = pending.wait()
    mine = travelling.wait()
    return dq.reshape(q.shape).to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Causal (per packed sequence) attention over a ring: q [H, T, d], k, v [Hk, T, d] -> [H, T, d]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: Plan, ring: RingGroup, scale: float) -> Tensor:  # noqa: ANN001
        out, lse = ring_forward(q, k, v, plan, ring, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.ring, ctx.scale = plan, ring, scale
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(grad, q, k, v, out, lse, ctx.plan, ctx.ring, ctx.scale)
        return dq, dk, dv, None, None, None
