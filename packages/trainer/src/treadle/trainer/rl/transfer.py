"""Moving RL data between the trainer's ranks: rank 0's trajectories to every rank, and every
rank's per-action results to every rank.

Trajectories travel as treadle's wire codec frames (a ``TrajectoryBatch``: msgpack header plus raw
buffers, no pickle) joined into one byte tensor and broadcast over the trainer's process group.
Per-action arrays (old-policy and reference logprobs, values) computed by each rank on its share
are all-gathered as one float tensor, so every rank then holds the whole batch's arrays and runs
the same (deterministic) advantage computation. With one rank both are no-ops.

Not here: which rank computes which share (``trainers.ppo``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from treadle.common.codec import decode, encode
from treadle.common.records import Record, Trajectory, TrajectoryBatch
from treadle.trainer.rl.experience import Experience


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def frames_to_bytes(frames: Sequence[object]) -> bytes:
    """``[count][len_0]...[len_n-1]`` (little-endian u64) then the frames back to back."""
    views = [memoryview(f).cast("B") for f in frames]
    head = struct.pack(f"<Q{len(views)}Q", len(views), *(v.nbytes for v in views))
    return b"".join([head, *views])


def bytes_to_frames(data: bytes | memoryview) -> list[memoryview]:
    """Inverse of ``frames_to_bytes`` (views into ``data``)."""
    mv = memoryview(data)
    (count,) = struct.unpack_from("<Q", mv, 0)
    sizes = struct.unpack_from(f"<{count}Q", mv, 8)
    out, at = [], 8 + 8 * count
    for n in sizes:
        out.append(mv[at:at + n])
        at += n
    if at != mv.nbytes:
        raise ValueError(f"frame bundle: {mv.nbytes} bytes but the frames add up to {at}")
    return out


def broadcast_message(msg: Record | None, device: torch.device, *, method: str = "") -> tuple[str, Record | None]:
    """Rank 0's ``(method, msg)`` on every rank (the others pass anything; they get rank 0's), as
    wire codec frames in one byte tensor: two broadcasts, the size then the bytes."""
    if _world() == 1:
        return method, msg
    rank = torch.distributed.get_rank()
    payload = frames_to_bytes(encode(msg, method=method)) if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    torch.distributed.broadcast(size, 0)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if rank == 0
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    torch.distributed.broadcast(buf, 0)
    if rank == 0:
        return method, msg
    out = decode(bytes_to_frames(buf.cpu().numpy().tobytes()))
    return out.method, out.msg


def broadcast_trajectories(trajs: list[Trajectory] | None, step: int, device: torch.device) -> list[Trajectory]:
    """Rank 0's ``trajs`` on every rank (others pass None)."""
    if _world() == 1:
        assert trajs is not None
        return trajs
    _, msg = broadcast_message(TrajectoryBatch(trajectories=list(trajs or []), step=step), device)
    assert isinstance(msg, TrajectoryBatch)
    return list(msg.trajectories)


def broadcast_arrays(exps: Sequence[Experience], name: str, device: torch.device) -> None:
    """Rank 0's action array ``name`` of every experience on every rank (the others' are replaced)."""
    if _world() == 1:
        return
    total = sum(e.num_actions for e in exps)
    rank = torch.distributed.get_rank()
    flat = (torch.from_numpy(np.concatenate([e.arrays[name] for e in exps] or [np.zeros(0, np.float32)])
                             .astype(np.float32)).to(device) if rank == 0
            else torch.empty(total, dtype=torch.float32, device=device))
    torch.distributed.broadcast(flat, 0)
    values, at = flat.cpu().numpy(), 0
    for e in exps:
        e.arrays[name] = values[at:at + e.num_actions].copy()
        at += e.num_actions


def share_of(count: int, world: int, rank: int) -> list[int]:
    """Indices rank ``rank`` computes: a contiguous, nearly equal slice (pure)."""
    per, extra = divmod(count, world)
    start = rank * per + min(rank, extra)
    return list(range(start, start + per + (rank < extra)))


def all_gather_arrays(exps: Sequence[Experience], names: Sequence[str], device: torch.device, *,
                      rank: int | None = None, world: int | None = None, group: object = None) -> None:
    """Every data-parallel rank computed ``names`` for its ``share_of`` the experiences; afterwards
    all have all (``rank``/``world``/``group``: the data-parallel ones; default every rank)."""
    world = _world() if world is None else world
    if world == 1 or not names:
        return
    rank = torch.distributed.get_rank() if rank is None else rank
    mine = share_of(len(exps), world, rank)
    flat = np.concatenate([exps[i].arrays[n] for i in mine for n in names] or [np.zeros(0, np.float32)])
    longest = max(sum(exps[i].num_actions for i in share_of(len(exps), world, r)) * len(names) for r in range(world))
    send = torch.zeros(max(longest, 1), dtype=torch.float32, device=device)
    send[: flat.shape[0]] = torch.from_numpy(flat.astype(np.float32))
    parts = [torch.empty_like(send) for _ in range(world)]
    torch.distributed.all_gather(parts, send, group=group)
    for r, part in enumerate(parts):
        values, at = part.cpu().numpy(), 0
        for i in share_of(len(exps), world, r):
            for n in names:
                k = exps[i].num_actions
                exps[i].arrays[n] = values[at:at + k].copy()
                at += k
