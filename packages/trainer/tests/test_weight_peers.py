"""Rank 0's reads of the other ranks' ZeRO-3 partitions (``weights.peers``), the parts that run
without CUDA: merging neighbouring partitions into one copy, the grid rank 0 builds (the
layout the NCCL gather gives), and the checks that send a sync back to the gathers. The
mapping itself (CUDA IPC) is ``map_on``, replaced here by a CPU buffer standing in for another
rank's mapped memory (a named fake of the neighbour that needs CUDA); the real one runs in the
GPU suite (``test_gpu_weights.py``), and the fallback on CPU in the 2-rank gloo scenario
(``test_weight_sender.py``: every rank falls back alike, bytes unchanged)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treadle.trainer.weights import peers as peers_mod
from treadle.trainer.weights.peers import PeerReads, _runs, _Share


def param(values: list[float], shape: tuple[int, ...]) -> SimpleNamespace:
    """A stand-in for a ZeRO-3 parameter: its local partition and full shape."""
    return SimpleNamespace(ds_tensor=torch.tensor(values, dtype=torch.float32), ds_shape=shape)


def test_runs_merge_neighbours_that_lie_back_to_back_only():
    t = torch.arange(100, dtype=torch.float32)
    other = torch.arange(5, dtype=torch.float32)
    parts = [t[0:10], t[10:25], t[30:40], t[40:41], other, t[41:45]]
    runs = _runs(parts)
    assert [r.numel() for r in runs] == [25, 11, 5, 4]
    assert torch.equal(torch.cat(runs), torch.cat(parts))
    assert runs[0].data_ptr() == t.data_ptr()  # a view, not a copy


def test_grid_puts_each_rank_s_partitions_in_its_row_as_the_gather_does():
    params = [param([1, 2, 3], (5,)), param([4, 5], (4,))]
    rank1 = torch.tensor([9, 9, 10, 11, 12, 13, 14, 9], dtype=torch.float32)  # back to back at offset 2
    rank2 = torch.tensor([20, 21, 22, 0, 23, 24], dtype=torch.float32)  # apart
    reads = PeerReads(None)
    reads._where = {id(params[0]): [params[0].ds_tensor, rank1[2:5], rank2[0:3]],
                    id(params[1]): [params[1].ds_tensor, rank1[5:7], rank2[4:6]]}
    grid = reads.grid(params)
    assert grid.tolist() == [[1, 2, 3, 4, 5], [10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]


def shares(pieces1: list[tuple[int, int, int]], *, error: str = "", uuid: str = "gpu-1") -> list[bytes]:
    enc = peers_mod._ENCODE.encode
    return [enc(_Share(uuid="gpu-0", storages=[], pieces=[(0, 0, 12), (0, 12, 8)])),
            enc(_Share(uuid=uuid, storages=[b"h1"], pieces=pieces1, error=error))]


@pytest.fixture
def mapped(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """``map_on`` replaced: rank 1's storage is this CPU buffer (a fake of the CUDA mapping)."""
    memory = torch.arange(32, dtype=torch.uint8)
    import treadle.rollout.engine.ipc as ipc

    monkeypatch.setattr(ipc, "map_on", lambda handle, device: memory)
    return memory


def locate(raw: list[bytes]) -> dict:
    params = [param([1, 2, 3], (5,)), param([4, 5], (4,))]
    return PeerReads(None)._locate(params, [peers_mod._DECODE.decode(b) for b in raw])


def test_locate_maps_each_storage_once_and_views_every_partition(mapped):
    where = locate(shares([(0, 4, 12), (0, 16, 8)]))
    rows = list(where.values())
    assert [len(r) for r in rows] == [2, 2]
    assert rows[0][1].dtype == torch.float32 and rows[0][1].numel() == 3
    assert rows[0][1].view(torch.uint8).tolist() == list(range(4, 16))
    assert rows[1][1].view(torch.uint8).tolist() == list(range(16, 24))


@pytest.mark.parametrize(("raw", "says"), [
    (shares([(0, 0, 12), (0, 12, 4)]), "4 bytes at 12 of 32, rank 0's 8"),  # another partition size
    (shares([(0, 0, 12), (0, 28, 8)]), "8 bytes at 28 of 32"),  # past the end of its storage
    (shares([(0, 0, 12)]), "rank 1 lists 1 partitions, rank 0 2"),
    (shares([], error="IpcHandleError('cuda_ipc shares CUDA tensors only')"), "could not share"),
    (shares([(0, 0, 12), (0, 12, 8)], uuid="gpu-0"), "uses rank 0's GPU"),
])
def test_locate_refuses_what_it_cannot_read_naming_why(mapped, raw, says):
    with pytest.raises(ValueError, match="rank 1") as e:
        locate(raw)
    assert says in str(e.value)


def test_a_share_with_unknown_fields_does_not_decode():
    import msgspec

    bad = msgspec.msgpack.encode({"uuid": "x", "storages": [], "pieces": [], "pickle": b"..."})
    with pytest.raises(msgspec.ValidationError):
        peers_mod._DECODE.decode(bad)


def test_grids_alternate_and_keep_reading_the_partitions_current_values():
    params = [param([1, 2], (4,))]
    rank1 = torch.tensor([3, 4], dtype=torch.float32)
    reads = PeerReads(None)
    reads._where = {id(params[0]): [params[0].ds_tensor, rank1]}
    first = reads.grid(params)
    second = reads.grid(params)
    assert first.data_ptr() != second.data_ptr()  # two grids, used in turn
    rank1 += 10  # the next sync: new values in the same memory
    params[0].ds_tensor -= 1
    third = reads.grid(params)
    assert third.data_ptr() == first.data_ptr() and third.tolist() == [[0, 1], [13, 14]]
