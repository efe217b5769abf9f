"""Ring attention (sequence / context parallelism): rings of ``--ds.ring_attn_size`` ranks split
every packed row between them and pass K/V blocks around to attend over the whole row.

The pieces, in the order a trainer uses them:

- ``setup_ring(size, head_stride, dist)`` (``group``): create the ring and data-parallel groups;
  ``data_parallel(dist, ring)`` says which share of each batch this rank trains on.
- ``register()`` (``attention``): the ``"treadle_ring"`` attention implementation models are
  loaded with (``models.loading`` does it when the ring size is > 1).
- ``shard_batch(batch, ring)`` (``shard``): this rank's zigzag slots of a packed micro-batch;
  run the model on ``shard.model_inputs()``.
- ``gather_tokens(local, shard)``: per-token results back on the full row, differentiably, so
  losses are computed exactly as without a ring.

``layout`` holds the zigzag index math, ``blocks`` the local compute of each ring step and
``torch_ring`` the pure-PyTorch ring around it (any device, gloo included); ring-flash-attn is
used on CUDA where installed.
"""

from treadle.trainer.ring.attention import RING_ATTN_NAME, register, ring_attention
from treadle.trainer.ring.group import DataParallel, RingGroup, data_parallel, setup_ring
from treadle.trainer.ring.shard import (
    RingShard,
    gather_tokens,
    next_token_entropy,
    next_token_logprobs,
    shard_batch,
    shift_to_tokens,
)

__all__ = ["RING_ATTN_NAME", "DataParallel", "RingGroup", "RingShard", "data_parallel", "gather_tokens",
           "next_token_entropy", "next_token_logprobs", "register", "ring_attention", "setup_ring",
           "shard_batch", "shift_to_tokens"]
