"""The policy role: per-token log-probabilities (and entropies) of a causal LM on a batch.

``Actor`` wraps whatever computes the logits: a transformers causal LM, or the DeepSpeed engine
around one (calling the engine keeps ZeRO's hooks and timers in the loop). It knows nothing
about optimizers, ranks or losses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.ops.logprobs import token_entropy, token_logprobs


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorOutput:
    """What one forward pass of the policy gives."""

    logprobs: Tensor
    """[R, T] fp32 log pi(x_t | x_<t) at temperature tau, aligned with the tokens (column 0 = 0)."""
    entropy: Tensor | None
    """[R, T] fp32 entropy of the distribution predicting each token; None unless asked for."""
    aux_loss: Tensor | None
    """MoE load-balancing loss when the model reports one."""


class Actor:
    """A causal LM used as a policy."""

    def __init__(self, module: Callable[..., Any]) -> None:
        self.module = module

    def __call__(self, batch: SeqBatch, *, temperature: float = 1.0, with_entropy: bool = False) -> ActorOutput:
        out = self.module(**batch.model_inputs(), use_cache=False)
        logits = out.logits
        return ActorOutput(
            logprobs=token_logprobs(logits, batch.input_ids, temperature),
            entropy=token_entropy(logits, temperature) if with_entropy else None,
            aux_loss=getattr(out, "aux_loss", None),
        )
