"""The durable trajectory log: round trips, exactly-once resume, void steps, SIGKILL, torn tails,
corruption, rotation, compaction and the single-writer lock, on real files."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from treadle.common.records import Trajectory
from treadle.trainer.rl.trajlog import (
    LogCorrupt,
    LogLocked,
    LogState,
    TrajectoryLog,
    TrajectoryLogError,
)


def make_traj(seq: int, i: int, length: int = 7) -> Trajectory:
    rng = np.random.default_rng(seq * 1000 + i)
    return Trajectory(
        prompt_token_ids=rng.integers(0, 50_000, 5, dtype=np.int32),
        response_token_ids=rng.integers(0, 50_000, length, dtype=np.int32),
        rollout_logprobs=-rng.random(length, dtype=np.float32),
        loss_mask=(rng.random(length) > 0.3).astype(np.uint8),
        token_rewards=rng.standard_normal(length).astype(np.float32),
        reward=float(i), score=0.5, min_policy_version=3, max_policy_version=4,
        truncated=bool(i % 2), finish_reason="length" if i % 2 else "stop",
        uid=f"{seq}.{i}", group_id=f"g{seq}", extra_logs={"len": float(length)},
        info={"label": f"answer-{seq}", "row": seq, "tags": ["a", 2, 3.5, None, {"k": b"\x00\x01"}]},
    )


def make_group(seq: int, n: int = 2, length: int = 7) -> list[Trajectory]:
    return [make_traj(seq, i, length) for i in range(n)]


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert x == y, name


def uids(state: LogState) -> list[str]:
    return [t.uid for _, group in state.pending for t in group]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    """Warnings of the trajlog logger (the treadle logger tree does not propagate to caplog)."""
    handler = _Capture()
    logger = logging.getLogger("treadle.trainer.rl.trajlog")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def segments(d: Path) -> list[Path]:
    return sorted(d.glob("segment-*.log"))


def test_round_trip_keeps_arrays_and_info(tmp_path: Path) -> None:
    small, big = make_group(0, 3), make_group(1, 2, length=3000)  # inline arrays and buffer frames
    with TrajectoryLog(tmp_path) as log:
        log.append_group(0, small)
        log.append_group(1, big)
    with TrajectoryLog(tmp_path) as log:
        state = log.recover(0)
    assert [seq for seq, _ in state.pending] == [0, 1]
    for (_, got), want in zip(state.pending, [small, big], strict=True):
        assert len(got) == len(want)
        for a, b in zip(want, got, strict=True):
            assert_same(a, b)
    assert state.done_seqs == {0, 1} and state.handled_uids == frozenset()
    assert state.next_step == 1 and state.groups == 2
    assert state.bytes == sum(p.stat().st_size for p in segments(tmp_path)) > 3000 * 4 * 2


def test_exactly_once_across_resume(tmp_path: Path) -> None:
    log = TrajectoryLog(tmp_path)
    for seq in range(6):
        log.append_group(seq, make_group(seq))
    log.mark_step(1, used=["0.0", "0.1", "1.0"])
    log.mark_step(2, used=["1.1", "2.0"], dropped=["2.1"])
    log.mark_step(3, used=["3.0", "3.1", "4.0"])
    log.close()  # the process dies after step 3; the checkpoint holds step 2

    log = TrajectoryLog(tmp_path)
    state = log.recover(checkpoint_step=2)
    assert state.handled_uids == {"0.0", "0.1", "1.0", "1.1", "2.0", "2.1"}
    assert uids(state) == ["3.0", "3.1", "4.0", "4.1", "5.0", "5.1"]  # step 3's uids are pending again
    assert [seq for seq, _ in state.pending] == [3, 4, 5]
    assert state.done_seqs == set(range(6)) and state.next_step == 3
    with pytest.raises(ValueError, match="handled uids"):
        log.mark_step(3, used=["2.0"])  # would train 2.0 a second time
    with pytest.raises(ValueError, match="never appended"):
        log.mark_step(3, used=["9.9"])
    with pytest.raises(ValueError, match="goes backwards"):
        log.mark_step(2, used=["3.0"])  # step 2 is in the checkpoint already
    log.mark_step(3, used=["4.0", "4.1"], dropped=["5.0"])  # step 3 again, other uids
    state = log.recover(3)
    log.close()
    assert uids(state) == ["3.0", "3.1", "5.1"]  # a partly handled group keeps its unhandled rest
    assert [seq for seq, _ in state.pending] == [3, 5]
    with TrajectoryLog(tmp_path) as log:  # the same answer from disk
        again = log.recover(3)
        assert uids(again) == uids(state) and again.handled_uids == state.handled_uids
        with pytest.raises(TrajectoryLogError, match="only up to 3"):
            log.recover(4)  # a checkpoint newer than the log: mark_step was not written first


def test_void_steps_stay_void(tmp_path: Path) -> None:
    with TrajectoryLog(tmp_path) as log:
        for seq in range(3):
            log.append_group(seq, make_group(seq))
        for step in (1, 2, 3):
            log.mark_step(step, used=[f"{step - 1}.0", f"{step - 1}.1"])
    with TrajectoryLog(tmp_path) as log:
        state = log.recover(1)  # voids the old steps 2 and 3 on disk
        assert uids(state) == ["1.0", "1.1", "2.0", "2.1"]
        log.append_group(3, make_group(3))
        log.mark_step(2, used=["3.0", "3.1"])
    with TrajectoryLog(tmp_path) as log:  # crashed again; the checkpoint now holds the new step 2
        state = log.recover(2)
        assert state.handled_uids == {"0.0", "0.1", "3.0", "3.1"}
        assert uids(state) == ["1.0", "1.1", "2.0", "2.1"]
        assert state.done_seqs == {0, 1, 2, 3}
        with pytest.raises(TrajectoryLogError, match="only up to 2"):
            log.recover(3)  # the old step 3 does not come back either


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from treadle.common.records import Trajectory
    from treadle.trainer.rl.trajlog import TrajectoryLog

    log = TrajectoryLog(sys.argv[1])
    seq = int(sys.argv[2])
    rng = np.random.default_rng(seq)
    while True:
        group = []
        for i in range(2):
            n = int(rng.integers(1, 150_000))  # up to ~2.7 MB a record: a write takes a while
            group.append(Trajectory(
                prompt_token_ids=np.arange(4, dtype=np.int32),
                response_token_ids=np.full(n, seq, dtype=np.int32),
                rollout_logprobs=np.zeros(n, dtype=np.float32),
                loss_mask=np.ones(n, dtype=np.uint8), uid=f"{seq}.{i}", group_id=f"g{seq}"))
        log.append_group(seq, group)
        print(seq, flush=True)
        seq += 1
""")


def test_sigkill_loses_no_acknowledged_group(tmp_path: Path, warnings_seen: list[str]) -> None:
    rng = random.Random()
    printed: list[int] = []
    for _ in range(3):  # kill, recover, continue, kill again
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(len(printed))],
                                 stdout=subprocess.PIPE, text=True)
        try:
            printed.append(int(child.stdout.readline()))
            with pytest.raises(LogLocked, match=str(tmp_path)):
                TrajectoryLog(tmp_path)  # the child holds the lock
            for _ in range(rng.randint(0, 8)):
                printed.append(int(child.stdout.readline()))
            time.sleep(rng.uniform(0, 0.008))  # land inside an append (~5 ms), not just after a print
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            rest = child.communicate()[0]
        printed += [int(line) for line in rest.split()]  # printed before the kill, read only now
        with TrajectoryLog(tmp_path) as log:
            state = log.recover(0)
        done = sorted(state.done_seqs)
        assert done[: len(printed)] == printed == list(range(len(printed)))
        assert len(done) - len(printed) in (0, 1)  # at most one written but not yet printed
        assert [seq for seq, _ in state.pending] == done
        for seq, group in state.pending:
            assert [t.uid for t in group] == [f"{seq}.0", f"{seq}.1"]
            assert all(int(t.response_token_ids[0]) == seq for t in group)
        printed = done  # a seq written but not printed is in the log: the next child skips it
    assert all("torn tail" in m and str(tmp_path) in m for m in warnings_seen)
    with TrajectoryLog(tmp_path) as log:
        log.append_group(len(printed), make_group(len(printed)))
    with TrajectoryLog(tmp_path) as log:
        assert log.recover(0).done_seqs == set(range(len(printed) + 1))


def _three_groups(d: Path) -> list[int]:
    """Append groups 0..2; return the segment's size before each record and at the end."""
    sizes = [0]
    with TrajectoryLog(d) as log:
        for seq in range(3):
            log.append_group(seq, make_group(seq))
            sizes.append(segments(d)[0].stat().st_size)
    return sizes


@pytest.mark.parametrize("keep", ["all but 1 byte", "7 header bytes"])
def test_torn_tail_is_truncated_with_a_warning(tmp_path: Path, warnings_seen: list[str], keep: str) -> None:
    sizes = _three_groups(tmp_path)
    seg = segments(tmp_path)[0]
    cut = sizes[3] - 1 if keep == "all but 1 byte" else sizes[2] + 7
    os.truncate(seg, cut)
    with TrajectoryLog(tmp_path) as log:
        assert log.recover(0).done_seqs == {0, 1}
        assert seg.stat().st_size == sizes[2]
        assert len(warnings_seen) == 1 and str(seg) in warnings_seen[0]
        assert f"{cut - sizes[2]} bytes at offset {sizes[2]}" in warnings_seen[0]
        log.append_group(2, make_group(2))  # the log continues after the cut
    with open(seg, "ab") as f:
        f.write(bytes(4096))  # space a crash left allocated but unwritten
    with TrajectoryLog(tmp_path) as log:
        state = log.recover(0)
    assert state.done_seqs == {0, 1, 2} and seg.stat().st_size == sizes[3]
    assert "4096 bytes" in warnings_seen[1]


def test_failed_write_is_undone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = TrajectoryLog(tmp_path)
    log.append_group(0, make_group(0))
    size = segments(tmp_path)[0].stat().st_size
    real_write, active = os.write, log._fds["active"]

    def half_then_enospc(fd: int, data: bytes) -> int:
        if fd != active:
            return real_write(fd, data)
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_enospc)
    with pytest.raises(OSError, match="No space"):
        log.append_group(1, make_group(1))
    monkeypatch.undo()
    assert segments(tmp_path)[0].stat().st_size == size  # the half record is gone
    log.append_group(1, make_group(1))
    log.close()
    with TrajectoryLog(tmp_path) as log:
        assert log.recover(0).done_seqs == {0, 1}


@pytest.mark.parametrize("where", ["body", "header", "last_body"])
def test_corrupt_record_names_file_and_offset(tmp_path: Path, where: str) -> None:
    sizes = _three_groups(tmp_path)
    seg = segments(tmp_path)[0]
    record = 2 if where == "last_body" else 1  # a complete last record is not a torn tail
    pos = sizes[record] + (3 if where == "header" else (sizes[record + 1] - sizes[record]) // 2)
    data = bytearray(seg.read_bytes())
    data[pos] ^= 0x40
    seg.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt) as info:
        TrajectoryLog(tmp_path)
    assert str(seg) in str(info.value) and f"offset {sizes[record]}" in str(info.value)
    seg.write_bytes(bytes(data[: sizes[1]]))  # the failed open released the lock: reopen works
    with TrajectoryLog(tmp_path) as log:
        assert log.recover(0).done_seqs == {0}


def test_rotation_and_compaction(tmp_path: Path) -> None:
    with TrajectoryLog(tmp_path, segment_bytes=3000) as log:
        for seq in range(10):
            log.append_group(seq, make_group(seq))
    one = segments(tmp_path)[0].stat().st_size
    assert len(segments(tmp_path)) > 2
    assert all(p.stat().st_size < 3000 + one for p in segments(tmp_path))
    with TrajectoryLog(tmp_path, segment_bytes=3000) as log:
        assert [seq for seq, _ in log.recover(0).pending] == list(range(10))

    d = tmp_path / "compact"
    with TrajectoryLog(d, segment_bytes=1) as log:  # one record per segment
        log.append_group(0, make_group(0))
        log.append_group(1, make_group(1))
        log.mark_step(1, used=["0.0", "0.1", "1.0"])
        log.append_group(2, make_group(2))
        log.mark_step(2, used=["1.1", "2.0"], dropped=["2.1"])
        log.append_group(3, make_group(3))
        log.mark_step(3, used=["3.0"])
        log.append_group(4, make_group(4))
        before = [p.stat().st_size for p in segments(d)]
        assert log.compact(0) == 0
        freed = log.compact(2)  # the first five records; the step-3 record and later are kept
        assert freed == sum(before[:5])
        assert [p.name for p in segments(d)][0] == "segment-00000005.log"
    with TrajectoryLog(d, segment_bytes=1) as log:
        state = log.recover(2)
        assert state.done_seqs == {0, 1, 2, 3, 4} and uids(state) == ["3.0", "3.1", "4.0", "4.1"]
        with pytest.raises(ValueError, match="already in the log"):
            log.append_group(1, make_group(1))  # a compacted seq stays done
        with pytest.raises(TrajectoryLogError, match="compacted at step 2"):
            log.recover(1)
        log.mark_step(3, used=["3.0", "3.1", "4.0", "4.1"])
        assert log.compact(3) > 0
        state = log.recover(3)
        assert state.pending == [] and state.done_seqs == {0, 1, 2, 3, 4} and state.groups == 0
    with TrajectoryLog(d) as log:
        assert log.recover(3).done_seqs == {0, 1, 2, 3, 4}


def test_second_writer_is_refused(tmp_path: Path) -> None:
    first = TrajectoryLog(tmp_path)
    with pytest.raises(LogLocked, match=f"{tmp_path}.*pid {os.getpid()}"):
        TrajectoryLog(tmp_path)
    first.append_group(0, make_group(0))
    first.close()
    with pytest.raises(TrajectoryLogError, match="closed"):
        first.append_group(1, make_group(1))
    with TrajectoryLog(tmp_path) as second:
        assert second.recover(0).done_seqs == {0}
