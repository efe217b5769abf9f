"""DPO / cDPO / IPO: preference pairs scored by the policy against a frozen reference.

Per pair, the summed log-probs of the chosen and rejected answers under the policy and the
reference feed ``losses.preference`` (by ``--actor.loss_type``); the loss is the mean over the
step's pairs. ``--actor.nll_loss_coef`` adds c x (the chosen answer's per-token NLL) per pair.
Reference log-probs come on the fly or precomputed (``--ref.precompute_enable``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from treadle.trainer.checkpoint.checkpointer import TrainState
from treadle.trainer.config.commands import DPOConfig
from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.data.formatting import pair_samples
from treadle.trainer.data.samples import Sample
from treadle.trainer.losses.preference import PREFERENCE_LOSSES, implicit_reward
from treadle.trainer.models.actor import Actor
from treadle.trainer.ops.logprobs import sequence_sums
from treadle.trainer.trainers.base import Parts, SupervisedTrainer
from treadle.trainer.trainers.ref_logps import RefLogps, policy_with_reference
from treadle.trainer.trainers.sft import export_causal_lm


class DPOTrainer(SupervisedTrainer):
    """Pairwise preference loss of policy vs reference log-ratios."""

    def __init__(self, parts: Parts, ref: RefLogps, *, loss_type: str, beta: float, label_smoothing: float,
                 nll_coef: float) -> None:
        super().__init__(parts)
        self.actor = Actor(self.engine, ring=parts.ring)
        self.ref = ref
        self.loss_fn = PREFERENCE_LOSSES[loss_type]
        self.beta, self.label_smoothing, self.nll_coef = beta, label_smoothing, nll_coef

    def unit(self, sample: Sample) -> float:
        return 1.0

    def _pairs(self, batch: SeqBatch, split: str) -> dict[str, Tensor]:
        logprobs = self.actor(batch, targets_only=True).logprobs
        policy = sequence_sums(logprobs, batch.target_mask, batch.seq_index, batch.num_seqs)
        ref = self.ref.for_batch(batch, split)
        pc, pr, rc, rr = policy[0::2], policy[1::2], ref[0::2], ref[1::2]
        losses = self.loss_fn(pc, pr, rc, rr, self.beta, self.label_smoothing)
        if self.nll_coef:
            tokens = sequence_sums(torch.ones_like(logprobs), batch.target_mask, batch.seq_index, batch.num_seqs)
            losses = losses + self.nll_coef * (-pc / tokens[0::2].clamp(min=1))
        chosen, rejected = implicit_reward(pc, rc, self.beta), implicit_reward(pr, rr, self.beta)
        return {"loss": losses, "acc": (chosen > rejected).float(), "chosen_reward": chosen,
                "rejected_reward": rejected, "reward_margin": chosen - rejected}

    def micro_loss(self, batch: SeqBatch, group: Sequence[Sample], normaliser: float) -> tuple[Tensor, dict[str, Tensor]]:
        per = self._pairs(batch, "train")
        return per["loss"].sum() / normaliser, {k: v.detach().sum() for k, v in per.items()}

    def eval_sums(self, batch: SeqBatch, group: Sequence[Sample]) -> dict[str, Tensor]:
        w = batch.sample_weight
        return {**{k: (v * w).sum() for k, v in self._pairs(batch, "eval").items()}, "_n": w.sum()}

    def export(self, out: Path) -> None:
        export_causal_lm(self, out)


def build_trainer(cfg: DPOConfig) -> DPOTrainer:
    data = cfg.data
    parts, ref = policy_with_reference(cfg, lambda rows, fmt: pair_samples(
        rows, fmt, prompt_key=data.prompt_key, chosen_key=data.chosen_key, rejected_key=data.rejected_key,
        margin_key=None, max_len=data.max_len), "dpo")
    a = cfg.actor
    return DPOTrainer(parts, ref, loss_type=a.loss_type, beta=a.beta, label_smoothing=a.label_smoothing,
                      nll_coef=a.nll_loss_coef)


def run(cfg: DPOConfig) -> TrainState:
    trainer = build_trainer(cfg)
    try:
        return trainer.fit(resume=cfg.ckpt.load_enable)
    finally:
        trainer.close()
