"""Checkpoints without DeepSpeed (a stand-in engine writes the shard files): atomic publish,
a killed save never becomes a checkpoint, keep-last-N plus the best, the state round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treadle.trainer.checkpoint.atomic import clean_leftovers, publish, staging_dir
from treadle.trainer.checkpoint.checkpointer import Checkpointer, TrainState
from treadle.trainer.config.ckpt import CheckpointConfig
from treadle.trainer.strategy.deepspeed import DistInfo

ONE = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"))


class FakeEngine:
    """Writes and reads a file where DeepSpeed would put its shards."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value
        self.loaded_from: str | None = None

    def save_checkpoint(self, folder: str, tag: str, save_latest: bool) -> None:
        (Path(folder) / tag).mkdir(parents=True)
        (Path(folder) / tag / "shard.txt").write_text(str(self.value))

    def load_checkpoint(self, folder: str, tag: str, **_: bool) -> tuple[str, dict]:
        self.value = float((Path(folder) / tag / "shard.txt").read_text())
        self.loaded_from = folder
        return folder, {}


def _ckpt(tmp_path: Path, **kw) -> Checkpointer:
    return Checkpointer(CheckpointConfig(path=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "out"), **kw), ONE)


def test_save_then_load_restores_state_engine_and_rng(tmp_path):
    ck = _ckpt(tmp_path)
    state = TrainState(global_step=4, epoch=1, step_in_epoch=1, best_metric=0.5, best_step=4)
    torch.manual_seed(123)
    path = ck.save(FakeEngine(7.0), state)
    expected = torch.rand(3)  # what the RNG gives right after the save
    torch.manual_seed(999)
    engine = FakeEngine()
    assert ck.latest() == path and ck.load(engine, path) == state
    assert engine.value == 7.0 and torch.equal(torch.rand(3), expected)


def test_a_save_killed_midway_is_never_picked_and_is_cleaned(tmp_path):
    ck = _ckpt(tmp_path)
    good = ck.save(FakeEngine(1.0), TrainState(global_step=2))

    def crash(_: Path) -> None:  # dies after the DeepSpeed shards are written, before state.json
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ck.save(FakeEngine(2.0), TrainState(global_step=4), write_hf=crash)
    assert ck.latest() == good and (ck.root / ".tmp-step_00000004").is_dir()
    # a folder with the final name but no state file (e.g. copied by hand, half done) is not complete either
    (ck.root / "step_00000006" / "ds").mkdir(parents=True)
    assert ck.latest() == good
    _ckpt(tmp_path)  # the next run's checkpointer removes the leftover
    assert not (ck.root / ".tmp-step_00000004").exists()


def test_keep_last_n_and_the_best(tmp_path):
    ck = _ckpt(tmp_path, max_num=2)
    for step in (1, 2, 3, 4, 5):
        best = 2 if step >= 2 else None
        ck.save(FakeEngine(step), TrainState(global_step=step, best_step=best))
    assert [p.name for p in ck.complete()] == ["step_00000002", "step_00000004", "step_00000005"]


def test_mem_budget_prunes_oldest_but_never_the_newest(tmp_path):
    ck = _ckpt(tmp_path, max_num=5, max_mem=1e-12)
    for step in (1, 2, 3):
        ck.save(FakeEngine(step), TrainState(global_step=step))
    assert [p.name for p in ck.complete()] == ["step_00000003"]


def test_resume_refuses_a_checkpoint_without_deepspeed_state(tmp_path):
    ck = _ckpt(tmp_path, disable_ds=True)
    path = ck.save(FakeEngine(), TrainState(global_step=1))
    with pytest.raises(FileNotFoundError, match="disable_ds"):
        ck.load(FakeEngine(), path)


def test_publish_replaces_a_folder_whole(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "old.txt").write_text("old")
    tmp = staging_dir(final)
    (tmp / "new.txt").write_text("new")
    publish(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"] and not tmp.exists()
    (tmp_path / ".tmp-x").mkdir()
    clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_state_advances_across_epochs():
    s = TrainState()
    for _ in range(3):
        s = s.advanced(steps_per_epoch=2)
    assert (s.global_step, s.epoch, s.step_in_epoch) == (3, 1, 1)
