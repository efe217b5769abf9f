"""An exponential moving average of the actor's weights (``--train.enable_ema``), exported as the
final model instead of the trained actor (OpenRLHF's ``--train.enable_ema`` / ``--train.ema_beta``).

After every optimizer step of the actor (none while it is frozen), for every trainable parameter::

    ema_t = beta * ema_{t-1} + (1 - beta) * theta_t,    ema_0 = theta_0   (the starting weights)

so after ``T`` steps ``ema_T = beta^T theta_0 + sum_t (1 - beta) beta^(T-t) theta_t``. The rollout
engines keep sampling from the actor; only exports (the final model, and ``--ckpt.save_hf``'s
copies in checkpoints) are the EMA, as in OpenRLHF.

Where it lives: each rank keeps a 1/W slice of every parameter, in fp32, beside the slice it
reads. Under ZeRO-3 that slice is the rank's own partition (``p.ds_tensor``: on the GPU, or in
host memory with ``--ds.param_offload``), so an update moves no bytes between ranks; under stages
0-2 (every rank holds the whole parameter) it is the same-sized piece of the flattened tensor.
An export gathers the slices onto rank 0. Differences from OpenRLHF, with the reasons:

- OpenRLHF builds a second model (bf16) from the checkpoint: a whole copy on every GPU under
  stages 0-2, ZeRO-3-partitioned in host memory under stage 3, where every update gathers it
  (and the actor's parameters are gathered alike). treadle keeps 4 bytes / W ranks per parameter
  and communicates only at export.
- fp32, not the parameter dtype: in bf16 (8 bits of mantissa) an increment ``(1 - beta) * delta``
  smaller than half a unit in the last place of the weight is rounded away; with beta 0.992 that
  is every step that changes a weight by less than a quarter to a half of its own size, so a
  bf16 EMA of small-learning-rate training stays where it started.
- Under ZeRO-3 OpenRLHF's update writes into the gathered EMA parameters inside
  ``GatheredParameters(..., modifier_rank=None)``, whose exit re-partitions them with
  ``has_been_updated=False`` (DeepSpeed 0.19.8, ``partition_parameters.py``): the partitions keep
  their old values, so its ZeRO-3 EMA stays the starting weights. Run as written on the tiny
  model (2 gloo ranks, with and without parameter offload, persistent parameters or none), every
  parameter kept its starting value; with ``modifier_rank=0`` every one moved. treadle's
  partitions are its own tensors.

Resumable checkpoints keep each rank's slices (``save`` / ``load``), so a resumed run goes on
averaging where it stopped (OpenRLHF saves no EMA: a resumed run's starts again from the
starting checkpoint); resumed on another rank count or ZeRO stage, the slices no longer fit and
the average starts again from the resumed weights (``reset``, with a warning). LoRA (the
trainable tensors are adapters, the export merges them) is refused with it at parse time
(``config.commands``); AutoTP, whose parameters are tensor-parallel shards, is refused for PPO
altogether (``trainers.build.start``). PPO family only: OpenRLHF's SFT, RM and DPO have no EMA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def ema_update_(ema: Sequence[Tensor], params: Sequence[Tensor], beta: float) -> None:
    """In place, for each pair: ``ema <- beta * ema + (1 - beta) * param`` (``param`` converted to
    ``ema``'s device and dtype; any shapes, pairwise equal). ``beta`` 0 copies the parameters,
    ``beta`` 1 keeps the average where it is."""
    if not ema:
        return
    torch._foreach_lerp_(list(ema), [p.detach().to(e.device, e.dtype) for e, p in zip(ema, params, strict=True)],
                         1.0 - beta)


def _group_rank_world(group: Any) -> tuple[int, int]:
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class ActorEMA:
    """This rank's fp32 slices of the EMA of ``module``'s trainable parameters (see module docstring).

    Building, ``update`` and ``apply`` are per rank; ``apply`` is collective (every rank calls it)."""

    def __init__(self, module: torch.nn.Module, *, beta: float, zero3: bool) -> None:
        self.beta = beta
        self.zero3 = zero3
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.aliases = self._aliases(module)
        self.shards = [self._slice(p).to(torch.float32, copy=True) for p in self.params]

    def _aliases(self, module: torch.nn.Module) -> list[list[str]]:
        """For each trainable parameter, every state-dict key that holds it (tied embeddings: two)."""
        keys: dict[int, list[str]] = {}
        for key, value in module.state_dict(keep_vars=True).items():
            keys.setdefault(id(value), []).append(key)
        return [keys.get(id(p), [n]) for n, p in zip(self.names, self.params, strict=True)]

    def _group(self, p: Tensor) -> Any:
        return p.ds_process_group if self.zero3 else None

    def _slice(self, p: Tensor) -> Tensor:
        """This rank's slice of ``p``'s current value: its ZeRO-3 partition, or the piece of the
        flattened tensor at the same place (the last rank's padded to the common length)."""
        if self.zero3:
            return p.ds_tensor.detach()
        rank, world = _group_rank_world(None)
        flat = p.detach().reshape(-1)
        size = math.ceil(flat.numel() / world)
        piece = flat[min(rank * size, flat.numel()):min((rank + 1) * size, flat.numel())]
        if piece.numel() == size:
            return piece
        return torch.cat([piece, piece.new_zeros(size - piece.numel())])

    def save(self, folder: Path, rank: int) -> None:
        """Write this rank's slices to ``folder/ema_rank<rank>.safetensors`` (a checkpoint's)."""
        from safetensors.torch import save_file  # noqa: PLC0415

        save_file({n: s.contiguous() for n, s in zip(self.names, self.shards, strict=True)},
                  str(folder / f"ema_rank{rank}.safetensors"))

    @torch.no_grad()
    def load(self, folder: Path, rank: int) -> bool:
        """Restore this rank's slices from a checkpoint's ``folder``; False (nothing changed) when
        it has none for this rank, or slices of other shapes (another rank count or ZeRO stage)."""
        from safetensors.torch import load_file  # noqa: PLC0415

        path = folder / f"ema_rank{rank}.safetensors"
        saved = load_file(str(path)) if path.is_file() else {}
        if any(n not in saved or saved[n].shape != s.shape for n, s in zip(self.names, self.shards, strict=True)):
            return False
        for n, shard in zip(self.names, self.shards, strict=True):
            shard.copy_(saved[n])
        return True

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the actor's current weights (after a resume)."""
        for shard, p in zip(self.shards, self.params, strict=True):
            shard.copy_(self._slice(p))

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step from the actor's current weights (call after each of its optimizer steps)."""
        ema_update_(self.shards, [self._slice(p) for p in self.params], self.beta)

    def _full(self, i: int, is_main: bool) -> Tensor | None:
        """Parameter ``i``'s EMA in whole, in the parameter's dtype, on the CPU of rank 0 (collective)."""
        import torch.distributed as dist  # noqa: PLC0415

        p, shard = self.params[i], self.shards[i]
        group = self._group(p)
        _, world = _group_rank_world(group)
        shape = p.ds_shape if self.zero3 else p.shape
        numel = math.prod(shape)
        if world == 1:
            flat = shard
        else:  # NCCL gathers GPU tensors only: offloaded (host) slices visit the GPU for it
            if dist.get_backend(group) == "nccl":
                shard = shard.to(torch.device("cuda", torch.cuda.current_device()))
            parts = [torch.empty_like(shard) for _ in range(world)]
            dist.all_gather(parts, shard, group=group)
            flat = torch.cat(parts)
        return flat[:numel].reshape(shape).to(p.dtype).cpu() if is_main else None

    def apply(self, state: dict[str, Tensor] | None, *, is_main: bool) -> dict[str, Tensor] | None:
        """``state`` (an export's full state dict on rank 0, None elsewhere) with every trainable
        parameter replaced by its EMA (collective: every rank calls it)."""
        for i in range(len(self.params)):
            full = self._full(i, is_main)
            if is_main:
                assert state is not None
                for key in self.aliases[i]:
                    if key in state:
                        state[key] = full
        return state
