"""The on-disk format of the trajectory log (``trajlog``): record framing, checks, the lock.

A record is ``b"TRJ1" | u64 body length | u32 crc32(body) | u32 crc32(the 16 bytes before)``
then the body, ``u32 part count | u64 length of each part | the parts``; part 0 is the msgpack
meta (one of the tagged structs below). The header's own checksum tells a damaged length field
apart from a record cut short by a crash, so a bad length cannot pass for a torn tail.

Not here: what the records mean (``trajlog``).
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

MAGIC = b"TRJ1"
HEADER = struct.Struct("<4sQII")
"""magic, body length, crc32 of the body, crc32 of the first 16 header bytes."""
LOCK_NAME = "LOCK"
SEGMENT_NAME = re.compile(r"segment-(\d{8})\.log")


class TrajectoryLogError(RuntimeError):
    """The trajectory log cannot do what was asked (misuse or an inconsistent resume)."""


class LogCorrupt(TrajectoryLogError):
    """A record in the log is damaged somewhere other than a torn tail."""


class LogLocked(TrajectoryLogError):
    """Another writer holds the log directory."""


class GroupMeta(msgspec.Struct, tag="group", tag_field="kind", frozen=True):
    """A complete group; its trajectories follow as the record's other parts."""

    seq: int
    """Position of the group's prompt in the prompt stream."""
    uids: list[str]
    """The trajectories' uids, in the group's order."""


class StepMeta(msgspec.Struct, tag="step", tag_field="kind", frozen=True):
    """Optimizer step ``step`` consumed these uids."""

    step: int
    used: list[str]
    """Trained on."""
    dropped: list[str]
    """Filtered out by design (dynamic filtering, failed episodes): handled all the same."""


class RollbackMeta(msgspec.Struct, tag="rollback", tag_field="kind", frozen=True):
    """A resume from the checkpoint of ``step``."""

    step: int
    """Step records > this one, earlier in the log, are void."""


class SnapshotMeta(msgspec.Struct, tag="snapshot", tag_field="kind", frozen=True):
    """What a compaction deleted and must not forget."""

    step: int
    """Compacted at this checkpoint step; resuming from an older one is refused."""
    seqs: list[tuple[int, int]]
    """Half-open ranges of the seqs of every compacted group (cumulative)."""


Meta = GroupMeta | StepMeta | RollbackMeta | SnapshotMeta
META_ENCODER = msgspec.msgpack.Encoder()
META_DECODER = msgspec.msgpack.Decoder(Meta)


def frame_record(meta: Meta, frames: Sequence[Any] = ()) -> bytes:
    """Header + body of the record of ``meta`` and codec ``frames`` (bytes, contiguous arrays)."""
    parts = [META_ENCODER.encode(meta), *frames]
    views = [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts]
    lengths = struct.pack(f"<I{len(views)}Q", len(views), *(len(v) for v in views))
    body = b"".join((lengths, *views))
    head = struct.pack("<4sQI", MAGIC, len(body), zlib.crc32(body))
    return b"".join((head, struct.pack("<I", zlib.crc32(head)), body))


def read_body(f: BinaryIO, path: Path, offset: int, size: int) -> bytes | None:
    """The checked body of the record at ``offset``; None when it is a torn tail."""
    f.seek(offset)
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    magic, length, body_crc, head_crc = HEADER.unpack(head)
    if magic != MAGIC or zlib.crc32(head[:-4]) != head_crc:
        if zeros_from(f, offset):  # space the filesystem extended but never wrote
            return None
        raise LogCorrupt(f"trajectory log {path}: bad record header at offset {offset} "
                         f"(magic or header checksum)")
    if offset + HEADER.size + length > size:
        return None
    body = f.read(length)
    if zlib.crc32(body) != body_crc:
        raise LogCorrupt(f"trajectory log {path}: checksum mismatch in the record at offset {offset} "
                         f"({length}-byte body)")
    return body


def split_body(body: bytes, path: Path, offset: int) -> list[memoryview]:
    """The parts of a checked body (a mismatch here means a writer bug, not a torn write)."""
    view = memoryview(body)
    try:
        (count,) = struct.unpack_from("<I", view)
        lengths = struct.unpack_from(f"<{count}Q", view, 4)
    except struct.error:
        count, lengths = -1, ()
    pos = 4 + 8 * max(count, 0)
    if count < 1 or pos + sum(lengths) != len(body):
        raise LogCorrupt(f"trajectory log {path}: malformed record body at offset {offset}")
    parts = []
    for n in lengths:
        parts.append(view[pos:pos + n])
        pos += n
    return parts


def decode_meta(part: memoryview, path: Path, offset: int) -> Meta:
    try:
        return META_DECODER.decode(part)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise LogCorrupt(f"trajectory log {path}: bad record meta at offset {offset}: {e}") from None


def zeros_from(f: BinaryIO, offset: int) -> bool:
    """True when the file holds only zero bytes from ``offset`` on."""
    f.seek(offset)
    while chunk := f.read(1 << 20):
        if chunk.strip(b"\0"):
            return False
    return True


def truncate_tail(path: Path, offset: int) -> None:
    """Cut ``path`` to ``offset`` bytes, durably."""
    with open(path, "r+b") as f:
        f.truncate(offset)
        os.fsync(f.fileno())


def seq_ranges(values: set[int]) -> list[tuple[int, int]]:
    """Sorted half-open ranges covering ``values``: {1, 2, 3, 7} -> [(1, 4), (7, 8)]."""
    out: list[tuple[int, int]] = []
    for v in sorted(values):
        if out and out[-1][1] == v:
            out[-1] = (out[-1][0], v + 1)
        else:
            out.append((v, v + 1))
    return out


def lock_dir(directory: Path) -> int:
    """The fd of ``directory``'s lock file, exclusively flocked (it holds our pid); else LogLocked."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise LogLocked(f"trajectory log {directory} is already open for writing (pid {holder}); "
                        f"only one writer (rank 0) may hold it") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def close_fds(fds: dict[str, int]) -> None:
    """Close the active segment, then the lock (closing it releases the flock)."""
    for name in ("active", "lock"):
        fd = fds.pop(name, None)
        if fd is not None:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
