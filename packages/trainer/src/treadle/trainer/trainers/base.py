"""The training loop every single-model recipe (SFT, RM, DPO, KTO) shares.

One optimizer step: this rank's share of the global batch (``data.order``) is cut into
micro-batches (by count, or by token budget with ``--train.dynamic_batch_enable``; every rank
runs the same number so ZeRO-3's collective gathers line up), each is padded or packed, and its
loss is back-propagated; DeepSpeed reduces the gradients and steps at the last one. Under AutoTP
the ranks of a tensor-parallel group form one data-parallel slot and train on the same samples.

Normalisation (STYLE.md habit 3): before the step, ranks all-reduce ``N``, the number of
normalising units in the whole step (target tokens for SFT, pairs for RM / DPO, rows for KTO).
A recipe's ``micro_loss`` returns sum-over-its-units / N, so the micro-batch losses of all ranks
add up to the step's mean; it is multiplied by the number of ranks DeepSpeed averages gradients
over (the world; the data-parallel slots under AutoTP) before ``backward``. Any split of the
batch gives the same gradient.

Ring attention (``Parts.ring``): the ranks of a ring train on the same samples (their
data-parallel slot's share), each model forward runs on the rank's slots of the packed row and
gathers per-token results back (``models.actor``, ``models.value_model``), so every ring rank
computes the same loss; its backward leaves each rank the gradient part of its own tokens, and
DeepSpeed's reduction over all ranks, still scaled by the full world size, sums them. Counts
and metric sums are all-reduced over the data-parallel group only, so each sample counts once.

Recipes subclass ``SupervisedTrainer`` and implement ``unit``, ``micro_loss``, ``eval_sums`` and
``export``. A long ``fit`` is the documented exception to short functions: the whole loop is in
view in one place.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from treadle.common.log import get_logger
from treadle.common.metrics import MetricsLogger, plot_curves
from treadle.trainer.checkpoint.checkpointer import Checkpointer, TrainState
from treadle.trainer.data.batching import (
    SeqBatch,
    by_count,
    by_tokens,
    pack_batch,
    pad_batch,
    split_to,
)
from treadle.trainer.data.order import StepOrder, eval_share
from treadle.trainer.data.samples import Sample
from treadle.trainer.ring.group import DataParallel, RingGroup, data_parallel
from treadle.trainer.strategy.deepspeed import DistInfo, all_reduce

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopConfig:
    """What the loop reads from the command's config."""

    max_epochs: int
    """Passes over the training set."""
    micro_batch: int
    """Samples per micro-batch (fixed batching)."""
    token_budget: int | None
    """Tokens per micro-batch (dynamic batching); None: by count."""
    packing: bool
    """Pack micro-batches into one row instead of padding."""
    eval_steps: int
    """Evaluate every this many steps; -1: at the end of each epoch."""
    save_steps: int
    """Checkpoint every this many steps; -1: only at the end."""
    logging_steps: int
    """Log train metrics every this many steps."""
    best_key: str | None
    """Eval metric that picks the best checkpoint (lower is better for *loss*); None: off."""
    save_hf: bool
    """Export HF weights into every checkpoint."""
    output_dir: Path
    """Where the final HF model goes."""


@dataclass(slots=True, kw_only=True)
class Parts:
    """Everything built before the loop starts."""

    dist: DistInfo
    engine: Any
    tokenizer: Any
    train_set: list[Sample]
    eval_set: list[Sample]
    order: StepOrder
    checkpointer: Checkpointer
    metrics: MetricsLogger | None
    loop: LoopConfig
    zero_stage: int
    ring: RingGroup | None = None
    """This rank's ring under ring attention (``build.ring_group``); None: off."""
    dp: DataParallel | None = None
    """This rank's data-parallel slot (``build.data_parallel_view``); None: from ``ring``."""


class SupervisedTrainer:
    """The shared loop; a recipe supplies the loss (see module docstring)."""

    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self.dist = parts.dist
        self.engine = parts.engine
        self.loop = parts.loop
        self.pad_id = parts.tokenizer.pad_token_id or 0
        self.ring = parts.ring
        self.dp = parts.dp or data_parallel(parts.dist, parts.ring)
        # The ranks DeepSpeed averages gradients over: every rank under ring attention (ring
        # peers hold partial gradients), the data-parallel slots under AutoTP.
        self.grad_world = self.dp.world * (parts.ring.size if parts.ring is not None else 1)

    # -- what a recipe implements ------------------------------------------------------------

    def unit(self, sample: Sample) -> float:
        """Normalising units of ``sample`` (target tokens, pairs, rows)."""
        raise NotImplementedError

    def micro_loss(self, batch: SeqBatch, group: Sequence[Sample], normaliser: float) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss = sum over the micro-batch's units / normaliser, {metric: detached sum over units})."""
        raise NotImplementedError

    def eval_sums(self, batch: SeqBatch, group: Sequence[Sample]) -> dict[str, Tensor]:
        """{metric: weighted sum, "_n": weighted count}; metrics are reported as sum / _n."""
        raise NotImplementedError

    def export(self, out: Path) -> None:
        """Write the trained model in HF format to ``out`` (collective: every rank calls it)."""
        raise NotImplementedError

    # -- batches -------------------------------------------------------------------------------

    def groups(self, samples: Sequence[Sample]) -> list[list[Sample]]:
        """Micro-batches of ``samples``, as many on every rank."""
        if self.loop.token_budget is None:
            return by_count(samples, self.loop.micro_batch)
        groups = by_tokens(samples, self.loop.token_budget)
        count = int(all_reduce([len(groups)], self.dist.device, op="max")[0])
        return split_to(groups, count)

    def collate(self, group: Sequence[Sample], fillers: int = 0) -> SeqBatch:
        batch = pack_batch(group, fillers=fillers) if self.loop.packing else pad_batch(group, self.pad_id, fillers=fillers)
        return batch.to(self.dist.device)

    # -- one step ------------------------------------------------------------------------------

    def train_step(self, epoch: int, step: int) -> dict[str, float]:
        """Forward/backward every micro-batch of this rank's share of the step, then step the optimizer."""
        samples = [self.p.train_set[i] for i in self.p.order.rank_share(epoch, step, self.dp.rank)]
        groups = self.groups(samples)
        normaliser, tokens = all_reduce([sum(self.unit(s) for s in samples), sum(s.num_tokens for s in samples)],
                                        self.dist.device, group=self.dp.group)
        sums: dict[str, float] = defaultdict(float)
        self.engine.train()
        for k, group in enumerate(groups):
            self.engine.set_gradient_accumulation_boundary(k == len(groups) - 1)
            loss, stats = self.micro_loss(self.collate(group), group, max(normaliser, 1.0))
            self.engine.backward(loss * self.grad_world, scale_wrt_gas=False)
            self.engine.step()
            for name, value in stats.items():
                sums[name] += float(value)
        names = sorted(sums)
        reduced = all_reduce([sums[n] for n in names], self.dist.device, group=self.dp.group)
        metrics = {n: v / max(normaliser, 1.0) for n, v in zip(names, reduced, strict=True)}
        grad_norm = self.engine.get_global_grad_norm()
        metrics.update(lr=self.engine.get_lr()[0], tokens=tokens, micro_batches=len(groups))
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        return metrics

    def evaluation_pass(self, dataset: Sequence[Sample], fn: Callable[[SeqBatch, Sequence[Sample]], dict[str, Tensor]]) -> dict[str, float]:
        """All-reduced sums of ``fn`` over ``dataset`` split across ranks (no gradients)."""
        idx, fillers = eval_share(len(dataset), self.dp.world, self.dp.rank)
        samples = [dataset[i] for i in idx]
        sums: dict[str, float] = defaultdict(float)
        self.engine.eval()
        seen = 0
        with torch.no_grad():
            for group in self.groups(samples):
                seen += len(group)
                in_group = max(0, fillers - (len(samples) - seen))
                for name, value in fn(self.collate(group, fillers=in_group), group).items():
                    sums[name] += float(value)
        self.engine.train()
        names = sorted(sums)
        reduced = all_reduce([sums[n] for n in names], self.dist.device, group=self.dp.group)
        return dict(zip(names, reduced, strict=True))

    def evaluate(self) -> dict[str, float]:
        """``eval_<metric>`` means over the evaluation set."""
        sums = self.evaluation_pass(self.p.eval_set, self.eval_sums)
        n = max(sums.pop("_n", 0.0), 1e-12)
        return {f"eval_{k}": v / n for k, v in sums.items()}

    # -- bookkeeping ---------------------------------------------------------------------------

    def _eval_due(self, state: TrainState, end_of_epoch: bool) -> bool:
        if not self.p.eval_set:
            return False
        if self.loop.eval_steps == -1:
            return end_of_epoch
        return state.global_step % self.loop.eval_steps == 0

    def _better(self, value: float, best: float | None) -> bool:
        lower = "loss" in (self.loop.best_key or "")
        return best is None or (value < best if lower else value > best)

    def _track_best(self, state: TrainState, metrics: dict[str, float]) -> tuple[TrainState, bool]:
        key = self.loop.best_key
        if key is None or key not in metrics or not self._better(metrics[key], state.best_metric):
            return state, False
        return replace(state, best_metric=metrics[key], best_step=state.global_step), True

    def save(self, state: TrainState) -> Path:
        write_hf = self.export if self.loop.save_hf else None
        path = self.p.checkpointer.save(self.engine, state, write_hf=write_hf)
        if self.dist.is_main:
            log.info("checkpoint saved", extra={"fields": {"path": str(path), "step": state.global_step}})
        return path

    def resume(self, enabled: bool) -> TrainState:
        latest = self.p.checkpointer.latest() if enabled else None
        if latest is None:
            return TrainState()
        state = self.p.checkpointer.load(self.engine, latest)
        if self.dist.is_main:
            log.info("resumed", extra={"fields": {"path": str(latest), "step": state.global_step}})
        return state

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self.p.metrics is not None:
            self.p.metrics.log(step, metrics)

    # -- the loop ------------------------------------------------------------------------------

    def fit(self, *, resume: bool = False) -> TrainState:
        """Train to the end (or from the newest checkpoint with ``resume``); export; returns the final state."""
        from tqdm.auto import tqdm  # noqa: PLC0415

        order, loop = self.p.order, self.loop
        state = self.resume(resume)
        total = order.steps_per_epoch * loop.max_epochs
        bar = tqdm(total=total, initial=state.global_step, disable=not self.dist.is_main, desc="train", dynamic_ncols=True)
        saved_at = state.global_step if state.global_step else None
        while state.epoch < loop.max_epochs:
            start = time.perf_counter()
            metrics = self.train_step(state.epoch, state.step_in_epoch)
            state = state.advanced(order.steps_per_epoch)
            seconds = time.perf_counter() - start
            metrics.update(epoch=state.epoch if state.step_in_epoch == 0 else state.epoch + state.step_in_epoch / order.steps_per_epoch,
                           step_seconds=seconds, tokens_per_s=metrics["tokens"] / seconds)
            improved = False
            if self._eval_due(state, state.step_in_epoch == 0):
                scores = self.evaluate()
                metrics.update(scores)
                state, improved = self._track_best(state, scores)
            if state.global_step % loop.logging_steps == 0 or improved or state.global_step == total:
                self._log(state.global_step, metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}")
            if improved or (loop.save_steps > 0 and state.global_step % loop.save_steps == 0):
                self.save(state)
                saved_at = state.global_step
        bar.close()
        if saved_at != state.global_step:
            self.save(state)
        self.export(loop.output_dir)
        return state

    def close(self, *, plot: bool = True) -> None:
        """Flush metrics and draw the curves (rank 0)."""
        if self.p.metrics is not None:
            self.p.metrics.close()
            path = self.p.metrics.path
            if plot and path.is_file() and path.stat().st_size:
                plot_curves(path, path.with_name("curves.png"), title=type(self).__name__)
