"""The weight-update protocol both sides share: bucket layout, the group's spec, the broadcast group."""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch
from treadle_testing import free_port

from treadle.common.errors import BadRequest
from treadle.common.records import WeightGroupSpec
from treadle.common.weights import (
    WeightGroup,
    bucket_layout,
    bucket_ranges,
    bucket_views,
    new_bucket,
    plan_buckets,
    receive_buckets,
)


def test_bucket_layout_aligns_every_tensor_to_64_bytes():
    # nbytes: float32[3] = 12, bfloat16[5] = 10, int64[1] = 8; offsets 0, round_up(12)=64, round_up(74)=128
    offsets, total = bucket_layout(["float32", "bfloat16", "int64"], [[3], [5], [1]])
    assert offsets == [0, 64, 128] and total == 192  # round_up(128 + 8, 64)


def test_plan_buckets_is_greedy_and_isolates_big_tensors():
    # 100 -> 100; +100 -> round_up(100)+100 = 228 <= 256; +100 -> 256+100 > 256: new bucket;
    # 500 alone (> 256); 10 after 500 -> 512+10 > 256: new bucket.
    assert plan_buckets([100, 100, 100, 500, 10], 256) == [2, 1, 1, 1]
    assert plan_buckets([100, 100, 100], 1 << 20) == [3]
    assert plan_buckets([1, 2, 3], 0) == [1, 1, 1]
    assert bucket_ranges([2, 1], 3) == [(0, 2), (2, 3)] and bucket_ranges([], 2) == [(0, 1), (1, 2)]
    with pytest.raises(BadRequest):
        bucket_ranges([2, 2], 3)


def _mixed():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).bfloat16(),
            torch.randint(-9, 9, (4, 2), generator=g), torch.zeros(0), torch.tensor([True, False, True]),
            torch.randn(2, 3, generator=g).half()]


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


def _header(tensors):
    return [str(t.dtype)[6:] for t in tensors], [list(t.shape) for t in tensors]


def _pack(tensors) -> torch.Tensor:
    """What a sender does: the tensors copied into a new bucket at their layout's offsets."""
    flat, views = new_bucket(*_header(tensors))
    for view, t in zip(views, tensors, strict=True):
        view.copy_(t)
    return flat


def test_pack_then_unpack_is_bit_identical():
    tensors = _mixed()
    views = bucket_views(_pack(tensors).clone(), *_header(tensors))
    assert [(_bits(a), a.dtype, a.shape) for a in tensors] == [(_bits(b), b.dtype, b.shape) for b in views]
    with pytest.raises(BadRequest, match=r"uint8\[\d+\]"):
        bucket_views(torch.cat([_pack(tensors)] * 2), *_header(tensors))


def _joined_pair(port: int) -> tuple[WeightGroup, WeightGroup]:
    """A sender (rank 0) and a member (rank 1) of one gloo group, joined together."""
    got: list[WeightGroup] = []
    t = threading.Thread(target=lambda: got.append(
        WeightGroup(WeightGroupSpec(host="127.0.0.1", port=port, world_size=2, rank=1, timeout_s=30))))
    t.start()
    sender = WeightGroup(WeightGroupSpec(host="127.0.0.1", port=port, world_size=2, rank=0, timeout_s=30))
    t.join(30)
    return sender, got[0]


def test_group_broadcast_delivers_bit_identical_tensors():
    tensors = _mixed()
    dtypes, shapes = _header(tensors)
    sizes = plan_buckets([t.numel() * t.element_size() for t in tensors], 100)
    sender, member = _joined_pair(free_port())
    got: list = []

    def receiver():
        got.extend((lo, hi, [v.clone() for v in views]) for lo, hi, views in
                   receive_buckets(member, dtypes, shapes, sizes))
        member.close()

    t = threading.Thread(target=receiver)
    t.start()
    for lo, hi in bucket_ranges(sizes, len(tensors)):
        sender.broadcast(_pack(tensors[lo:hi]))
    t.join(30)
    sender.close()
    assert len(sizes) > 1 and [(lo, hi) for lo, hi, _ in got] == bucket_ranges(sizes, len(tensors))
    assert [_bits(x) for _, _, views in got for x in views] == [_bits(t) for t in tensors]


def test_group_spec_validates():
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"host": "h", "port": 1, "world_size": 2, "rank": 1, "colour": "red"}, WeightGroupSpec)
    with pytest.raises(ValueError, match="world_size"):
        WeightGroupSpec(host="h", port=1, world_size=1, rank=0)
    with pytest.raises(ValueError, match="rank"):
        WeightGroupSpec(host="h", port=1, world_size=2, rank=2)
    with pytest.raises(ValueError, match="TCP port"):
        WeightGroupSpec(host="h", port=0, world_size=2)
    spec = WeightGroupSpec(host="h", port=5, world_size=3, rank=1, backend="nccl")
    assert spec.with_rank(2).rank == 2 and spec.with_rank(2).with_rank(1) == spec


def test_a_relay_passes_every_broadcast_on_to_its_nodes_group():
    """Sender (rank 0) -> relay (rank 1 of the sender's group, rank 0 of "relay/n1") -> two
    members of "relay/n1" and a plain member (rank 2): every receiver gets the sender's bits, and
    the sender's group has 3 ranks instead of 5."""
    tensors = _mixed()
    dtypes, shapes = _header(tensors)
    sizes = plan_buckets([t.numel() * t.element_size() for t in tensors], 100)
    port = free_port()
    top = WeightGroupSpec(host="127.0.0.1", port=port, world_size=3, rank=0, timeout_s=30)
    specs = {"relay": msgspec.structs.replace(top, rank=1, relay_prefix="relay/n1", relay_size=3),
             "plain": top.with_rank(2),
             "r1": msgspec.structs.replace(top, rank=1, world_size=3, prefix="relay/n1"),
             "r2": msgspec.structs.replace(top, rank=2, world_size=3, prefix="relay/n1")}
    got: dict[str, list] = {}

    def receiver(name):
        group = WeightGroup(specs[name])
        got[name] = [_bits(v) for _, _, views in receive_buckets(group, dtypes, shapes, sizes) for v in views]
        group.close()

    threads = [threading.Thread(target=receiver, args=(n,)) for n in specs]
    for t in threads:
        t.start()
    sender = WeightGroup(top)
    for lo, hi in bucket_ranges(sizes, len(tensors)):
        sender.broadcast(_pack(tensors[lo:hi]))
    for t in threads:
        t.join(30)
    sender.close()
    want = [_bits(t) for t in tensors]
    assert sorted(got) == sorted(specs) and all(v == want for v in got.values())
    with pytest.raises(ValueError, match="relay_size >= 2"):
        msgspec.structs.replace(top, relay_prefix="relay/x")
