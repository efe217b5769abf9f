"""Weight-update plumbing without an engine: checks, bucket layout, packing, canary, the group."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from treadle_testing import free_port

from treadle.common.errors import BadRequest
from treadle.rollout.engine import group as group_module
from treadle.rollout.engine.group import (
    GroupSpec,
    NoSignal,
    WeightGroup,
    receive_buckets,
    send_buckets,
)
from treadle.rollout.engine.weights import (
    TensorSpec,
    WeightMismatch,
    WeightSpec,
    bucket_layout,
    bucket_ranges,
    byte_splits,
    canary_error,
    mirror_spans,
    model_eos_ids,
    pack_bucket,
    plan_buckets,
    send_order,
    span_views,
    spec_from_checkpoint,
    unpack_bucket,
    word_views,
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



def test_ramped_buckets_start_small_and_double_up_to_the_bucket_size():
    # limits 64, 128, 256, 256...: 60 | 60 (+60 -> 124) | 100, 100 (-> 228) | 200 | 200
    assert plan_buckets([60, 60, 60, 100, 100, 200, 200], 256, ramp=2) == [1, 2, 2, 1, 1]
    assert plan_buckets([60, 60, 60, 100, 100, 200, 200], 256) == [3, 2, 1, 1]  # ramp 0: as before
    assert plan_buckets([500, 10], 256, ramp=3) == [1, 1]  # a tensor over its limit still goes alone
    assert plan_buckets([1, 2], 0, ramp=3) == [1, 1]
    with pytest.raises(ValueError, match="ramp must be >= 0, got -1"):
        plan_buckets([1], 256, ramp=-1)


def test_send_order_puts_tensors_larger_than_a_bucket_last_keeping_each_part_in_order():
    assert send_order([500, 10, 300, 20, 30], 256) == [1, 3, 4, 0, 2]
    assert send_order([500, 10], 0) == [0, 1]
    assert send_order([], 256) == []

def _mixed():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).bfloat16(),
            torch.randint(-9, 9, (4, 2), generator=g), torch.zeros(0), torch.tensor([True, False, True]),
            torch.randn(2, 3, generator=g).half()]


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


def test_pack_then_unpack_is_bit_identical():
    tensors = _mixed()
    flat = pack_bucket(tensors)
    _, views = unpack_bucket([str(t.dtype)[6:] for t in tensors], [list(t.shape) for t in tensors], flat=flat.clone())
    assert [(_bits(a), a.dtype, a.shape) for a in tensors] == [(_bits(b), b.dtype, b.shape) for b in views]


def test_word_views_cut_a_bucket_into_each_tensors_bytes_as_the_widest_word_that_fits():
    def check(tensors, flat, size):
        dtypes, shapes = [str(t.dtype)[6:] for t in tensors], [list(t.shape) for t in tensors]
        got, views = word_views(flat, dtypes, shapes)
        assert got == size and {v.element_size() for v in views} == {size}
        assert [v.view(torch.uint8).tolist() for v in views] == [_bits(t) for t in tensors]
        assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)  # no copy

    mixed = _mixed()  # a 3-byte bool tensor: single bytes
    check(mixed, pack_bucket(mixed), 1)
    g = torch.Generator().manual_seed(1)
    even = [torch.randn(4, 6, generator=g).bfloat16(), torch.randn(2, generator=g), torch.randn(8, generator=g).half()]
    check(even, pack_bucket(even), 8)
    check(even[1:], pack_bucket(even[1:]), 8)
    at4 = torch.empty(pack_bucket(even).numel() + 4, dtype=torch.uint8)[4:]  # a buffer at an offset of 4 bytes
    at4.copy_(pack_bucket(even))
    check(even, at4, 4)
    dtypes, shapes = [str(t.dtype)[6:] for t in even], [list(t.shape) for t in even]
    assert sum(byte_splits(dtypes, shapes)) == pack_bucket(even).numel()
    with pytest.raises(WeightMismatch, match=r"uint8\[\d+\], layout needs uint8\[\d+\]"):
        word_views(torch.cat([pack_bucket(even)] * 2), dtypes, shapes)


def test_span_views_give_each_span_in_the_order_asked_overlaps_included():
    flat = torch.arange(64, dtype=torch.uint8)
    size, views = span_views(flat, [(40, 16), (0, 8), (16, 16)])  # out of order, with gaps
    assert size == 8 and [v.view(torch.uint8).tolist() for v in views] == [
        list(range(40, 56)), list(range(8)), list(range(16, 32))]
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)  # no copy
    size, views = span_views(flat, [(0, 16), (8, 8), (20, 2)])  # one tensor's bytes under two names; 2-byte words
    assert size == 2 and [v.view(torch.uint8).tolist() for v in views] == [
        list(range(16)), list(range(8, 16)), [20, 21]]
    assert span_views(flat[3:], [(1, 4)])[0] == 1  # the buffer's own offset counts
    with pytest.raises(WeightMismatch, match="up to 72 do not lie inside a buffer of 64 bytes"):
        span_views(flat, [(56, 16)])


def _joined_pair(port: int) -> tuple[WeightGroup, WeightGroup]:
    """A sender (rank 0) and a member (rank 1) of one gloo group, joined together."""
    got: list[WeightGroup] = []
    t = threading.Thread(target=lambda: got.append(
        WeightGroup(GroupSpec(host="127.0.0.1", port=port, world_size=2, rank=1, timeout_s=30))))
    t.start()
    sender = WeightGroup(GroupSpec(host="127.0.0.1", port=port, world_size=2, rank=0, timeout_s=30))
    t.join(30)
    return sender, got[0]


def test_group_broadcast_delivers_bit_identical_tensors():
    tensors = _mixed()
    dtypes, shapes = [str(t.dtype)[6:] for t in tensors], [list(t.shape) for t in tensors]
    sizes = plan_buckets([t.numel() * t.element_size() for t in tensors], 100)
    sender, member = _joined_pair(free_port())
    got: list = []

    def receiver():
        got.extend((n, t.clone()) for n, t in receive_buckets(member, [f"t{i}" for i in range(6)], dtypes, shapes,
                                                             sizes, skip=frozenset({"t1"})))
        member.close()

    t = threading.Thread(target=receiver)
    t.start()
    send_buckets(sender, tensors, sizes)
    t.join(30)
    sender.close()
    assert len(sizes) > 1 and [n for n, _ in got] == ["t0", "t2", "t3", "t4", "t5"]
    assert [_bits(x) for _, x in got] == [_bits(tensors[i]) for i in (0, 2, 3, 4, 5)]


def test_a_signal_wait_ends_on_the_signal_or_when_its_group_closes_even_as_it_starts(monkeypatch):
    """``wait_signal`` returns the sender's go / no for its version (older versions' signals are
    skipped); ``close`` ends a wait with ``NoSignal``, also one that was only starting when the
    close came (the close used to miss it, and the wait sat out its whole timeout)."""
    sender, member = _joined_pair(free_port())
    sender.signal(1, True)
    sender.signal(2, False)  # overwrites: the member armed for 2 sees only this one
    assert member.wait_signal(2, 10) is False
    threading.Timer(0.3, lambda: sender.signal(3, True)).start()
    assert member.wait_signal(3, 10) is True
    with pytest.raises(NoSignal, match="within 0.2 s"):
        member.wait_signal(4, 0.2)

    starting, real = threading.Event(), group_module._prefixed

    def slow_start(store, prefix):  # the waiter is inside wait_signal, not yet on the store
        if threading.current_thread().name == "waiter":
            starting.set()
            time.sleep(0.5)
        return real(store, prefix)

    monkeypatch.setattr(group_module, "_prefixed", slow_start)
    ended: list[BaseException] = []

    def wait() -> None:
        try:
            member.wait_signal(5, 60)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            ended.append(e)

    waiter = threading.Thread(target=wait, name="waiter", daemon=True)
    waiter.start()
    assert starting.wait(10)
    member.close()
    waiter.join(20)
    assert len(ended) == 1 and isinstance(ended[0], NoSignal) and "closed" in str(ended[0])
    with pytest.raises(NoSignal, match="closed before"):
        member.wait_signal(6, 10)
    sender.close()


def test_group_spec_validates():
    with pytest.raises(BadRequest, match="unknown keys"):
        GroupSpec.from_dict({"host": "h", "port": 1, "world_size": 2, "rank": 1, "colour": "red"})
    with pytest.raises(BadRequest, match="world_size"):
        GroupSpec(host="h", port=1, world_size=1, rank=0)
    with pytest.raises(BadRequest, match="rank"):
        GroupSpec(host="h", port=1, world_size=2, rank=2)
    spec = GroupSpec(host="h", port=5, world_size=3, rank=1, backend="nccl")
    assert GroupSpec.from_dict(spec.as_dict()) == spec and spec.with_rank(2).rank == 2


SPEC = WeightSpec(required={"a": TensorSpec((2, 3), "float32"), "b": TensorSpec((4,), "float32")},
                  ignored={"lm_head.weight": TensorSpec((2, 3), "float32")})


def test_spec_accepts_exact_header_and_tied_head():
    SPEC.check_header(["b", "a"], ["float32"] * 2, [[4], [2, 3]])
    SPEC.check_header(["a", "b", "lm_head.weight"], ["float32"] * 3, [[2, 3], [4], [2, 3]])
    assert SPEC.skip == {"lm_head.weight"}


@pytest.mark.parametrize("names,dtypes,shapes,message", [
    (["a", "b", "c"], ["float32"] * 3, [[2, 3], [4], [1]], "c: no such tensor"),
    (["a", "b"], ["float32"] * 2, [[3, 2], [4]], r"a: shape \[3, 2\], the model has \[2, 3\]"),
    (["a", "b"], ["float32", "bfloat16"], [[2, 3], [4]], "b: dtype bfloat16, the engine serves float32"),
    (["a"], ["float32"], [[2, 3]], "missing 1 tensor.*: b"),
    (["a", "a", "b"], ["float32"] * 3, [[2, 3], [2, 3], [4]], "a: sent twice"),
])
def test_spec_refuses_with_a_message_naming_the_problem(names, dtypes, shapes, message):
    with pytest.raises(WeightMismatch, match=message):
        SPEC.check_header(names, dtypes, shapes)


def test_spec_checks_tensors_against_their_header():
    with pytest.raises(WeightMismatch, match="tensor b is float64"):
        SPEC.check_tensors(["a", "b"], ["float32"] * 2, [[2, 3], [4]], [torch.zeros(2, 3), np.zeros(4)])
    SPEC.check_tensors(["a", "b"], ["float32"] * 2, [[2, 3], [4]], [torch.zeros(2, 3), np.zeros(4, np.float32)])


def test_spec_from_checkpoint_reads_safetensors_headers(models):
    spec = spec_from_checkpoint(models["a"])
    assert spec.required["model.embed_tokens.weight"] == TensorSpec((512, 64), "float32")
    assert len(spec.required) == 26 and set(spec.ignored) == {"lm_head.weight"}  # tied: 1 + 2*12 + 1
    assert {s.dtype for s in spec_from_checkpoint(models["a"], dtype="bfloat16").required.values()} == {"bfloat16"}


def test_model_eos_ids_come_from_generation_config(models, tmp_path):
    assert model_eos_ids(models["a"]) == (0, 2)  # the tiny model's <|endoftext|>, <|im_end|>
    (tmp_path / "config.json").write_text('{"eos_token_id": 7}')
    assert model_eos_ids(tmp_path) == (7,)


def test_canary_error():
    e = np.array([-1.0, -2.0, -3.0])
    assert canary_error(e, e + 5e-4, 1e-3) is None
    assert "position 1" in canary_error(e, e + np.array([0, 0.5, 0]), 1e-3)
    assert canary_error(e, np.array([-1.0, np.nan, -3.0]), 1e-3) is not None
    assert "2 prompt logprobs" in canary_error(e, e[:2], 1e-3)




def test_mirror_spans_cover_each_storages_tensors_from_an_aligned_start():
    # storage 0: a bf16 tensor at 300 and an fp32 one at 304; storage 1: one fp32 tensor at 1024
    pieces = [(0, 300, 4), (0, 304, 8), (1, 1024, 16)]
    dtypes = ["bfloat16", "float32", "float32"]
    assert mirror_spans(dtypes, pieces, {0: [1, 0], 1: [2]}) is None  # [256, 312) is mostly other bytes
    pieces = [(0, 260, 40), (0, 300, 200), (1, 1024, 16)]
    assert mirror_spans(dtypes, pieces, {0: [1, 0], 1: [2]}) == [(0, 256, 500), (1, 1024, 1040)]
    assert mirror_spans(dtypes, pieces, {0: [0, 1], 1: []}) == [(0, 256, 500)]


@pytest.mark.parametrize("pieces, why", [
    ([(0, 256, 40), (0, 290, 200)], "overlap"),
    ([(0, 256, 40), (0, 298, 200)], "an fp32 tensor at a 2-byte offset"),
])
def test_mirror_spans_refuse_what_one_buffer_cannot_hold(pieces, why):
    assert mirror_spans(["bfloat16", "float32"], pieces, {0: [0, 1]}) is None, why
