"""The policy role: per-token log-probabilities (and entropies) of a causal LM on a batch.

``Actor`` wraps whatever computes the logits: a transformers causal LM, or the DeepSpeed engine
around one (calling the engine keeps ZeRO's hooks and timers in the loop). It knows nothing
about optimizers or losses. Under ring attention (``ring`` given) the model runs on this rank's
slots of the packed row and the per-token results are gathered back, so the output is the
full row's, equal to the ring-less one (``ring.shard``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.ops.logprobs import (
    chunked_entropy,
    picked_logprobs,
    token_entropy,
    token_logprobs,
)
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
                     temperature: float = 1.0, with_entropy: bool = False,
                     targets_only: bool = False) -> ActorOutput:
    """One forward of a causal LM on ``batch`` (sharded over ``ring`` when given): ``ActorOutput``.

    ``targets_only``: the caller reads the results at ``batch.target_mask`` tokens only (every
    loss here does); the LM head and the log-softmax then run only on the columns that predict
    a target in some row (``logits_to_keep``), and the tokens after the other columns get 0. A prompt that the
    loss does not learn costs the decoder layers only: with Qwen2.5-1.5B's 152k vocabulary the
    LM head is 15% of a token's forward FLOPs. Without ring attention, and for models whose
    forward takes ``logits_to_keep`` (transformers' causal LMs)."""
    if ring is None:
        cols = target_columns(batch.target_mask) if targets_only and keeps_logits(module) else None
        if cols is not None:
            return _at_columns(module, batch, cols, temperature, with_entropy)
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


def target_logits(module: Callable[..., Any], batch: SeqBatch) -> Tensor:
    """``[K, V]`` logits predicting each of ``batch``'s K target tokens (token t's come from column
    t - 1), in row-major order of ``batch.target_mask``; only the columns predicting a target run
    the LM head when the module takes ``logits_to_keep``. No ring attention."""
    cols = target_columns(batch.target_mask) if keeps_logits(module) else None
    if cols is None:
        logits = module(**batch.model_inputs(), use_cache=False).logits[:, :-1]
        return logits[batch.target_mask[:, 1:].bool()]
    keep = cols if cols.numel() else cols.new_zeros(1)  # no target at all: one column, none picked
    logits = module(**batch.model_inputs(), use_cache=False, logits_to_keep=keep).logits  # [R, K', V]
    return logits[batch.target_mask[:, keep + 1].bool()]


def target_columns(target_mask: Tensor) -> Tensor | None:
    """The columns c whose logits predict a target token (token c + 1 is a target in some row),
    ascending; None when that is every column but the last (nothing to skip)."""
    cols = torch.nonzero(target_mask[:, 1:].any(0)).reshape(-1)
    return None if cols.numel() == target_mask.shape[1] - 1 else cols


def _at_columns(module: Callable[..., Any], batch: SeqBatch, cols: Tensor, temperature: float,
                with_entropy: bool) -> ActorOutput:
    rows, length = batch.input_ids.shape
    keep = cols if cols.numel() else cols.new_zeros(1)  # no target at all: one column, results unused
    out = module(**batch.model_inputs(), use_cache=False, logits_to_keep=keep)
    logits = out.logits  # [R, K, V]
    tokens = keep + 1

    def place(values: Tensor) -> Tensor:  # [R, K] -> [R, T], 0 where no logits were computed
        return values.new_zeros(rows, length).index_copy(1, tokens, values)

    return ActorOutput(logprobs=place(picked_logprobs(logits, batch.input_ids[:, tokens], temperature)),
                       entropy=place(chunked_entropy(logits, temperature)) if with_entropy else None,
                       aux_loss=getattr(out, "aux_loss", None))


def keeps_logits(module: Any) -> bool:
    """Whether the causal LM under ``module`` (a DeepSpeed engine's ``.module``, peft's base model)
    takes ``logits_to_keep``."""
    inner = getattr(module, "module", module)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return _takes_logits_to_keep(type(base))


@functools.cache
def _takes_logits_to_keep(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    try:
        return forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


class Actor:
    """A causal LM used as a policy."""

    def __init__(self, module: Callable[..., Any], *, ring: RingGroup | None = None) -> None:
        self.module = module
        self.ring = ring

    def __call__(self, batch: SeqBatch, *, temperature: float = 1.0, with_entropy: bool = False,
                 targets_only: bool = False) -> ActorOutput:
        """``forward_logprobs``; ``targets_only``: results at ``batch.target_mask`` tokens only."""
        return forward_logprobs(self.module, batch, ring=self.ring, temperature=temperature, with_entropy=with_entropy,
                                targets_only=targets_only)
