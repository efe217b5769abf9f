"""Muon (``--optim muon``): DeepSpeed's ``MuonWithAuxAdam`` over treadle's parameter split.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) replaces each weight
matrix's momentum by its nearest semi-orthogonal matrix (5 Newton-Schulz steps) before the
step. Its authors use it for hidden matrices only: embeddings, output heads and 1-D parameters
(norm gains, biases) keep AdamW. ``split_params`` makes that split; DeepSpeed 0.19's
``MuonWithAuxAdam`` steps both halves, and its ZeRO stages 1-3 (with CPU offload too) run the
Newton-Schulz step on each whole matrix's gradient before they partition it: the reason for
DeepSpeed's implementation rather than ``torch.optim.Muon``, which needs 2-D parameters and so
cannot step ZeRO's flat partitions.

The split is made here rather than by DeepSpeed's ``"optimizer": {"type": "muon"}`` config
(OpenRLHF's way), whose rule is by name ("embed", "lm_head"): it would give Muon the 1-row
value / score head of a critic or reward model. The optimizer is passed to
``deepspeed.initialize`` as a client optimizer, so DeepSpeed does not re-tag the parameters.

Not here: which DeepSpeed settings Muon cannot run with (``config.optim.check_muon``, at parse
time), the engine (``strategy.deepspeed``).
"""

from __future__ import annotations

from typing import Any

import torch

from treadle.trainer.config.optim import OptimizerConfig


def split_params(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters of ``model``, each in ``named_parameters`` order.

    Muon gets the hidden matrices: parameters of 2 or more dimensions, each dimension > 1, that
    are neither an embedding table (any ``nn.Embedding``, and ``get_input_embeddings()``) nor an
    output head (``get_output_embeddings()`` of any sub-module, tied or not). AdamW gets the rest:
    embeddings, the LM head, 1-row heads (a critic's or reward model's ``[1, hidden]`` value head,
    whose orthogonalization would only normalize it), norm weights and biases.
    """
    outside: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            outside.update(id(p) for p in module.parameters())
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                found = getattr(module, getter, lambda: None)()
            except (NotImplementedError, AttributeError):  # transformers' base class raises for models without one
                found = None
            if isinstance(found, torch.nn.Module):
                outside.update(id(p) for p in found.parameters())
    muon, adam = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim >= 2 and min(p.shape) > 1 and id(p) not in outside
        (muon if hidden_matrix else adam).append(p)
    return muon, adam


def build_muon(model: torch.nn.Module, optim: OptimizerConfig, *, offload: bool) -> torch.optim.Optimizer:
    """DeepSpeed's ``MuonWithAuxAdam``: Muon (``--muon.lr``, ``--muon.momentum``) on
    ``split_params``'s matrices, AdamW (``--adam.*``) on the rest, DeepSpeed's CPU Adam for that
    half under ``--ds.adam_offload``. ``--adam.weight_decay`` decays the Muon matrices and the
    AdamW matrices (embeddings, heads), not norms and biases, as the AdamW-only optimizer does.

    Each parameter is tagged ``use_muon``: DeepSpeed's ZeRO stages read the tag to run
    Newton-Schulz on the matrices' gradients before they partition them.
    """
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # noqa: PLC0415

    muon, adam = split_params(model)
    for p in model.parameters():
        p.use_muon = False
    for p in muon:
        p.use_muon = True
    wd, aux = optim.adam.weight_decay, {"lr": optim.adam.lr, "betas": optim.adam.betas, "eps": optim.adam.eps}
    groups: list[dict[str, Any]] = [
        {"params": muon, "use_muon": True, "lr": optim.muon.lr, "momentum": optim.muon.momentum, "weight_decay": wd},
        {"params": [p for p in adam if p.ndim >= 2], "use_muon": False, "weight_decay": wd, **aux},
        {"params": [p for p in adam if p.ndim < 2], "use_muon": False, "weight_decay": 0.0, **aux},
    ]
    groups = [g for g in groups if g["params"]]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415  (JIT-builds its op on first use)

        return MuonWithAuxAdam(groups, adam_optimizer=DeepSpeedCPUAdam, adam_optimizer_kwargs={"adamw_mode": True})
    return MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW,
                           adam_optimizer_kwargs={"fused": torch.cuda.is_available()})
