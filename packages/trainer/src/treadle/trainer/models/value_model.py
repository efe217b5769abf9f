"""A transformer backbone with a linear head giving one value per token (shared by the reward
model and the critic).

The head is an attribute named by ``--ds.value_head_prefix`` (default ``score``) and the
backbone is ``model``, so the state dict has exactly the keys of transformers'
``XForSequenceClassification`` (``model.*``, ``score.weight``): an exported reward model loads
with ``AutoModelForSequenceClassification`` when the prefix is ``score``. ``token_values`` runs it
(or its DeepSpeed engine) on a batch, sharded over a ring under ring attention.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.models.loading import add_lora, load_backbone
from treadle.trainer.ring.group import RingGroup
from treadle.trainer.ring.shard import gather_tokens, shard_batch


def _saved_head(path: str, prefix: str) -> Tensor | None:
    """The head weight stored in a local checkpoint folder (``<prefix>.weight``, or ``score.weight``
    as the HF export names it), if there is one."""
    from safetensors import safe_open  # noqa: PLC0415

    folder = Path(path)
    names = [f"{prefix}.weight", "score.weight"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / weight_map[n] for n in names if n in weight_map})
    else:
        files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            keys = set(fh.keys())
            for name in names:
                if name in keys:
                    return fh.get_tensor(name)
    return None


class ValueModel(nn.Module):
    """backbone(x) -> hidden [R, T, H] -> head -> values [R, T]."""

    def __init__(self, backbone: nn.Module, head_prefix: str = "score") -> None:
        super().__init__()
        self.model = backbone
        self.head_prefix = head_prefix
        hidden = backbone.config.hidden_size
        head = nn.Linear(hidden, 1, bias=False, dtype=next(backbone.parameters()).dtype)
        nn.init.normal_(head.weight, std=1.0 / (hidden + 1) ** 0.5)
        setattr(self, head_prefix, head)
        self.config = backbone.config

    @property
    def head(self) -> nn.Linear:
        return getattr(self, self.head_prefix)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        """[R, T] fp32 value of each token (computed from the hidden state at that token); other
        keyword arguments (the ring shard) go to the backbone."""
        kwargs.pop("use_cache", None)
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=False, **kwargs).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    @classmethod
    def from_pretrained(cls, path: str, ds: DeepSpeedConfig, *, gradient_checkpointing: bool = False,
                        reentrant: bool = False) -> ValueModel:
        """Backbone from ``path``; the head from the same checkpoint when it has one, else freshly initialised."""
        backbone = load_backbone(path, ds)
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if ds.lora.rank > 0:
            backbone = add_lora(backbone, ds.lora, gradient_checkpointing=gradient_checkpointing)
        model = cls(backbone, ds.value_head_prefix)
        saved = _saved_head(path, ds.value_head_prefix) if Path(path).is_dir() else None
        if saved is not None:
            with torch.no_grad():
                model.head.weight.copy_(saved.reshape_as(model.head.weight))
        return model


def token_values(module: Any, batch: SeqBatch, ring: RingGroup | None = None) -> Tensor:
    """[R, T] fp32 per-token values of ``batch`` from a ``ValueModel`` (or its engine); under ring
    attention computed on this rank's slots and gathered (differentiably) to the full row."""
    if ring is None:
        return module(**batch.model_inputs())
    shard = shard_batch(batch, ring)
    return gather_tokens(module(**shard.model_inputs()), shard)
