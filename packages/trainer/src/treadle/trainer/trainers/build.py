"""Set-up shared by the recipes: process group, seeds, tokenizer, datasets, engine, logger.

Each function builds one thing from the typed config; the recipes' ``run`` functions call them
in order and hand the results to their trainer. Every rank loads and tokenises the whole
dataset (deterministically), so no rank waits for another to share it.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from treadle.common.config import ConfigError, dump_yaml
from treadle.common.log import get_logger
from treadle.common.metrics import MetricsLogger
from treadle.trainer.checkpoint.checkpointer import Checkpointer
from treadle.trainer.config.data import check_mixture, split_list
from treadle.trainer.data.formatting import Formatter
from treadle.trainer.data.order import StepOrder
from treadle.trainer.data.samples import Sample
from treadle.trainer.data.sources import DataError, Row, load_mixture
from treadle.trainer.models.loading import load_tokenizer
from treadle.trainer.ring.group import RingGroup, data_parallel, setup_ring
from treadle.trainer.strategy.deepspeed import (
    DistInfo,
    build_engine,
    grad_accum_steps,
    init_distributed,
)
from treadle.trainer.trainers.base import LoopConfig

log = get_logger(__name__)
Tokenise = Callable[[list[Row]], tuple[list[Sample], int]]


def _refuse_unavailable(cfg: Any, *, ring_supported: bool, sleep_supported: bool = False) -> None:
    """Flags this trainer does not implement yet are errors, not silently ignored."""
    unavailable = {
        "--ds.ring_attn_size > 1 (ring attention)": cfg.ds.ring_attn_size > 1 and not ring_supported,
        "--ds.use_liger_kernel": cfg.ds.use_liger_kernel,
        "--ds.use_universal_ckpt": cfg.ds.use_universal_ckpt,
        "--ds.enable_sleep": cfg.ds.enable_sleep and not sleep_supported,
        "--actor.aux_loss_coef > 0 (MoE load balancing)": cfg.actor.aux_loss_coef > 0,
    }
    used = [flag for flag, on in unavailable.items() if on]
    if used:
        raise ConfigError(f"{', '.join(used)}: not available in this trainer yet")


def start(cfg: Any, *, ring_supported: bool = False, sleep_supported: bool = False) -> DistInfo:
    """Join the process group and seed torch (identically on every rank: heads start equal).

    ``ring_supported``: the recipe runs ring attention (``ring_group`` then sets it up); others
    refuse ``--ds.ring_attn_size > 1``.
    """
    _refuse_unavailable(cfg, ring_supported=ring_supported, sleep_supported=sleep_supported)
    dist = init_distributed(launched_by_deepspeed=cfg.local_rank >= 0)
    if cfg.data.dataloader_num_workers and dist.is_main:
        log.warning("--data.dataloader_num_workers has no effect: samples are tokenised in memory before training")
    torch.manual_seed(cfg.train.seed)
    if cfg.train.full_determinism_enable:
        torch.use_deterministic_algorithms(True, warn_only=True)
    return dist


def ring_group(cfg: Any, dist: DistInfo) -> RingGroup | None:
    """This rank's ring of ``--ds.ring_attn_size`` ranks (collective; None without ring attention)."""
    return setup_ring(cfg.ds.ring_attn_size, cfg.ds.ring_attn_head_stride, dist)


def tokenizer_and_formatter(cfg: Any) -> tuple[Any, Formatter]:
    data = cfg.data
    tok = load_tokenizer(cfg.actor.model_name_or_path, use_fast=not data.disable_fast_tokenizer,
                         chat_template=data.tokenizer_chat_template)
    return tok, Formatter(tok, input_template=data.input_template, apply_chat_template=data.apply_chat_template)


def datasets(cfg: Any, tokenise: Tokenise, dist: DistInfo) -> tuple[list[Sample], list[Sample]]:
    """(training samples, evaluation samples) of ``cfg.data`` / ``cfg.eval``."""
    data = cfg.data
    probs = check_mixture("--data.dataset", data.dataset, "--data.dataset_probs", data.dataset_probs)
    rows = load_mixture(split_list(data.dataset), probs, data.dataset_split, data.max_samples, cfg.train.seed)
    train, dropped = tokenise(rows)
    evaluation: list[Sample] = []
    if cfg.eval.dataset:
        names = split_list(cfg.eval.dataset)
        eval_rows = load_mixture(names, [1.0 / len(names)] * len(names), cfg.eval.split, 1 << 62, cfg.train.seed)
        evaluation, _ = tokenise(eval_rows)
        if not evaluation:
            raise DataError(f"--eval.dataset {cfg.eval.dataset}: no usable rows")
    if dist.is_main:
        log.info("data", extra={"fields": {"train": len(train), "dropped": dropped, "eval": len(evaluation)}})
    return train, evaluation


def engine(model: torch.nn.Module, cfg: Any, dist: DistInfo, num_samples: int,
           ring: RingGroup | None = None) -> tuple[Any, StepOrder]:
    """(DeepSpeed engine, sample order) for ``model`` trained on ``num_samples`` samples.

    Samples are shared among the data-parallel slots (a ring's ranks share theirs); the engine
    spans every rank (``ring.group`` says why).
    """
    train = cfg.train
    dp = data_parallel(dist, ring)
    order = StepOrder(num_samples=num_samples, batch_size=train.batch_size, world=dp.world, seed=train.seed)
    gas = grad_accum_steps(train.batch_size, train.micro_batch_size, dp.world)
    total = order.steps_per_epoch * train.max_epochs
    eng = build_engine(model, cfg.ds, cfg, micro_batch=train.micro_batch_size, grad_accum=gas, world=dist.world,
                       total_steps=total)
    return eng, order


def loop_config(cfg: Any, default_best: str) -> LoopConfig:
    key = cfg.ckpt.best_metric_key
    best = None if key == "none" or not cfg.eval.dataset else (key or default_best)
    return LoopConfig(
        max_epochs=cfg.train.max_epochs, micro_batch=cfg.train.micro_batch_size,
        token_budget=cfg.train.max_tokens_per_gpu if cfg.train.dynamic_batch_enable else None,
        packing=cfg.ds.packing_samples, eval_steps=cfg.eval.steps, save_steps=cfg.ckpt.save_steps,
        logging_steps=cfg.logger.logging_steps, best_key=best, save_hf=cfg.ckpt.save_hf,
        output_dir=Path(cfg.ckpt.output_dir))


def checkpointer(cfg: Any, dist: DistInfo) -> Checkpointer:
    return Checkpointer(cfg.ckpt, dist)


def metrics_logger(cfg: Any, dist: DistInfo, recipe: str) -> MetricsLogger | None:
    """Rank 0's metrics log (``<ckpt.path>/metrics.jsonl``, + W&B / TensorBoard when asked); also
    writes the resolved config next to it."""
    if not dist.is_main:
        return None
    root = Path(cfg.ckpt.path)
    root.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, root / "config.yaml")
    run = None
    wb = cfg.logger.wandb
    if wb.key:
        try:
            import wandb  # noqa: PLC0415
        except ImportError:
            raise ConfigError("--logger.wandb.key is set but the wandb package is not installed") from None
        wandb.login(key=wb.key)
        name = wb.run_name or f"{recipe}_{datetime.datetime.now():%m%dT%H:%M}"
        run = wandb.init(entity=wb.org, project=wb.project, group=wb.group, name=name, reinit=True)
    return MetricsLogger(root / "metrics.jsonl", wandb_run=run, tensorboard_dir=cfg.logger.tensorboard_dir)
