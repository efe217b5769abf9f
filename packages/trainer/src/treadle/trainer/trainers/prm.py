"""Process-reward-model training on step-labelled rows: binary cross-entropy at each step's last token.

The rows (``data.steps``: TRL's prompt / completions / labels, or OpenRLHF's placeholder format)
become one sequence per row whose target tokens are the steps' last tokens; the model is the
reward model's (``models.reward_model.ProcessRewardModel``: a value head on the backbone), and
its value at a target token is that step's logit. The loss is the mean over every labelled step
of the optimizer step (``losses.prm``; a row with more steps weighs more, as in TRL's token-mean
cross-entropy). The exported model loads with ``AutoModelForSequenceClassification`` like a
reward model (read it per token: the head applied to every hidden state), and records the step
marker in its config as ``step_separator`` for PPO's ``--reward.prm_model_name_or_path``.

Differences from OpenRLHF's ``train_prm`` (kept on purpose): OpenRLHF trains the LM head's
logits of the two reward tokens at each placeholder (a softmax over them is this sigmoid of
their difference), so its PRM stays a causal LM; treadle's is a fresh one-logit head on the
backbone, so it is loaded, sharded and scored by the same code as the reward model and the critic.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from treadle.trainer.checkpoint.checkpointer import TrainState
from treadle.trainer.checkpoint.export import full_state_dict, save_reward_model
from treadle.trainer.config.prm import PRMConfig
from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.data.samples import Sample
from treadle.trainer.data.steps import step_samples
from treadle.trainer.losses.prm import step_accuracy, step_bce_loss
from treadle.trainer.models.reward_model import ProcessRewardModel
from treadle.trainer.models.value_model import token_values
from treadle.trainer.trainers import build
from treadle.trainer.trainers.base import Parts, SupervisedTrainer


class PRMTrainer(SupervisedTrainer):
    """Per-step binary cross-entropy on the step logits."""

    def __init__(self, parts: Parts, *, step_marker: str) -> None:
        super().__init__(parts)
        self.step_marker = step_marker

    def unit(self, sample: Sample) -> float:
        return float(len(sample.step_labels))

    def _per_step(self, batch: SeqBatch, group: Sequence[Sample]) -> tuple[Tensor, Tensor, Tensor]:
        """(losses [K], accuracies [K], logits [K]) of the micro-batch's steps, in sample order."""
        logits = ProcessRewardModel.step_logits(token_values(self.engine, batch, self.ring), batch)
        labels = torch.tensor([y for s in group for y in s.step_labels], dtype=torch.float32, device=logits.device)
        if labels.shape != logits.shape:  # the samples' labels and target tokens are made together (data.steps)
            raise RuntimeError(f"{labels.numel()} step labels for {logits.numel()} step tokens")
        return step_bce_loss(logits, labels), step_accuracy(logits.detach(), labels), logits

    def micro_loss(self, batch: SeqBatch, group: Sequence[Sample], normaliser: float) -> tuple[Tensor, dict[str, Tensor]]:
        losses, acc, logits = self._per_step(batch, group)
        stats = {"loss": losses.sum(), "acc": acc.sum(), "step_prob": torch.sigmoid(logits).sum()}
        return losses.sum() / normaliser, {k: v.detach() for k, v in stats.items()}

    def eval_sums(self, batch: SeqBatch, group: Sequence[Sample]) -> dict[str, Tensor]:
        losses, acc, _ = self._per_step(batch, group)
        counts = torch.tensor([len(s.step_labels) for s in group], device=losses.device)
        w = batch.sample_weight.repeat_interleave(counts)  # filler samples weigh 0
        return {"loss": (losses * w).sum(), "acc": (acc * w).sum(), "_n": w.sum()}

    def export(self, out: Path) -> None:
        state = full_state_dict(self.engine, zero_stage=self.p.zero_stage, is_main=self.dist.is_main)
        if self.dist.is_main:
            module = self.engine.module
            module.config.step_separator = self.step_marker  # what PPO's PRM scoring looks for
            save_reward_model(state, module.config, self.p.tokenizer, out, head_prefix=module.head_prefix)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


def build_trainer(cfg: PRMConfig) -> PRMTrainer:
    data = cfg.data
    dist = build.start(cfg, ring_supported=True)
    ring = build.ring_group(cfg, dist)
    tok, fmt = build.tokenizer_and_formatter(cfg)
    train, evaluation = build.datasets(cfg, lambda rows: step_samples(
        rows, fmt, max_len=data.max_len, prompt_key=data.prompt_key, completions_key=data.completions_key,
        input_key=data.input_key, label_key=data.label_key, step_separator=data.step_separator,
        placeholder_token=data.placeholder_token, reward_tokens=data.reward_tokens), dist, tok)
    model = ProcessRewardModel.from_pretrained(cfg.actor.model_name_or_path, cfg.ds,
                                               gradient_checkpointing=cfg.actor.gradient_checkpointing_enable,
                                               reentrant=cfg.actor.gradient_checkpointing_reentrant)
    engine, order = build.engine(model, cfg, dist, len(train), ring)
    parts = Parts(dist=dist, engine=engine, tokenizer=tok, train_set=train, eval_set=evaluation, order=order,
                  checkpointer=build.checkpointer(cfg, dist), metrics=build.metrics_logger(cfg, dist, "prm"),
                  loop=build.loop_config(cfg, "eval_loss"), zero_stage=cfg.ds.zero_stage, ring=ring)
    return PRMTrainer(parts, step_marker=data.step_marker)


def run(cfg: PRMConfig) -> TrainState:
    trainer = build_trainer(cfg)
    try:
        return trainer.fit(resume=cfg.ckpt.load_enable)
    finally:
        trainer.close()
