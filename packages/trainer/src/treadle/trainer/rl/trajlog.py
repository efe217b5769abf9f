"""The durable trajectory log: a resumed RL run trains each completed trajectory exactly once.

Rank 0 appends every completed group (the samples of one prompt, with ``seq``, the prompt's
position in the deterministic prompt stream) durably before training on it, and one step record
per optimizer step naming the uids it used or dropped. Resuming from a checkpoint that holds step
``c``, ``recover(c)`` says which uids are handled (step records <= c), which groups are pending
(log order) and which seqs are done; step records > c are voided by an appended rollback record
first, so a second crash cannot bring them back.

On disk: a directory of segments ``segment-<index>.log`` (a new one once the last passes
``segment_bytes``) and a ``LOCK`` file (exclusive ``flock``: a second writer gets ``LogLocked``).
Each record is length-prefixed and CRC32-checked (format in ``_trajlog_io``): a msgpack meta
tagged ``group`` / ``step`` / ``rollback`` / ``snapshot``, and for a group the codec frames of a
``TrajectoryBatch`` (no pickle). A record cut short at the end of the last segment (a killed
write), or a zero-filled tail, is truncated on open with a warning; any other bad record raises
``LogCorrupt`` naming the file and the record's offset. ``compact(c)`` deletes the oldest
segments once everything in them is handled by step <= c, after appending a ``snapshot`` record
that keeps their seqs done. One writer, one thread at a time.

Not here: the prompt stream, checkpoints, choosing what to train (the RL loop does that).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.common.codec import decode_record, encode_record
from treadle.common.errors import CodecError
from treadle.common.log import get_logger
from treadle.common.records import Trajectory, TrajectoryBatch
from treadle.trainer.rl._trajlog_io import (
    HEADER,
    SEGMENT_NAME,
    GroupMeta,
    LogCorrupt,
    LogLocked,
    RollbackMeta,
    SnapshotMeta,
    StepMeta,
    TrajectoryLogError,
    close_fds,
    decode_meta,
    frame_record,
    fsync_dir,
    lock_dir,
    read_body,
    seq_ranges,
    split_body,
    truncate_tail,
)

__all__ = ["LogCorrupt", "LogLocked", "LogState", "TrajectoryLog", "TrajectoryLogError"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class LogState:
    """What ``recover`` finds: the state to resume the RL loop from."""

    pending: list[tuple[int, list[Trajectory]]]
    """(seq, unhandled trajectories of that group), in log order: train these first. Their arrays
    are read-only views of the bytes read back, as the codec gives them off the wire."""
    handled_uids: frozenset[str]
    """Uids used or dropped by step records <= the checkpoint step (still in the log)."""
    done_seqs: frozenset[int]
    """Seqs with a group in the log (compacted ones included): the prompt stream skips them."""
    next_step: int
    """The checkpoint step + 1."""
    groups: int
    """Groups held in the log's segments now."""
    bytes: int
    """Size of the log's segments on disk."""


@dataclass(slots=True)
class _GroupEntry:
    seq: int
    uids: tuple[str, ...]
    segment: int
    offset: int


@dataclass(slots=True)
class _StepEntry:
    step: int
    uids: frozenset[str]  # used and dropped
    segment: int
    used: tuple[str, ...] = ()  # trained, in the order given


@dataclass(slots=True)
class _State:
    """The log replayed: groups and effective (not rolled back) step records, in log order."""

    groups: list[_GroupEntry] = field(default_factory=list)
    steps: list[_StepEntry] = field(default_factory=list)
    uid_group: dict[str, _GroupEntry] = field(default_factory=dict)
    seqs: set[int] = field(default_factory=set)
    handled: dict[str, int] = field(default_factory=dict)  # uid -> first step handling it
    base_step: int = 0  # the latest compaction's checkpoint step
    base_seqs: set[int] = field(default_factory=set)
    floor: int = 0  # steps <= this are checkpointed: no new step records for them

    def apply(self, meta: Any, segment: int, offset: int) -> None:
        if isinstance(meta, GroupMeta):
            entry = _GroupEntry(seq=meta.seq, uids=tuple(meta.uids), segment=segment, offset=offset)
            self.groups.append(entry)
            self.seqs.add(entry.seq)
            self.uid_group.update(dict.fromkeys(entry.uids, entry))
        elif isinstance(meta, StepMeta):
            entry = _StepEntry(step=meta.step, uids=frozenset((*meta.used, *meta.dropped)), segment=segment,
                               used=tuple(meta.used))
            self.steps.append(entry)
            for uid in entry.uids:
                self.handled[uid] = min(self.handled.get(uid, entry.step), entry.step)
        elif isinstance(meta, RollbackMeta):
            self.steps = [s for s in self.steps if s.step <= meta.step]
            self.rebuild_handled()
        else:
            self.base_step = max(self.base_step, meta.step)
            self.floor = max(self.floor, meta.step)
            for start, stop in meta.seqs:
                self.base_seqs.update(range(start, stop))

    def rebuild_handled(self) -> None:
        self.handled = {}
        for s in self.steps:
            for uid in s.uids:
                self.handled[uid] = min(self.handled.get(uid, s.step), s.step)

    def last_step(self) -> int:
        return max((s.step for s in self.steps), default=self.base_step)

    def handled_by(self, step: int) -> frozenset[str]:
        return frozenset(uid for uid, s in self.handled.items() if s <= step)

    def done_seqs(self) -> frozenset[int]:
        return frozenset(self.base_seqs | self.seqs)


class TrajectoryLog:
    """Append-only, fsynced, CRC-checked log of trajectory groups and step records (one writer)."""

    __slots__ = ("_dir", "_segment_bytes", "_fsync", "_fds", "_segments", "_size", "_state",
                 "_broken", "_finalizer", "__weakref__")

    def __init__(self, directory: str | Path, *, segment_bytes: int = 256 << 20, fsync: bool = True) -> None:
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
        self._dir = Path(directory)
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._broken = False
        self._dir.mkdir(parents=True, exist_ok=True)
        self._fds: dict[str, int] = {"lock": lock_dir(self._dir)}  # closed by close() or the finalizer
        self._finalizer = weakref.finalize(self, close_fds, self._fds)
        try:
            self._open_segments()
        except BaseException:
            self.close()
            raise

    def _open_segments(self) -> None:
        self._segments = sorted(int(m.group(1)) for p in self._dir.iterdir()
                                if (m := SEGMENT_NAME.fullmatch(p.name)))
        self._state = _State()
        for index in self._segments:
            self._scan(index, last=index == self._segments[-1])
        if not self._segments:
            self._segments.append(0)
        self._open_active()

    def _path(self, index: int) -> Path:
        return self._dir / f"segment-{index:08d}.log"

    def _scan(self, index: int, *, last: bool) -> None:
        """Replay one segment into the state; truncate a torn tail of the last one."""
        path = self._path(index)
        size = path.stat().st_size
        with open(path, "rb") as f:
            offset = 0
            while offset < size:
                body = read_body(f, path, offset, size)
                if body is None:
                    if not last:
                        raise LogCorrupt(f"trajectory log {path}: the record at offset {offset} is cut "
                                         f"short, but this is not the last segment")
                    log.warning("trajectory log %s: dropped a torn tail of %d bytes at offset %d "
                                "(a write cut short)", path, size - offset, offset)
                    truncate_tail(path, offset)
                    return
                meta = decode_meta(split_body(body, path, offset)[0], path, offset)
                self._state.apply(meta, index, offset)
                offset += HEADER.size + len(body)

    def _open_active(self) -> None:
        path = self._path(self._segments[-1])
        created = not path.exists()
        self._fds["active"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fds["active"]).st_size
        if created:
            fsync_dir(self._dir)

    def __enter__(self) -> TrajectoryLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush, release the lock and close the files (idempotent)."""
        active = self._fds.get("active")
        if active is not None and not self._fsync and not self._broken:
            os.fsync(active)
        self._finalizer()

    def _check_open(self) -> None:
        if "active" not in self._fds:
            raise TrajectoryLogError(f"trajectory log {self._dir} is closed")
        if self._broken:
            raise TrajectoryLogError(f"trajectory log {self._dir}: a failed write could not be undone; "
                                     f"reopen the log to repair its tail")

    def append_group(self, seq: int, trajectories: Sequence[Trajectory]) -> None:
        """Log one complete group durably (returns once it is on disk): call before training on it."""
        self._check_open()
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError(f"append_group: seq must be an int >= 0, got {seq!r}")
        if not trajectories:
            raise ValueError(f"append_group: group seq={seq} has no trajectories")
        if seq in self._state.seqs or seq in self._state.base_seqs:
            raise ValueError(f"append_group: seq {seq} is already in the log {self._dir}")
        if any(not isinstance(t, Trajectory) or not t.uid for t in trajectories):
            raise ValueError(f"append_group: every item of seq={seq} must be a Trajectory with a uid")
        uids = [t.uid for t in trajectories]
        if len(set(uids)) != len(uids):
            raise ValueError(f"append_group: duplicate uids in group seq={seq}: {uids}")
        known = [u for u in uids if u in self._state.uid_group]
        if known:
            raise ValueError(f"append_group: uids already in the log {self._dir}: {known[:5]}")
        frames = encode_record(TrajectoryBatch(trajectories=list(trajectories)))
        self._write(GroupMeta(seq=seq, uids=uids), frames)

    def mark_step(self, step: int, used: Sequence[str], dropped: Sequence[str] = ()) -> None:
        """Record durably that optimizer step ``step`` consumed ``used`` and discarded ``dropped``."""
        self._check_open()
        if isinstance(used, str) or isinstance(dropped, str):
            raise TypeError("mark_step: used and dropped are sequences of uids, not one str")
        st = self._state
        if step <= st.floor or step < st.last_step():
            raise ValueError(f"mark_step: step {step} goes backwards: the log's last step is "
                             f"{st.last_step()}, the checkpoint's {st.floor}")
        uids = [*used, *dropped]
        if len(set(uids)) != len(uids):
            raise ValueError(f"mark_step: step {step} names a uid twice")
        unknown = [u for u in uids if u not in st.uid_group]
        if unknown:
            raise ValueError(f"mark_step: uids never appended to the log: {unknown[:5]}")
        twice = [f"{u} (step {st.handled[u]})" for u in uids if u in st.handled]
        if twice:
            raise ValueError(f"mark_step: step {step} would train handled uids again: {twice[:5]}")
        self._write(StepMeta(step=step, used=list(used), dropped=list(dropped)))

    def recover(self, checkpoint_step: int) -> LogState:
        """The state to resume from the checkpoint holding ``checkpoint_step`` (0: none).

        Step records after it are voided durably (a rollback record) before this returns.
        """
        self._check_open()
        st, c = self._state, checkpoint_step
        self._check_checkpoint(c)
        if any(s.step > c for s in st.steps):
            voided = sorted({s.step for s in st.steps if s.step > c})
            log.warning("trajectory log %s: resuming from step %d voids the records of steps %s",
                        self._dir, c, voided)
            self._write(RollbackMeta(step=c))
        st.floor = c
        handled = st.handled_by(c)
        return LogState(pending=self._pending(handled), handled_uids=handled, done_seqs=st.done_seqs(),
                        next_step=c + 1, groups=len(st.groups), bytes=self._bytes())

    def lineage(self, upto_step: int) -> dict[int, list[str]]:
        """Step -> uids trained in it, for the steps <= ``upto_step`` of the surviving history
        (voided steps excluded; steps compacted away are absent)."""
        self._check_open()
        out: dict[int, list[str]] = {}
        for s in self._state.steps:
            if s.step <= upto_step:
                out.setdefault(s.step, []).extend(s.used)
        return out

    def _check_checkpoint(self, c: int) -> None:
        st = self._state
        if c < st.base_step:
            raise TrajectoryLogError(f"trajectory log {self._dir} was compacted at step {st.base_step}; "
                                     f"it cannot resume an older checkpoint (step {c})")
        if c > st.last_step():
            raise TrajectoryLogError(
                f"checkpoint holds step {c}, but the trajectory log {self._dir} has step records "
                f"only up to {st.last_step()}: mark_step must be written before the checkpoint is saved")

    def _pending(self, handled: frozenset[str]) -> list[tuple[int, list[Trajectory]]]:
        out = []
        for g in self._state.groups:
            if any(u not in handled for u in g.uids):
                trajs = self._read_group(g)
                out.append((g.seq, [t for t in trajs if t.uid not in handled]))
        return out

    def _read_group(self, g: _GroupEntry) -> list[Trajectory]:
        path = self._path(g.segment)
        with open(path, "rb") as f:
            body = read_body(f, path, g.offset, os.fstat(f.fileno()).st_size)
        if body is None:
            raise LogCorrupt(f"trajectory log {path}: the record at offset {g.offset} is cut short")
        parts = split_body(body, path, g.offset)
        try:
            batch = decode_record(parts[1:])
        except CodecError as e:
            raise LogCorrupt(f"trajectory log {path}: group at offset {g.offset} does not decode: {e}") from None
        return list(batch.trajectories)  # type: ignore[attr-defined]

    def compact(self, checkpoint_step: int) -> int:
        """Delete the oldest segments whose every record is handled by step <= the checkpoint.

        Returns the bytes freed. A snapshot record (the step, the deleted groups' seqs) is
        appended first, so a crash between it and the deletions leaves a consistent log.
        """
        self._check_open()
        st, c = self._state, checkpoint_step
        self._check_checkpoint(c)
        handled = st.handled_by(c)
        blocked = {g.segment for g in st.groups if any(u not in handled for u in g.uids)}
        blocked |= {s.segment for s in st.steps if s.step > c}
        prefix: list[int] = []
        for index in self._segments[:-1]:  # never the segment being written
            if index in blocked:
                break
            prefix.append(index)
        if not prefix:
            return 0
        gone = set(prefix)
        # Step records name only uids appended before them, so what the prefix's step records
        # handled lies in the prefix too: the snapshot needs only the prefix's seqs.
        seqs = st.base_seqs.union(g.seq for g in st.groups if g.segment in gone)
        self._write(SnapshotMeta(step=c, seqs=seq_ranges(seqs)))
        for g in st.groups:
            if g.segment in gone:
                st.seqs.discard(g.seq)
                for uid in g.uids:
                    st.uid_group.pop(uid, None)
        st.groups = [g for g in st.groups if g.segment not in gone]
        st.steps = [s for s in st.steps if s.segment not in gone]
        st.rebuild_handled()
        freed = 0
        for index in prefix:  # oldest first: a crash midway leaves a prefix deleted, still consistent
            path = self._path(index)
            freed += path.stat().st_size
            path.unlink()
        self._segments = [i for i in self._segments if i not in gone]
        fsync_dir(self._dir)
        return freed

    def _bytes(self) -> int:
        return sum(self._path(i).stat().st_size for i in self._segments)

    def _write(self, meta: Any, frames: Sequence[Any] = ()) -> None:
        """Append one record (write + fsync), then apply it to the state."""
        record = frame_record(meta, frames)
        if self._size >= self._segment_bytes:
            self._rotate()
        fd, start = self._fds["active"], self._size
        try:
            view = memoryview(record)
            while view:
                view = view[os.write(fd, view):]
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            try:  # a half-written record must not stay in front of the next one
                os.ftruncate(fd, start)
            except OSError:
                self._broken = True
            raise
        self._size = start + len(record)
        self._state.apply(meta, self._segments[-1], start)

    def _rotate(self) -> None:
        fd = self._fds.pop("active")
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._segments.append(self._segments[-1] + 1)
        self._open_active()


