"""The policy role: per-token log-probabilities (and entropies) of a causal LM on a batch.

``Actor`` wraps whatever computes the logits: a transformers causal LM, or the DeepSpeed engine
around one (calling the engine keeps ZeRO's hooks and timers in the loop). It knows nothing
about optimizers or losses. Under ring attention (``ring`` given) the model runs on this rank's
slots of the packed row and the per-token results are gathered back, so the output is the
full row's, equal to the ring-less one (``ring.shard``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.ops.logprobs import token_entropy, token_logprobs
from treadle.trainer.ring.group import RingGroup
from treadle.trainer.ring.shard import (
    gather_tokens,
    next_token_entropy,
    next_token_logprobs,
    shard_batch,
    shift_to_tokens,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorOutput:
    """What one forward pass of the policy gives."""

    logprobs: Tensor
    """[R, T] fp32 log pi(x_t | x_<t) at temperature tau, aligned with the tokens (column 0 = 0)."""
    entropy: Tensor | None
    """[R, T] fp32 entropy of the distribution predicting each token; None unless asked for."""
    aux_loss: Tensor | None
    """MoE load-balancing loss when the model reports one."""


def forward_logprobs(module: Callable[..., Any], batch: SeqBatch, *, ring: RingGroup | None = None,
                     temperature: float = 1.0, with_entropy: bool = False) -> ActorOutput:
    """One forward of a causal LM on ``batch`` (sharded over ``ring`` when given): ``ActorOutput``."""
    if ring is None:
        out = module(**batch.model_inputs(), use_cache=False)
        logits = out.logits
        return ActorOutput(logprobs=token_logprobs(logits, batch.input_ids, temperature),
                           entropy=token_entropy(logits, temperature) if with_entropy else None,
                           aux_loss=getattr(out, "aux_loss", None))
    shard = shard_batch(batch, ring)
    out = module(**shard.model_inputs(), use_cache=False)
    logits = out.logits

    def full(local_next: Tensor) -> Tensor:
        return shift_to_tokens(gather_tokens(local_next, shard))

    return ActorOutput(logprobs=full(next_token_logprobs(logits, shard.next_ids, temperature)),
                       entropy=full(next_token_entropy(logits, temperature)) if with_entropy else None,
                       aux_loss=getattr(out, "aux_loss", None))


class Actor:
    """A causal LM used as a policy."""

    def __init__(self, module: Callable[..., Any], *, ring: RingGroup | None = None) -> None:
        self.module = module
        self.ring = ring

    def __call__(self, batch: SeqBatch, *, temperature: float = 1.0, with_entropy: bool = False) -> ActorOutput:
        return forward_logprobs(self.module, batch, ring=self.ring, temperature=temperature, with_entropy=with_entropy)
