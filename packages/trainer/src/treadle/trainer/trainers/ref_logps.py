"""Reference log-probabilities of whole answers for DPO / KTO: on the fly, or precomputed once.

``RefLogps.for_batch(batch, split)`` gives ``[S]`` summed reference log-probs of a micro-batch's
target tokens, one per sequence. On the fly it runs the frozen ``Reference`` (sharded under
ZeRO-3: the trainers' micro-batch counts are already equal on every rank); with
``--ref.precompute_enable`` every sample of both splits is scored once before training (data-
parallel slot r scores samples r, r + W, ...; a sharded reference runs as many batches on every
rank; an all-reduce over the data-parallel group assembles the table on every rank) and the
reference model is freed. Under ring attention the reference scores on the ring like the policy
(``models.reference``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.config.model import FrozenRefConfig
from treadle.trainer.data.batching import SeqBatch, local_batches, split_to
from treadle.trainer.data.order import eval_share
from treadle.trainer.data.samples import Sample
from treadle.trainer.models.reference import Reference
from treadle.trainer.ops.logprobs import sequence_sums
from treadle.trainer.ring.group import RingGroup, data_parallel
from treadle.trainer.strategy.deepspeed import DistInfo, all_reduce
from treadle.trainer.trainers import build

Batches = Callable[[Sequence[Sample]], list[tuple[list[Sample], SeqBatch]]]


def reference_sums(ref: Reference, batch: SeqBatch) -> Tensor:
    """``[S]`` sum over each sequence's target tokens of log ref(x_t | x_<t)."""
    return sequence_sums(ref.logprobs(batch, targets_only=True), batch.target_mask, batch.seq_index, batch.num_seqs)


class RefLogps:
    """Per-sequence reference log-probs, by split ("train" / "eval")."""

    def __init__(self, ref: Reference | None, tables: dict[str, Tensor] | None = None) -> None:
        self.ref = ref
        self.tables = tables or {}

    def for_batch(self, batch: SeqBatch, split: str) -> Tensor:
        if split in self.tables:
            table = self.tables[split]
            return table[list(batch.sample_index)].reshape(-1).to(batch.input_ids.device)
        assert self.ref is not None
        return reference_sums(self.ref, batch)

    @staticmethod
    def precompute(ref: Reference, splits: dict[str, Sequence[Sample]], dist: DistInfo, batches: Batches) -> RefLogps:
        """Score every sample of ``splits`` once; ``batches(samples)`` gives (group, CPU SeqBatch) pairs."""
        dp = data_parallel(dist, ref.ring)
        tables = {}
        for name, samples in splits.items():
            if not samples:
                continue
            per = len(samples[0].seqs)
            table = torch.zeros(len(samples), per, dtype=torch.float64, device=dist.device)
            idx, fillers = eval_share(len(samples), dp.world, dp.rank)
            owned = idx[: len(idx) - fillers]
            # A sharded reference scores the fillers too: every rank then has as many samples to split.
            pairs = batches([samples[i] for i in (idx if ref.sharded else owned)])
            if ref.sharded:
                pairs = _equalised(pairs, batches, dist.device)
            keep = {samples[i].index for i in owned}  # a filler of a slot without samples is not its own
            for group, batch in pairs:
                sums = reference_sums(ref, batch.to(dist.device)).reshape(len(group), per).double()
                rows = [k for k, s in enumerate(group) if s.index in keep]
                table[[group[k].index for k in rows]] = sums[rows]
            if torch.distributed.is_initialized() and dp.world > 1:
                torch.distributed.all_reduce(table, group=dp.group)
            tables[name] = table.float()
        return RefLogps(None, tables)


def _equalised(pairs: list[tuple[list[Sample], SeqBatch]], batches: Batches,
               device: torch.device) -> list[tuple[list[Sample], SeqBatch]]:
    """``pairs`` split into as many batches as the rank with the most has (``split_to``).

    A sharded (ZeRO-3) reference gathers its parameters collectively in every forward, so every
    rank must run as many. ``batches(g)`` of a piece ``g`` of a batch is that one batch again
    (fewer samples, fewer tokens: within the same limits).
    """
    count = int(all_reduce([len(pairs)], device, op="max")[0])
    if count <= len(pairs):
        return pairs
    return [batches(g)[0] for g in split_to([g for g, _ in pairs], count)]


def build_reference(ref_cfg: FrozenRefConfig, policy_path: str, ds: DeepSpeedConfig, dist: DistInfo,
                    splits: dict[str, Sequence[Sample]], batches: Batches, ring: RingGroup | None = None) -> RefLogps:
    """The reference scorer of a DPO / KTO run: the frozen model (sharded under ZeRO-3, see
    ``build.reference``), or a table it precomputed."""
    ref = build.reference(ref_cfg.model_name_or_path or policy_path, ds, dist, offload=ref_cfg.offload, ring=ring)
    if not ref_cfg.precompute_enable:
        return RefLogps(ref)
    table = RefLogps.precompute(ref, splits, dist, batches)
    ref.close()
    del ref  # the table replaces the model: free its memory for training
    return table


def local_batches_of(cfg: Any, pad_id: int) -> Batches:
    """How a DPO / KTO config batches samples, for the precomputation on one rank."""
    t = cfg.train
    return functools.partial(local_batches, micro_batch=t.micro_batch_size, packing=cfg.ds.packing_samples,
                             token_budget=t.max_tokens_per_gpu if t.dynamic_batch_enable else None, pad_id=pad_id)


def policy_with_reference(cfg: Any, samples: Callable[[Any, Any], list[Sample]], recipe: str) -> tuple[Any, RefLogps]:
    """DPO / KTO's shared build: distributed start, ring, data (``samples(rows, formatter)``), the
    reference's log-probs, the trainable policy and its engine -> (``Parts``, ``RefLogps``)."""
    from treadle.trainer.models.loading import load_causal_lm  # noqa: PLC0415
    from treadle.trainer.trainers.base import Parts  # noqa: PLC0415

    dist = build.start(cfg, ring_supported=True, tp_supported=True)
    ring = build.ring_group(cfg, dist)
    dp = build.data_parallel_view(cfg, dist, ring)
    tok, fmt = build.tokenizer_and_formatter(cfg)
    train, evaluation = build.datasets(cfg, lambda rows: samples(rows, fmt), dist, tok)
    ref = build_reference(cfg.ref, cfg.actor.model_name_or_path, cfg.ds, dist, {"train": train, "eval": evaluation},
                          local_batches_of(cfg, tok.pad_token_id or 0), ring=ring)
    model = load_causal_lm(cfg.actor.model_name_or_path, cfg.ds, trainable=True,
                           gradient_checkpointing=cfg.actor.gradient_checkpointing_enable,
                           reentrant=cfg.actor.gradient_checkpointing_reentrant)
    engine, order = build.engine(model, cfg, dist, len(train), ring, dp)
    parts = Parts(dist=dist, engine=engine, tokenizer=tok, train_set=train, eval_set=evaluation, order=order,
                  checkpointer=build.checkpointer(cfg, dist), metrics=build.metrics_logger(cfg, dist, recipe),
                  loop=build.loop_config(cfg, "eval_loss"), zero_stage=cfg.ds.zero_stage, ring=ring, dp=dp)
    return parts, ref
