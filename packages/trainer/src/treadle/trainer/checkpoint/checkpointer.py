"""Resumable training checkpoints: DeepSpeed state, RNG, data position; atomic; pruned.

Layout under ``--ckpt.path``::

    step_00000040/        one complete checkpoint (published atomically, see ``atomic``)
        ds/               DeepSpeed engine state: weights, optimizer, LR schedule (one shard per rank)
        rng_rank0.safetensors ...   each rank's torch RNG states
        ema_rank0.safetensors ...   each rank's slices of the actor's EMA (PPO, --train.enable_ema)
        state.json        TrainState: steps done, epoch and step within it, best metric
        hf/               HF-format weights, when --ckpt.save_hf
    .tmp-step_00000048/   a save in progress (or killed): ignored, removed by the next save

``latest()`` returns the newest complete checkpoint; a resumed run loads it and continues with
the same sample order (``data.order``). After each save the oldest checkpoints beyond
``--ckpt.max_num`` (or ``--ckpt.max_mem`` GB) are deleted, except the best one by the eval
metric. The folder must be shared by all ranks (one host, or a shared filesystem).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treadle.trainer.checkpoint.atomic import TMP_PREFIX, clean_leftovers, publish
from treadle.trainer.config.ckpt import CheckpointConfig
from treadle.trainer.strategy.deepspeed import DistInfo

STATE_FILE = "state.json"
EXTRA_FILE = "extra.json"
DS_TAG = "ds"
CRITIC_TAG = "critic"
"""PPO's critic's DeepSpeed state beside the actor's (trained in the ranks or by a critic server)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainState:
    """Where training stands; saved with every checkpoint."""

    global_step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Epoch of the next step."""
    step_in_epoch: int = 0
    """Steps done within ``epoch``."""
    best_metric: float | None = None
    """Best value of the best-checkpoint metric so far."""
    best_step: int | None = None
    """Step whose checkpoint holds ``best_metric``."""

    def advanced(self, steps_per_epoch: int) -> TrainState:
        """The state after one more optimizer step."""
        epoch, step = self.epoch, self.step_in_epoch + 1
        if step == steps_per_epoch:
            epoch, step = epoch + 1, 0
        return dataclasses.replace(self, global_step=self.global_step + 1, epoch=epoch, step_in_epoch=step)


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Checkpointer:
    """Saves and finds resumable checkpoints of one run."""

    def __init__(self, cfg: CheckpointConfig, dist: DistInfo) -> None:
        self.cfg = cfg
        self.dist = dist
        self.root = Path(cfg.path)
        if dist.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            clean_leftovers(self.root)
        _barrier()

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (a folder counts once its state file is in place)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: int(p.name.split("_")[1]))

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        done = self.complete()
        return done[-1] if done else None

    def save(self, engine: Any, state: TrainState, *, write_hf: Callable[[Path], None] | None = None,
             more_engines: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
             write_more: Callable[[Path], None] | None = None) -> Path:
        """Save ``engine`` and ``state`` as ``step_<global_step>``; every rank must call it.

        ``more_engines``: further DeepSpeed engines by tag (PPO's critic); ``extra``: JSON-able
        recipe state saved beside ``state.json`` (``read_extra``); ``write_more``: called on every
        rank with the folder being written, for recipe files of its own (PPO's EMA slices)."""
        final = _step_dir(self.root, state.global_step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        if not self.cfg.disable_ds:
            engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=False)
            for tag, other in (more_engines or {}).items():
                other.save_checkpoint(str(tmp), tag=tag, save_latest=False)
        self._save_rng(tmp)
        if write_more is not None:
            write_more(tmp)
        if write_hf is not None:
            write_hf(tmp / "hf")  # collective: all ranks gather, rank 0 writes
        _barrier()
        if self.dist.is_main:
            if extra is not None:
                (tmp / EXTRA_FILE).write_text(json.dumps(extra, indent=1))
            (tmp / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=1))
            publish(tmp, final)
            self.prune(state.best_step)
        _barrier()
        return final

    def load(self, engine: Any, path: Path, *, more_engines: dict[str, Any] | None = None) -> TrainState:
        """Restore ``engine`` (and ``more_engines`` by tag: weights, optimizer, schedule) and this
        rank's RNG from ``path``."""
        for tag, eng in ((DS_TAG, engine), *(more_engines or {}).items()):
            if not (path / tag).is_dir():
                raise FileNotFoundError(f"{path} has no DeepSpeed state {tag!r} (saved with --ckpt.disable_ds, "
                                        "or by another recipe): cannot resume from it")
            load_path, _ = eng.load_checkpoint(str(path), tag=tag, load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
            if load_path is None:
                raise RuntimeError(f"DeepSpeed could not load {tag!r} from the checkpoint in {path}")
        self._load_rng(path)
        return TrainState(**json.loads((path / STATE_FILE).read_text()))

    @staticmethod
    def read_extra(path: Path) -> dict[str, Any]:
        """The recipe state saved with the checkpoint in ``path`` ({} when none)."""
        f = path / EXTRA_FILE
        return json.loads(f.read_text()) if f.is_file() else {}

    def prune(self, keep_step: int | None) -> None:
        """Keep the newest ``max_num`` checkpoints and ``keep_step``'s (the best); then delete the
        oldest others while over ``max_mem`` GB, never the newest. Rank 0 only."""
        keep = _step_dir(self.root, keep_step) if keep_step is not None else None
        done = self.complete()
        protected = set(done[-self.cfg.max_num:]) | {keep}
        for p in done:
            if p not in protected:
                shutil.rmtree(p, ignore_errors=True)
        done = [p for p in done if p in protected]
        while sum(_dir_bytes(p) for p in done) > self.cfg.max_mem * 1e9:
            victims = [p for p in done[:-1] if p != keep]
            if not victims:
                break
            shutil.rmtree(victims[0], ignore_errors=True)
            done.remove(victims[0])

    def _save_rng(self, folder: Path) -> None:
        from safetensors.torch import save_file  # noqa: PLC0415

        states = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            states.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(states, str(folder / f"rng_rank{self.dist.rank}.safetensors"))

    def _load_rng(self, folder: Path) -> None:
        from safetensors.torch import load_file  # noqa: PLC0415

        path = folder / f"rng_rank{self.dist.rank}.safetensors"
        if not path.is_file():  # resumed with more ranks than saved: the new ones keep their seed
            return
        states = load_file(str(path))
        torch.set_rng_state(states["cpu"])
        cuda = [states[k] for k in sorted(states) if k.startswith("cuda")]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
