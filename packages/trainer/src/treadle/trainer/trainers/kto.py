"""KTO: unpaired (prompt, answer, desirable?) rows scored by the policy against a frozen reference.

Each sample carries its answer and a mismatched answer (the next row's, see
``data.formatting.kto_samples``). The KL baseline z_0 = max(0, mean(log pi - log ref)) over the
mismatched answers of the micro-batch on all ranks (an all-reduce; detached, as in
``losses.preference.kto_kl_baseline``); the loss is the mean of ``kto_loss`` over the step's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from treadle.trainer.checkpoint.checkpointer import TrainState
from treadle.trainer.config.commands import KTOConfig
from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.data.formatting import kto_samples
from treadle.trainer.data.samples import Sample
from treadle.trainer.losses.preference import kto_loss
from treadle.trainer.models.actor import Actor
from treadle.trainer.ops.logprobs import sequence_sums
from treadle.trainer.strategy.deepspeed import all_reduce
from treadle.trainer.trainers.base import Parts, SupervisedTrainer
from treadle.trainer.trainers.ref_logps import RefLogps, policy_with_reference
from treadle.trainer.trainers.sft import export_causal_lm


class KTOTrainer(SupervisedTrainer):
    """Prospect-theoretic loss on single answers, with a batch KL baseline."""

    def __init__(self, parts: Parts, ref: RefLogps, *, beta: float, desirable_weight: float,
                 undesirable_weight: float) -> None:
        super().__init__(parts)
        self.actor = Actor(self.engine, ring=parts.ring)
        self.ref = ref
        self.beta, self.w_d, self.w_u = beta, desirable_weight, undesirable_weight

    def unit(self, sample: Sample) -> float:
        return 1.0

    def _rows(self, batch: SeqBatch, group: Sequence[Sample], split: str, weight: Tensor) -> dict[str, Tensor]:
        logprobs = self.actor(batch, targets_only=True).logprobs
        policy = sequence_sums(logprobs, batch.target_mask, batch.seq_index, batch.num_seqs)
        ref = self.ref.for_batch(batch, split)
        gap = (policy[1::2] - ref[1::2]).detach().float()
        total, count = all_reduce([float((gap * weight).sum()), float(weight.sum())], self.dist.device,
                                  group=self.dp.group)
        kl = torch.tensor(max(total / max(count, 1e-12), 0.0), device=policy.device)
        desirable = torch.tensor([s.desirable for s in group], device=policy.device)
        losses = kto_loss(policy[0::2], ref[0::2], desirable, kl, self.beta, self.w_d, self.w_u)
        reward = self.beta * (policy[0::2] - ref[0::2]).float()
        return {"loss": losses, "kl": kl.expand_as(losses), "desirable_reward": reward * desirable,
                "undesirable_reward": reward * ~desirable, "desirable": desirable.float()}

    def micro_loss(self, batch: SeqBatch, group: Sequence[Sample], normaliser: float) -> tuple[Tensor, dict[str, Tensor]]:
        per = self._rows(batch, group, "train", torch.ones(len(group), device=batch.input_ids.device))
        return per["loss"].sum() / normaliser, {k: v.detach().sum() for k, v in per.items()}

    def eval_sums(self, batch: SeqBatch, group: Sequence[Sample]) -> dict[str, Tensor]:
        w = batch.sample_weight
        return {**{k: (v * w).sum() for k, v in self._rows(batch, group, "eval", w).items()}, "_n": w.sum()}

    def export(self, out: Path) -> None:
        export_causal_lm(self, out)


def build_trainer(cfg: KTOConfig) -> KTOTrainer:
    data = cfg.data
    parts, ref = policy_with_reference(cfg, lambda rows, fmt: kto_samples(
        rows, fmt, input_key=data.input_key, output_key=data.output_key, label_key=data.label_key,
        max_len=data.max_len), "kto")
    a = cfg.actor
    return KTOTrainer(parts, ref, beta=a.beta, desirable_weight=a.desirable_weight, undesirable_weight=a.undesirable_weight)


def run(cfg: KTOConfig) -> TrainState:
    trainer = build_trainer(cfg)
    try:
        return trainer.fit(resume=cfg.ckpt.load_enable)
    finally:
        trainer.close()
