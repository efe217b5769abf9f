"""Reward-model training on preference pairs: pairwise Bradley-Terry loss, optional margin.

Each pair's chosen and rejected sequences go through the reward model in the same micro-batch;
scores are read at each sequence's last token. The loss is the mean over the step's pairs
(``losses.rm``). The exported model loads with ``AutoModelForSequenceClassification``; the mean
and standard deviation of its scores (on the evaluation set, else on training pairs) are stored
in its config as ``reward_mean`` / ``reward_std`` for normalised use in RL.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from treadle.trainer.checkpoint.checkpointer import TrainState
from treadle.trainer.checkpoint.export import full_state_dict, save_reward_model
from treadle.trainer.config.commands import RMConfig
from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.data.formatting import pair_samples
from treadle.trainer.data.samples import Sample
from treadle.trainer.losses.rm import RM_LOSSES, pair_accuracy
from treadle.trainer.models.reward_model import RewardModel
from treadle.trainer.models.value_model import token_values
from treadle.trainer.trainers import build
from treadle.trainer.trainers.base import Parts, SupervisedTrainer

_STATS_SAMPLES = 1024  # training pairs scored for reward_mean / reward_std when there is no eval set


class RMTrainer(SupervisedTrainer):
    """Pairwise loss on the scores of (chosen, rejected)."""

    def __init__(self, parts: Parts, *, loss_type: str, margin: bool) -> None:
        super().__init__(parts)
        self.loss_fn = RM_LOSSES[loss_type]
        self.margin = margin

    def unit(self, sample: Sample) -> float:
        return 1.0

    def _scores(self, batch: SeqBatch) -> tuple[Tensor, Tensor]:
        scores = RewardModel.scores(token_values(self.engine, batch, self.ring), batch)
        return scores[0::2], scores[1::2]

    def _per_pair(self, batch: SeqBatch, group: Sequence[Sample]) -> tuple[Tensor, Tensor, Tensor]:
        chosen, rejected = self._scores(batch)
        margin = torch.tensor([s.margin for s in group], device=chosen.device) if self.margin else None
        return self.loss_fn(chosen, rejected, margin), chosen, rejected

    def micro_loss(self, batch: SeqBatch, group: Sequence[Sample], normaliser: float) -> tuple[Tensor, dict[str, Tensor]]:
        losses, chosen, rejected = self._per_pair(batch, group)
        stats = {"loss": losses.sum(), "acc": pair_accuracy(chosen, rejected).sum(),
                 "chosen_reward": chosen.sum(), "rejected_reward": rejected.sum()}
        return losses.sum() / normaliser, {k: v.detach() for k, v in stats.items()}

    def eval_sums(self, batch: SeqBatch, group: Sequence[Sample]) -> dict[str, Tensor]:
        losses, chosen, rejected = self._per_pair(batch, group)
        w = batch.sample_weight
        return {"loss": (losses * w).sum(), "acc": (pair_accuracy(chosen, rejected) * w).sum(),
                "reward_gap": ((chosen - rejected) * w).sum(), "_n": w.sum()}

    def _score_moments(self, batch: SeqBatch, group: Sequence[Sample]) -> dict[str, Tensor]:
        scores = RewardModel.scores(token_values(self.engine, batch, self.ring), batch)
        w = batch.sample_weight.repeat_interleave(2)
        return {"n": w.sum(), "s": (scores * w).sum(), "s2": (scores.square() * w).sum()}

    def export(self, out: Path) -> None:
        data = self.p.eval_set or self.p.train_set[:_STATS_SAMPLES]
        m = self.evaluation_pass(data, self._score_moments)
        mean = m["s"] / m["n"]
        std = max(m["s2"] / m["n"] - mean * mean, 0.0) ** 0.5
        state = full_state_dict(self.engine, zero_stage=self.p.zero_stage, is_main=self.dist.is_main)
        if self.dist.is_main:
            module = self.engine.module
            save_reward_model(state, module.config, self.p.tokenizer, out, mean=mean, std=std,
                              head_prefix=module.head_prefix)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


def build_trainer(cfg: RMConfig) -> RMTrainer:
    data = cfg.data
    dist = build.start(cfg, ring_supported=True)
    ring = build.ring_group(cfg, dist)
    tok, fmt = build.tokenizer_and_formatter(cfg)
    margin_key = data.margin_key if cfg.actor.margin_loss_enable else None
    train, evaluation = build.datasets(cfg, lambda rows: pair_samples(
        rows, fmt, prompt_key=data.prompt_key, chosen_key=data.chosen_key, rejected_key=data.rejected_key,
        margin_key=margin_key, max_len=data.max_len), dist, tok)
    model = RewardModel.from_pretrained(cfg.actor.model_name_or_path, cfg.ds,
                                        gradient_checkpointing=cfg.actor.gradient_checkpointing_enable,
                                        reentrant=cfg.actor.gradient_checkpointing_reentrant)
    engine, order = build.engine(model, cfg, dist, len(train), ring)
    parts = Parts(dist=dist, engine=engine, tokenizer=tok, train_set=train, eval_set=evaluation, order=order,
                  checkpointer=build.checkpointer(cfg, dist), metrics=build.metrics_logger(cfg, dist, "rm"),
                  loop=build.loop_config(cfg, "eval_loss"), zero_stage=cfg.ds.zero_stage, ring=ring)
    return RMTrainer(parts, loss_type=cfg.actor.loss_type, margin=cfg.actor.margin_loss_enable)


def run(cfg: RMConfig) -> TrainState:
    trainer = build_trainer(cfg)
    try:
        return trainer.fit(resume=cfg.ckpt.load_enable)
    finally:
        trainer.close()
