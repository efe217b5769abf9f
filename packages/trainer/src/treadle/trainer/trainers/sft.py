"""Supervised fine-tuning (and continued pre-training): next-token loss on the target tokens.

Targets are the answer tokens (``--data.output_key``), the assistant turns of a conversation
(``--data.apply_chat_template``; only the last one unless ``--data.multiturn``), or every token
(``--actor.pretrain_mode_enable``). The loss is the token mean over the whole optimizer step, or
with ``--actor.loss_agg_mode seq-mean-token-mean`` the mean over the step's sequences of each
one's token mean (``losses.sft``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from treadle.common.config import ConfigError
from treadle.trainer.checkpoint.checkpointer import TrainState
from treadle.trainer.checkpoint.export import full_state_dict, lora_adapter, save_causal_lm
from treadle.trainer.config.commands import SFTConfig
from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.data.formatting import sft_samples
from treadle.trainer.data.samples import Sample
from treadle.trainer.losses.sft import nll_loss, nll_loss_seq_mean
from treadle.trainer.models.actor import Actor
from treadle.trainer.models.loading import load_causal_lm
from treadle.trainer.ops.logprobs import sequence_sums
from treadle.trainer.trainers import build
from treadle.trainer.trainers.base import Parts, SupervisedTrainer


def export_causal_lm(trainer: SupervisedTrainer, out: Path) -> None:
    """Collective HF export of a trained causal LM (shared by SFT, DPO and KTO)."""
    state = full_state_dict(trainer.engine, zero_stage=trainer.p.zero_stage, is_main=trainer.dist.is_main)
    adapter = lora_adapter(trainer.engine, zero_stage=trainer.p.zero_stage, is_main=trainer.dist.is_main)
    if trainer.dist.is_main:
        module = trainer.engine.module
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        save_causal_lm(state, base.config, trainer.p.tokenizer, out, adapter=adapter)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


class SFTTrainer(SupervisedTrainer):
    """Negative log-likelihood of the target tokens: token mean, or (``seq_mean``) sequence mean of token means."""

    def __init__(self, parts: Parts, *, seq_mean: bool = False) -> None:
        super().__init__(parts)
        self.actor = Actor(self.engine, ring=parts.ring)
        self.seq_mean = seq_mean

    def unit(self, sample: Sample) -> float:
        if self.seq_mean:
            return float(sample.num_targets > 0)
        return sample.num_targets

    def micro_loss(self, batch: SeqBatch, group: Sequence[Sample], normaliser: float) -> tuple[Tensor, dict[str, Tensor]]:
        out = self.actor(batch, targets_only=True)
        if self.seq_mean:
            loss = nll_loss_seq_mean(out.logprobs, batch.target_mask, batch.seq_index, batch.num_seqs, normaliser)
        else:
            loss = nll_loss(out.logprobs, batch.target_mask, normaliser)
        return loss, {"loss": loss.detach() * normaliser}

    def eval_sums(self, batch: SeqBatch, group: Sequence[Sample]) -> dict[str, Tensor]:
        out = self.actor(batch, targets_only=True)
        nll = sequence_sums(-out.logprobs, batch.target_mask, batch.seq_index, batch.num_seqs)
        count = sequence_sums(torch.ones_like(out.logprobs), batch.target_mask, batch.seq_index, batch.num_seqs)
        return {"loss": (nll * batch.sample_weight).sum(), "_n": (count * batch.sample_weight).sum()}

    def export(self, out: Path) -> None:
        export_causal_lm(self, out)


def build_trainer(cfg: SFTConfig) -> SFTTrainer:
    """Everything an SFT run needs, on this rank."""
    data = cfg.data
    if data.output_key is None and not data.apply_chat_template and not cfg.actor.pretrain_mode_enable:
        raise ConfigError("nothing to learn: set --data.output_key, --data.apply_chat_template "
                          "(conversations) or --actor.pretrain_mode_enable")
    dist = build.start(cfg, ring_supported=True, tp_supported=True)
    ring = build.ring_group(cfg, dist)
    dp = build.data_parallel_view(cfg, dist, ring)
    tok, fmt = build.tokenizer_and_formatter(cfg)
    train, evaluation = build.datasets(cfg, lambda rows: sft_samples(
        rows, fmt, input_key=data.input_key, output_key=data.output_key, multiturn=data.multiturn,
        pretrain=cfg.actor.pretrain_mode_enable, max_len=data.max_len), dist, tok)
    model = load_causal_lm(cfg.actor.model_name_or_path, cfg.ds, trainable=True,
                           gradient_checkpointing=cfg.actor.gradient_checkpointing_enable,
                           reentrant=cfg.actor.gradient_checkpointing_reentrant)
    engine, order = build.engine(model, cfg, dist, len(train), ring, dp)
    parts = Parts(dist=dist, engine=engine, tokenizer=tok, train_set=train, eval_set=evaluation, order=order,
                  checkpointer=build.checkpointer(cfg, dist), metrics=build.metrics_logger(cfg, dist, "sft"),
                  loop=build.loop_config(cfg, "eval_loss"), zero_stage=cfg.ds.zero_stage, ring=ring, dp=dp)
    return SFTTrainer(parts, seq_mean=cfg.actor.loss_agg_mode == "seq-mean-token-mean")


def run(cfg: SFTConfig) -> TrainState:
    trainer = build_trainer(cfg)
    try:
        return trainer.fit(resume=cfg.ckpt.load_enable)
    finally:
        trainer.close()
