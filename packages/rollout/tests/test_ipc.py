"""The cuda_ipc weight transport on CPU: the handle's msgpack encoding (from a fabricated
``reduce_tensor`` result, since there is no GPU here), its strict decoding, and that engines
refuse a cuda_ipc update they cannot open before anything changes. Opening real handles is
tested on the GPU machine (test_gpu.py; packages/trainer/tests/test_gpu_weights.py)."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest
import torch

from treadle.common import ipc
from treadle.common.errors import BadRequest
from treadle.common.records import IpcWeights
from treadle.common.weights import bucket_layout, plan_buckets

UUID = "5b1d2a0c-0000-4000-8000-00000000abcd"


def rebuild_cuda_tensor(*args):  # a stand-in with the name torch's rebuild function has
    raise AssertionError("never called")


def reduction(numel=4096, offset=128, dtype=torch.uint8, size=None, stride=(1,), handle=b"\x07" * 64,
              event_sync=True):
    """What ``reduce_tensor`` returns for a uint8 CUDA view of ``numel`` bytes at ``offset``."""
    args = (torch.Tensor, torch.Size(size or [numel]), stride, offset, torch.storage.TypedStorage, dtype, 3,
            handle, 1 << 20, 512, False, b"/torch_1234_5678_0", 9, b"\x01" * 64, event_sync)
    return rebuild_cuda_tensor, args


def test_handle_round_trips_field_by_field_as_plain_msgpack():
    h = ipc.handle_from_reduction(*reduction(), device_uuid=UUID)
    data = ipc.dumps(h)
    assert ipc.loads(data) == h
    plain = msgpack.unpackb(data, raw=False)  # no pickle, no extension types: a plain map
    assert plain == {"format": ipc.FORMAT, "device_uuid": UUID, "numel": 4096, "tensor_offset": 128,
                     "storage_handle": b"\x07" * 64, "storage_size_bytes": 1 << 20, "storage_offset_bytes": 512,
                     "ref_counter_handle": b"/torch_1234_5678_0", "ref_counter_offset": 9,
                     "event_handle": b"\x01" * 64, "event_sync_required": True}


@pytest.mark.parametrize("kw,match", [
    ({"dtype": torch.float32}, "flat uint8"),
    ({"size": [64, 64]}, "flat uint8"),
    ({"stride": (2,)}, "flat uint8"),
    ({"handle": None}, "no CUDA allocation"),
])
def test_reduction_of_anything_but_a_flat_byte_bucket_is_refused(kw, match):
    with pytest.raises(ipc.IpcHandleError, match=match):
        ipc.handle_from_reduction(*reduction(**kw), device_uuid=UUID)


def test_another_rebuild_function_is_refused():
    def rebuild_storage_fd(*args):
        pass

    with pytest.raises(ipc.IpcHandleError, match="rebuild_cuda_tensor"):
        ipc.handle_from_reduction(rebuild_storage_fd, reduction()[1], device_uuid=UUID)


def _mutated(**changes):
    plain = msgpack.unpackb(ipc.dumps(ipc.handle_from_reduction(*reduction(), device_uuid=UUID)), raw=False)
    plain.update(changes)
    return msgpack.packb({k: v for k, v in plain.items() if v is not _DROP}, use_bin_type=True)


_DROP = object()


@pytest.mark.parametrize("data,match", [
    (b"\x93\x01\x02", "malformed"),  # a list, not a map
    (b"\xc1", "malformed"),  # not msgpack at all
    (_mutated(extra=1), "malformed"),  # unknown field
    (_mutated(numel="4096"), "malformed"),  # wrong type
    (_mutated(storage_handle=_DROP), "malformed"),  # missing field
    (_mutated(format=ipc.FORMAT + 1), "format"),
    (_mutated(numel=1 << 20), "inside its storage"),
    (_mutated(numel=0), "inside its storage"),
    (_mutated(event_handle=None), "event"),
])
def test_malformed_handles_raise_a_typed_error(data, match):
    with pytest.raises(ipc.IpcHandleError, match=match) as e:
        ipc.loads(data)
    assert isinstance(e.value, BadRequest)  # reaches a remote sender as BadRequest


def test_a_handle_without_event_wait_may_omit_the_event():
    h = ipc.loads(_mutated(event_handle=None, event_sync_required=False))
    assert h.event_handle is None and not h.event_sync_required


def test_cpu_tensors_and_cpu_engines_are_refused():
    with pytest.raises(ipc.IpcHandleError, match="CUDA tensors only"):
        ipc.encode_buckets(torch.zeros(64, dtype=torch.uint8), [(0, 64)])
    h = ipc.handle_from_reduction(*reduction(), device_uuid=UUID)
    with pytest.raises(ipc.IpcHandleError, match="CUDA device"):
        ipc.check_colocated(h, torch.device("cpu"))
    with pytest.raises(ipc.IpcHandleError, match="CUDA device"):
        ipc.open_handles([ipc.dumps(h)], "cpu")


def test_buckets_of_one_allocation_are_mapped_once_and_viewed_at_their_offsets(monkeypatch):
    """Two storages (allocations), three buckets: two maps; each view is its own bytes."""
    maps = []

    def fake_map(h, device):  # a stand-in for the CUDA mapping: the storage's bytes, numbered
        maps.append(h.storage_handle)
        return (torch.arange(h.storage_size_bytes) % 251).to(torch.uint8) + len(maps)

    monkeypatch.setattr(ipc, "_map", fake_map)
    monkeypatch.setattr(ipc, "check_colocated", lambda h, device: None)
    a = ipc.handle_from_reduction(*reduction(numel=64, offset=0), device_uuid=UUID)
    b = ipc.handle_from_reduction(*reduction(numel=32, offset=0, handle=b"\x09" * 64), device_uuid=UUID)
    spans = [(a, 128, 64), (b, 0, 32), (a, 4096, 100)]
    views = ipc.open_handles([ipc.dumps(msgspec.structs.replace(h, tensor_offset=off, numel=n))
                              for h, off, n in spans], "cuda:0")
    assert maps == [b"\x07" * 64, b"\x09" * 64]
    for (_, off, n), v, k in zip(spans, views, (1, 2, 1), strict=True):
        assert v.numel() == n and torch.equal(v, ((torch.arange(off, off + n) % 251).to(torch.uint8) + k))


def ipc_update(base: dict[str, torch.Tensor], version: int, bucket_bytes: int = 4096, wrong_size: bool = False,
               gpus: tuple[str, ...] = (UUID,)) -> IpcWeights:
    """A cuda_ipc update of the engine's own tensors, each bucket with a fabricated handle on each
    of ``gpus`` (one copy per GPU, as a trainer of several colocated ranks sends)."""
    names = list(base)
    dtypes = [str(t.dtype).removeprefix("torch.") for t in base.values()]
    shapes = [list(t.shape) for t in base.values()]
    sizes = plan_buckets([t.numel() * t.element_size() for t in base.values()], bucket_bytes)
    handles = []
    for i, gpu in enumerate(gpus):
        lo = 0
        for s in sizes:
            total = bucket_layout(dtypes[lo:lo + s], shapes[lo:lo + s])[1] + (64 if wrong_size else 0)
            handles.append(ipc.dumps(ipc.handle_from_reduction(
                *reduction(numel=total, offset=0, handle=bytes([i + 1]) * 64), device_uuid=gpu)))
            lo += s
    return IpcWeights(version=version, names=names, dtypes=dtypes, shapes=shapes, bucket_sizes=sizes, handles=handles)


OTHER = "5b1d2a0c-0000-4000-8000-00000000ef01"


def test_each_gpu_takes_its_own_copy_of_an_update_sent_from_several():
    """A trainer of two colocated ranks sends one handle set per GPU; each engine worker takes the
    set of its GPU, a GPU without one is refused naming the GPUs there are, and a wrong layout is
    refused per copy."""
    from treadle.rollout.engine.weights import WeightMismatch, check_ipc_buckets

    base = {"a": torch.zeros(4), "b": torch.zeros(2, 2), "c": torch.zeros(8)}
    update = ipc_update(base, 1, bucket_bytes=0, gpus=(UUID, OTHER))
    assert len(update.handles) == 6
    for i, gpu in enumerate((UUID, OTHER)):
        mine = [ipc.loads(h) for h in check_ipc_buckets(update, gpu)]
        assert [h.device_uuid for h in mine] == [gpu] * 3 and {h.storage_handle for h in mine} == {bytes([i + 1]) * 64}
    with pytest.raises(ipc.IpcHandleError, match=f"buffers are on GPU\\(s\\) {UUID}, {OTHER}, this engine on abc"):
        check_ipc_buckets(update, "abc")
    with pytest.raises(WeightMismatch, match="layout needs"):
        check_ipc_buckets(ipc_update(base, 1, wrong_size=True, gpus=(OTHER,)), OTHER)
    twice = msgspec.structs.replace(update, handles=update.handles[:3] * 2)  # two copies claim one GPU
    with pytest.raises(ipc.IpcHandleError, match=f"6 handles on GPU {UUID} for 3 buckets"):
        check_ipc_buckets(twice, UUID)


def test_an_update_with_a_handle_count_other_than_its_buckets_is_refused_by_the_record():
    update = ipc_update({"a": torch.zeros(4), "b": torch.zeros(2, 2)}, 1, bucket_bytes=0)
    with pytest.raises(ValueError, match="3 handles for 2 buckets"):
        msgspec.structs.replace(update, handles=update.handles + update.handles[:1])


def test_engines_refuse_cuda_ipc_they_cannot_open_and_stay_usable(subject):
    engine, before = subject.engine, subject.engine.weight_version
    prompt = np.arange(3, 20)
    scores = subject.aio(engine.prompt_logprobs(prompt))
    match = "CUDA device" if subject.name == "hf" else "does not take"
    for update in (ipc_update(subject.base, before + 1), ipc_update(subject.base, before + 1, wrong_size=True)):
        with pytest.raises(BadRequest, match=match):
            subject.aio(engine.update_weights(update))
    assert engine.weight_version == before and not engine.stats().broken and not engine.stats().paused
    np.testing.assert_array_equal(subject.aio(engine.prompt_logprobs(prompt)), scores)

