"""Set-up shared by the recipes: process group, seeds, tokenizer, datasets, engine, logger.

Each function builds one thing from the typed config; the recipes' ``run`` functions call them
in order and hand the results to their trainer. One rank per host tokenises the datasets and
the others read its cache file (``datasets``).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from treadle.common.config import ConfigError, dump_yaml, to_dict
from treadle.common.log import get_logger
from treadle.common.metrics import MetricsLogger
from treadle.trainer.checkpoint.checkpointer import Checkpointer
from treadle.trainer.config.data import check_mixture, split_list
from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.data import cache
from treadle.trainer.data.formatting import Formatter
from treadle.trainer.data.order import StepOrder
from treadle.trainer.data.samples import Sample
from treadle.trainer.data.sources import DataError, Row, data_files, load_mixture
from treadle.trainer.models.loading import check_liger, load_causal_lm, load_tokenizer
from treadle.trainer.models.reference import Reference
from treadle.trainer.ring.attention import check_head_stride
from treadle.trainer.ring.group import (
    DataParallel,
    RingGroup,
    data_parallel,
    setup_ring,
    tensor_parallel_slots,
)
from treadle.trainer.strategy.deepspeed import (
    DistInfo,
    all_reduce,
    build_engine,
    build_frozen_engine,
    grad_accum_steps,
    init_distributed,
)
from treadle.trainer.trainers.base import LoopConfig

log = get_logger(__name__)
Tokenise = Callable[[list[Row]], tuple[list[Sample], int]]


def _refuse_unavailable(cfg: Any, *, ring_supported: bool, sleep_supported: bool = False,
                        tp_supported: bool = False) -> None:
    """Flags this trainer does not implement yet are errors, not silently ignored."""
    unavailable = {
        "--ds.ring_attn_size > 1 (ring attention)": cfg.ds.ring_attn_size > 1 and not ring_supported,
        "--ds.tensor_parallel_size > 1 (AutoTP)": cfg.ds.tensor_parallel_size > 1 and not tp_supported,
        "--ds.use_universal_ckpt": cfg.ds.use_universal_ckpt,
        "--ds.enable_sleep": cfg.ds.enable_sleep and not sleep_supported,
        "--actor.aux_loss_coef > 0 (MoE load balancing)": cfg.actor.aux_loss_coef > 0,
    }
    used = [flag for flag, on in unavailable.items() if on]
    if used:
        raise ConfigError(f"{', '.join(used)}: not available in this trainer yet")


def model_paths(cfg: Any) -> list[str]:
    """Every model folder the flags name (``--<section>.*model_name_or_path``: actor, reference,
    critic, reward, PRM, teacher), in section order; pure."""
    paths: list[str] = []
    for top in dataclasses.fields(cfg):
        section = getattr(cfg, top.name)
        for f in dataclasses.fields(section) if dataclasses.is_dataclass(section) else ():
            value = getattr(section, f.name)
            if f.name.endswith("model_name_or_path") and isinstance(value, str) and value and value not in paths:
                paths.append(value)
    return paths


def missing_packages(cfg: Any, find: Callable[[str], Any] = importlib.util.find_spec) -> list[str]:
    """What this run will import and is not installed, as ``"what needs it: pip install ..."`` lines
    (pure but for ``find``): matplotlib for the curves every run draws at its end, tensorboard and
    wandb when their flags ask for them. Checked at start, so a run from wheels does not train for
    hours and then fail."""
    needs = [("matplotlib", "the curves every run draws (curves.png)", "treadle-trainer[train]")]
    if cfg.logger.tensorboard_dir:
        needs.append(("tensorboard", "--logger.tensorboard_dir", "treadle-trainer[tensorboard]"))
    if cfg.logger.wandb.key:
        needs.append(("wandb", "--logger.wandb.key", "treadle-trainer[wandb]"))
    return [f"{why} needs {module}: pip install '{extra}'" for module, why, extra in needs if find(module) is None]


def start(cfg: Any, *, ring_supported: bool = False, sleep_supported: bool = False,
          tp_supported: bool = False) -> DistInfo:
    """Join the process group and seed torch (identically on every rank: heads start equal).

    ``ring_supported``: the recipe runs ring attention (``ring_group`` then sets it up); others
    refuse ``--ds.ring_attn_size > 1``. ``tp_supported``: likewise for AutoTP
    (``data_parallel_view``, ``--ds.tensor_parallel_size > 1``).
    """
    _refuse_unavailable(cfg, ring_supported=ring_supported, sleep_supported=sleep_supported,
                        tp_supported=tp_supported)
    if missing := missing_packages(cfg):
        raise ConfigError("; ".join(missing))
    if cfg.ds.use_liger_kernel:
        check_liger(model_paths(cfg))
    if cfg.ds.ring_attn_size > 1 and cfg.ds.ring_attn_head_stride > 1:
        check_head_stride(cfg.ds.ring_attn_head_stride, model_paths(cfg))
    dist = init_distributed(launched_by_deepspeed=cfg.local_rank >= 0)
    torch.manual_seed(cfg.train.seed)
    if cfg.train.full_determinism_enable:
        torch.use_deterministic_algorithms(True, warn_only=True)
    return dist


def ring_group(cfg: Any, dist: DistInfo) -> RingGroup | None:
    """This rank's ring of ``--ds.ring_attn_size`` ranks (collective; None without ring attention)."""
    return setup_ring(cfg.ds.ring_attn_size, cfg.ds.ring_attn_head_stride, dist)


def tokenizer_and_formatter(cfg: Any) -> tuple[Any, Formatter]:
    """The tokenizer, and the formatter that tokenises rows in ``--data.dataloader_num_workers``
    processes (``data.workers``)."""
    data = cfg.data
    tok = load_tokenizer(cfg.actor.model_name_or_path, use_fast=not data.disable_fast_tokenizer,
                         chat_template=data.tokenizer_chat_template)
    return tok, Formatter(tok, input_template=data.input_template, apply_chat_template=data.apply_chat_template,
                          workers=data.dataloader_num_workers)


def datasets(cfg: Any, tokenise: Tokenise, dist: DistInfo, tokenizer: Any) -> tuple[list[Sample], list[Sample]]:
    """(training samples, evaluation samples) of ``cfg.data`` / ``cfg.eval``, tokenised once per host.

    Local rank 0 tokenises (in ``--data.dataloader_num_workers`` processes, with a progress bar)
    and writes ``<ckpt.path>/data_cache/<fingerprint>.npz``
    (``data.cache``; a file an earlier run left with the same fingerprint is reused instead);
    the other ranks wait for it and read it. Every rank ends with identical samples. The wait is
    an all-reduce of the writer's outcome, so a failure there (a malformed row) is raised on the
    writer and reported on the others instead of leaving them waiting.
    """
    path = Path(cfg.ckpt.path) / "data_cache" / f"{data_fingerprint(cfg, tokenizer)}.npz"
    error, made = None, None
    if dist.local_rank == 0 and not path.is_file():
        try:
            made = tokenise_all(cfg, tokenise)
            cache.save(path, {"train": made[0], "eval": made[1]}, made[2])
        except Exception as e:  # noqa: BLE001  (re-raised below, after the other ranks learn of it)
            error = e
    failed = all_reduce([float(error is not None)], dist.device, op="max")[0]
    if error is not None:
        raise error
    if failed:
        raise DataError(f"tokenising the data failed on another rank (its error says why); cache {path}")
    if made is None:
        splits, dropped = cache.load(path)
        made = (splits["train"], splits["eval"], dropped)
    train, evaluation, dropped = made
    if dist.is_main:
        log.info("data", extra={"fields": {"train": len(train), "dropped": dropped, "eval": len(evaluation),
                                           "cache": str(path)}})
    return train, evaluation


def tokenise_all(cfg: Any, tokenise: Tokenise) -> tuple[list[Sample], list[Sample], int]:
    """(training samples, evaluation samples, dropped training rows): load, mix and tokenise."""
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
    return train, evaluation, dropped


def data_fingerprint(cfg: Any, tokenizer: Any) -> str:
    """``data.cache.fingerprint`` of what ``tokenise_all`` reads: files, tokenizer, data settings
    (not the worker count: any count makes the same samples)."""
    data = cfg.data
    specs = [(s, data.dataset_split) for s in split_list(data.dataset)]
    specs += [(s, cfg.eval.split) for s in split_list(cfg.eval.dataset or "")]
    stamps = [cache.file_stamp(spec, data_files(spec, split)) for spec, split in specs]
    data_settings = {k: v for k, v in to_dict(data, redact=True).items() if k != "dataloader_num_workers"}
    settings = {"recipe": type(cfg).__name__, "data": data_settings, "seed": cfg.train.seed,
                "eval": [cfg.eval.dataset, cfg.eval.split],
                "pretrain": getattr(cfg.actor, "pretrain_mode_enable", False)}
    return cache.fingerprint(settings=settings, tokenizer=tokenizer, stamps=stamps)


def data_parallel_view(cfg: Any, dist: DistInfo, ring: RingGroup | None) -> DataParallel:
    """This rank's data-parallel slot: under AutoTP a tensor-parallel group's (collective), under
    ring attention a ring's, else the rank's own."""
    if cfg.ds.tensor_parallel_size > 1:
        return tensor_parallel_slots(cfg.ds.tensor_parallel_size, dist)
    return data_parallel(dist, ring)


def engine(model: torch.nn.Module, cfg: Any, dist: DistInfo, num_samples: int,
           ring: RingGroup | None = None, dp: DataParallel | None = None) -> tuple[Any, StepOrder]:
    """(DeepSpeed engine, sample order) for ``model`` trained on ``num_samples`` samples.

    Samples are shared among the data-parallel slots ``dp`` (default: from ``ring``; a ring's or
    a tensor-parallel group's ranks share theirs); the engine spans every rank (``ring.group``
    says why).
    """
    train = cfg.train
    dp = dp or data_parallel(dist, ring)
    order = StepOrder(num_samples=num_samples, batch_size=train.batch_size, world=dp.world, seed=train.seed)
    gas = grad_accum_steps(train.batch_size, train.micro_batch_size, dp.world)
    total = order.steps_per_epoch * train.max_epochs
    eng = build_engine(model, cfg.ds, cfg, micro_batch=train.micro_batch_size, grad_accum=gas, world=dist.world,
                       total_steps=total)
    return eng, order


def reference(path: str, ds: DeepSpeedConfig, dist: DistInfo, *, offload: bool,
              ring: RingGroup | None = None) -> Reference:
    """The frozen reference policy, placed like the trained model: sharded by ZeRO-3 (``--ref.offload``:
    parameter shards in CPU memory) when ``--ds.zero_stage 3``, else a replica on every rank
    (``--ref.offload``: kept in CPU memory between uses). Collective under ZeRO-3."""
    module = load_causal_lm(path, ds, trainable=False)
    if ds.zero_stage != 3:
        return Reference(module, dist.device, offload=offload, ring=ring)
    engine = build_frozen_engine(module, ds, offload=offload, world=dist.world)
    return Reference(engine, dist.device, ring=ring, sharded=True)


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
    run = wandb_run(cfg, recipe, root) if cfg.logger.wandb.key else None
    return MetricsLogger(root / "metrics.jsonl", wandb_run=run, tensorboard_dir=cfg.logger.tensorboard_dir)


def wandb_run(cfg: Any, recipe: str, root: Path) -> Any:
    """A W&B run for ``--logger.wandb.*``, its files under ``<ckpt.path>/wandb`` next to metrics.jsonl.

    The config is logged with secrets (the API key) nulled. ``WANDB_MODE=offline`` (wandb's own
    variable) keeps the run on disk for a later ``wandb sync``: machines without network work too.
    """
    try:
        import wandb  # noqa: PLC0415
    except ImportError:
        raise ConfigError("--logger.wandb.key is set but the wandb package is not installed "
                          "(pip install 'treadle-trainer[wandb]')") from None
    wb = cfg.logger.wandb
    wandb.login(key=wb.key)
    name = wb.run_name or f"{recipe}_{datetime.datetime.now():%m%dT%H:%M}"
    return wandb.init(entity=wb.org, project=wb.project, group=wb.group, name=name, dir=str(root),
                      config=to_dict(cfg, redact=True), reinit="finish_previous")
