"""Rank 0's reads of the other ranks' ZeRO-3 partitions (``weights.peers``), the parts that run
without CUDA: merging neighbouring partitions into one copy, the rows rank 0 reads (views of a
peer's memory, or one copy per stretch of it into staging), and the checks that send a sync back to the gathers. The
mapping itself (CUDA IPC) is ``map_on``, replaced here by a CPU buffer standing in for another
rank's mapped memory (a named fake of the neighbour that needs CUDA); the real one runs in the
GPU suite (``test_gpu_weights.py``), and the fallback on CPU in the 2-rank gloo scenario
(``test_weight_sender.py``: every rank falls back alike, bytes unchanged)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treadle.trainer.weights import peers as peers_mod
from treadle.trainer.weights.gather import runs
from treadle.trainer.weights.peers import PeerReads, _Share


def param(values: list[float], shape: tuple[int, ...]) -> SimpleNamespace:
    """A stand-in for a ZeRO-3 parameter: its local partition and full shape."""
    return SimpleNamespace(ds_tensor=torch.tensor(values, dtype=torch.float32), ds_shape=shape)


def test_runs_merge_neighbours_that_lie_back_to_back_only():
    t = torch.arange(100, dtype=torch.float32)
    other = torch.arange(5, dtype=torch.float32)
    parts = [t[0:10], t[10:25], t[30:40], t[40:41], other, t[41:45]]
    merged = runs(parts)
    assert [r.numel() for r in merged] == [25, 11, 5, 4]
    assert torch.equal(torch.cat(merged), torch.cat(parts))
    assert merged[0].data_ptr() == t.data_ptr()  # a view, not a copy


def test_rows_copy_each_stretch_of_peer_memory_once_and_view_every_partition():
    params = [param([1, 2, 3], (5,)), param([4, 5], (4,)), param([6], (2,))]
    rank1 = torch.tensor([9, 10, 11, 12, 13, 14, 9, 9], dtype=torch.float32).view(torch.uint8)  # back to back at 1
    far = torch.zeros(4 << 20, dtype=torch.uint8)  # rank 2: two pieces > 1 MiB apart, one in another storage
    far[:12] = torch.tensor([20, 21, 22], dtype=torch.float32).view(torch.uint8)
    far[-8:] = torch.tensor([23, 24], dtype=torch.float32).view(torch.uint8)
    other = torch.tensor([25], dtype=torch.float32).view(torch.uint8)
    reads = PeerReads(None, direct=False)
    reads._where = {id(params[0]): [(rank1, 4, 12), (far, 0, 12)], id(params[1]): [(rank1, 16, 8), (far, len(far) - 8, 8)],
                    id(params[2]): [(rank1, 24, 4), (other, 0, 4)]}
    where, rows = reads.rows(params)
    assert [[t.tolist() for t in row] for row in rows] == [[[1, 2, 3], [4, 5], [6]], [[10, 11, 12], [13, 14], [9]],
                                                          [[20, 21, 22], [23, 24], [25]]]
    assert where[:2] == ("staged", reads.generation)
    copies = reads._kept.memo(("rows", where[2], tuple(id(p) for p in params)), None)[0]
    assert len(copies) == 1 + 3  # rank 1: one stretch; rank 2: too far apart, and another storage
    assert sum(dst.numel() for dst, _ in copies) < 1 << 10  # the gap itself was not copied


def test_direct_rows_are_views_of_the_peers_memory_that_see_its_current_values():
    params = [param([1, 2, 3], (5,)), param([4, 5], (4,))]
    rank1 = torch.tensor([9, 10, 11, 12, 13, 14], dtype=torch.float32)
    raw = rank1.view(torch.uint8)
    reads = PeerReads(None, direct=True)
    reads._where = {id(params[0]): [(raw, 4, 12)], id(params[1]): [(raw, 16, 8)]}
    where, rows = reads.rows(params)
    assert where == ("direct", reads.generation)
    assert [[t.tolist() for t in row] for row in rows] == [[[1, 2, 3], [4, 5]], [[10, 11, 12], [13, 14]]]
    assert rows[1][0].data_ptr() == raw.data_ptr() + 4 and rows[0][1].data_ptr() == params[1].ds_tensor.data_ptr()
    rank1 += 100  # the next sync: new values in the same memory, nothing copied
    _, again = reads.rows(params)
    assert again is rows and [t.tolist() for t in again[1]] == [[110, 111, 112], [113, 114]]


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


def test_locate_maps_each_storage_once_and_places_every_partition(mapped):
    where = locate(shares([(0, 4, 12), (0, 16, 8)]))
    rows = list(where.values())
    assert [len(r) for r in rows] == [1, 1]  # one other rank
    assert [(s is mapped, off, n) for s, off, n in (rows[0][0], rows[1][0])] == [(True, 4, 12), (True, 16, 8)]


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


def test_staging_buffers_alternate_and_keep_reading_the_partitions_current_values():
    params = [param([1, 2], (4,))]
    rank1 = torch.tensor([3, 4], dtype=torch.float32)
    reads = PeerReads(None, direct=False)
    reads._where = {id(params[0]): [(rank1.view(torch.uint8), 0, 8)]}
    first, _ = reads.rows(params)
    second, _ = reads.rows(params)
    assert first[2] != second[2]  # two staging buffers, used in turn
    rank1 += 10  # the next sync: new values in the same memory
    params[0].ds_tensor -= 1
    third, rows = reads.rows(params)
    assert third[2] == first[2]
    assert [t.tolist() for t in rows[0]] == [[0, 1]] and [t.tolist() for t in rows[1]] == [[13, 14]]


def test_prepare_exchanges_shares_only_when_a_partition_moved(monkeypatch: pytest.MonkeyPatch):
    """Steady state: one all-reduce ("did any rank's partitions move?") and the last answer;
    a moved partition, here or on another rank, brings the full exchange back. The collectives
    are replaced by what a second rank with the same partitions would answer."""
    calls: list[str] = []
    elsewhere = {"moved": False}  # whether the other rank's partitions moved
    monkeypatch.setattr(peers_mod, "_any", lambda flag, group: calls.append("any") or flag or elsewhere["moved"])
    monkeypatch.setattr(peers_mod, "_all_gather_bytes", lambda data, group: calls.append("exchange") or [data, data])
    monkeypatch.setattr(torch.distributed, "broadcast",  # rank 0's answer: it reads them
                        lambda t, src, group=None: calls.append("broadcast") or t.fill_(1))
    monkeypatch.setattr(PeerReads, "_share", lambda self, params: _Share(
        uuid="gpu", storages=[b"h"], pieces=[(0, p.ds_tensor.data_ptr(), 4 * p.ds_tensor.numel()) for p in params]))
    located: list[int] = []
    monkeypatch.setattr(PeerReads, "_locate", lambda self, params, shares: located.append(1) or {
        id(p): [(torch.zeros(4096, dtype=torch.uint8), 0, 4)] for p in params})
    params = [param([1, 2], (4,)), param([3], (2,))]
    reads = PeerReads(None)

    assert reads.prepare(params, main=True) and calls == ["any", "exchange", "broadcast"] and located == [1]
    calls.clear()
    assert reads.prepare(params, main=True) and calls == ["any"] and reads.generation == 1
    before = params[1].ds_tensor  # kept alive: the new memory cannot be at the old address
    params[1].ds_tensor = torch.tensor([3.0])  # moved here (new memory)
    assert params[1].ds_tensor.data_ptr() != before.data_ptr()
    calls.clear()
    assert reads.prepare(params, main=True) and calls == ["any", "exchange", "broadcast"]
    assert located == [1, 1] and reads.generation == 2  # placed again: the rows' views go stale
    elsewhere["moved"] = True  # moved on the other rank only: this rank exchanges too
    calls.clear()
    assert reads.prepare(params, main=False) and calls == ["any", "exchange", "broadcast"]
