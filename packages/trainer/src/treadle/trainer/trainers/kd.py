"""Offline knowledge distillation (``treadle-train kd``): SFT on the rows, plus a frozen teacher's
next-token distributions as soft labels.

OpenRLHF's ``train_kd`` / ``KDTrainer``: at the target tokens (the answers, or the assistant
turns) L = (1 - kd_coef) * NLL + kd_coef * KD, KD being ``losses.kd.kd_loss`` (the cross-entropy
to the teacher's softmax). Token mean over the optimizer step like SFT (``losses.sft``). The
teacher is placed like DPO's reference (``build.reference``: a replica, or sharded by ZeRO-3;
``--teacher.offload``), in eval mode, without gradients. The student's and the teacher's logits
at the target tokens are materialised in full ([K, V] each): no ring attention, no AutoTP
(refused at parse time), and no temperature (OpenRLHF has none). Logged: ``loss`` (the mix),
``nll``, ``kd`` and ``kl`` (KL(teacher || student) per target token, ``losses.kd.kd_kl``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from treadle.common.config import ConfigError
from treadle.trainer.checkpoint.checkpointer import TrainState
from treadle.trainer.config.kd import KDConfig
from treadle.trainer.data.batching import SeqBatch
from treadle.trainer.data.formatting import sft_samples
from treadle.trainer.data.samples import Sample
from treadle.trainer.losses.kd import kd_kl, kd_loss, mixed_kd_loss
from treadle.trainer.losses.sft import nll_loss
from treadle.trainer.models.actor import target_logits
from treadle.trainer.models.loading import load_causal_lm
from treadle.trainer.models.reference import Reference
from treadle.trainer.trainers import build
from treadle.trainer.trainers.base import Parts, SupervisedTrainer
from treadle.trainer.trainers.sft import export_causal_lm


def target_logprobs(logits: Tensor, batch: SeqBatch) -> Tensor:
    """``[K]`` fp32 log-softmax of ``logits`` ``[K, V]`` at the target tokens they predict (same order)."""
    targets = batch.input_ids[batch.target_mask.bool()]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


class KDTrainer(SupervisedTrainer):
    """SFT's token-mean NLL mixed with the cross-entropy to a frozen teacher's distributions."""

    def __init__(self, parts: Parts, teacher: Reference, *, kd_coef: float) -> None:
        super().__init__(parts)
        self.teacher = teacher
        self.kd_coef = kd_coef

    def unit(self, sample: Sample) -> float:
        return sample.num_targets

    def _terms(self, batch: SeqBatch, num_tokens: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        student = target_logits(self.engine, batch)  # [K, V]
        teacher = self.teacher.target_logits(batch)
        logp = target_logprobs(student, batch)
        nll = nll_loss(logp, torch.ones_like(logp, dtype=torch.bool), num_tokens)
        kd = kd_loss(student, teacher, num_tokens)
        return mixed_kd_loss(nll, kd, self.kd_coef), nll, kd, kd_kl(student.detach(), teacher).sum()

    def micro_loss(self, batch: SeqBatch, group: Sequence[Sample], normaliser: float) -> tuple[Tensor, dict[str, Tensor]]:
        loss, nll, kd, kl = self._terms(batch, normaliser)
        stats = {"loss": loss.detach() * normaliser, "nll": nll.detach() * normaliser,
                 "kd": kd.detach() * normaliser, "kl": kl}
        return loss, stats

    def eval_sums(self, batch: SeqBatch, group: Sequence[Sample]) -> dict[str, Tensor]:
        # token sums weighted like SFT's evaluation (filler samples weigh 0)
        weight = batch.sample_weight[batch.seq_index[batch.target_mask.bool()]]
        student = target_logits(self.engine, batch)
        teacher = self.teacher.target_logits(batch)
        logp = target_logprobs(student, batch)
        kd = -(torch.softmax(teacher.float(), -1) * torch.log_softmax(student.float(), -1)).sum(-1)
        nll = -logp
        return {"loss": (weight * mixed_kd_loss(nll, kd, self.kd_coef)).sum(), "nll": (weight * nll).sum(),
                "kl": (weight * kd_kl(student, teacher)).sum(), "_n": weight.sum()}

    def export(self, out: Path) -> None:
        export_causal_lm(self, out)

    def close(self, *, plot: bool = True) -> None:
        self.teacher.close()
        super().close(plot=plot)


def check_vocabularies(student: str, teacher: str) -> None:
    """Refuse a teacher whose logits do not index the student's vocabulary (read from the configs, before any weights load)."""
    from transformers import AutoConfig  # noqa: PLC0415

    sizes = [AutoConfig.from_pretrained(path).get_text_config().vocab_size for path in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise ConfigError(f"--teacher.model_name_or_path {teacher}: vocabulary of {sizes[1]} tokens, the student "
                          f"({student}) has {sizes[0]}; distillation compares their logits token by token")


def build_trainer(cfg: KDConfig) -> KDTrainer:
    """Everything a distillation run needs, on this rank."""
    data = cfg.data
    check_vocabularies(cfg.actor.model_name_or_path, cfg.teacher.model_name_or_path)
    dist = build.start(cfg)
    tok, fmt = build.tokenizer_and_formatter(cfg)
    train, evaluation = build.datasets(cfg, lambda rows: sft_samples(
        rows, fmt, input_key=data.input_key, output_key=data.output_key, multiturn=data.multiturn,
        pretrain=False, max_len=data.max_len), dist, tok)
    teacher = build.reference(cfg.teacher.model_name_or_path, cfg.ds, dist, offload=cfg.teacher.offload)
    model = load_causal_lm(cfg.actor.model_name_or_path, cfg.ds, trainable=True,
                           gradient_checkpointing=cfg.actor.gradient_checkpointing_enable,
                           reentrant=cfg.actor.gradient_checkpointing_reentrant)
    dp = build.data_parallel_view(cfg, dist, None)
    engine, order = build.engine(model, cfg, dist, len(train), None, dp)
    parts = Parts(dist=dist, engine=engine, tokenizer=tok, train_set=train, eval_set=evaluation, order=order,
                  checkpointer=build.checkpointer(cfg, dist), metrics=build.metrics_logger(cfg, dist, "kd"),
                  loop=build.loop_config(cfg, "eval_loss"), zero_stage=cfg.ds.zero_stage, dp=dp)
    return KDTrainer(parts, teacher, kd_coef=cfg.teacher.kd_coef)


def run(cfg: KDConfig) -> TrainState:
    trainer = build_trainer(cfg)
    try:
        return trainer.fit(resume=cfg.ckpt.load_enable)
    finally:
        trainer.close()
