"""Codec: round trips, zero copy, limits, errors, golden frames of every record type."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from treadle.common.codec import PROTOCOL_MAJOR, decode, encode
from treadle.common.errors import CodecError, FrameTooLarge, VersionMismatch
from treadle.common.records import (
    RECORD_TYPES,
    Control,
    GenerateResult,
    InlineWeights,
    IpcWeights,
    same,
)

_spec = importlib.util.spec_from_file_location("goldens", Path(__file__).with_name("goldens.py"))
goldens = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(goldens)

NP_DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
             "float16", "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


def _weights(tensors):
    return InlineWeights(version=1, names=[f"t{i}" for i in range(len(tensors))],
                         dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                         shapes=[list(t.shape) for t in tensors], tensors=list(tensors))


def roundtrip(rec, **kw):
    return decode(encode(rec, **kw)).msg


@pytest.mark.parametrize("dtype", NP_DTYPES)
@pytest.mark.parametrize("n", [0, 3, 5000])  # empty, inline, out-of-band
def test_numpy_dtypes_roundtrip(dtype, n):
    a = (np.arange(n) % 7).astype(dtype)
    out = roundtrip(_weights([a])).tensors[0]
    assert isinstance(out, np.ndarray) and out.dtype == a.dtype and out.shape == a.shape
    assert np.array_equal(out, a)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 4), (64, 100)])
def test_torch_dtypes_roundtrip_bitwise(dtype, shape):
    t = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(0, 2, shape).to(dtype)
    out = roundtrip(_weights([t])).tensors[0]
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and tuple(out.shape) == shape
    assert same(out, t)


def test_scalar_and_noncontiguous_arrays():
    scalar = np.full((), 2.5)
    strided = np.arange(200, dtype=np.int64).reshape(10, 20)[:, ::3]
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    t_strided = torch.arange(1000.0).reshape(10, 100).t()
    out = roundtrip(_weights([scalar, strided, fortran, t_strided])).tensors
    assert out[0].shape == () and out[0] == 2.5
    assert np.array_equal(out[1], strided) and np.array_equal(out[2], fortran)
    assert torch.equal(out[3], t_strided)


def test_large_payload_is_zero_copy_both_ways():
    big = np.ones(300 * 2**20, dtype=np.uint8)  # 300 MiB
    big[::4096] = 7
    frames = encode(_weights([big]))
    assert len(frames) == 2 and np.shares_memory(frames[1], big)  # sent without a copy
    out = decode(frames).msg.tensors[0]
    assert np.shares_memory(out, frames[1])  # read back without a copy
    assert out.nbytes == big.nbytes and out[4096] == 7


def test_inline_threshold_decides_frames():
    a = np.zeros(100, np.float32)  # 400 bytes
    assert len(encode(_weights([a]))) == 1
    assert len(encode(_weights([a]), inline_max=100)) == 2


def test_no_pickle_for_foreign_objects():
    class Foreign:
        pass

    with pytest.raises(ValueError, match="Foreign is not a msgpack-native type"):
        Control(op="x", args={"obj": Foreign()})
    with pytest.raises(CodecError, match="cannot encode Foreign"):
        encode(IpcWeights(version=1, names=["a"], dtypes=["x"], shapes=[[1]], handles=[Foreign()]))
    with pytest.raises(CodecError):
        encode(Foreign())  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        encode(_weights([np.array([object()], dtype=object)]))


def _header(**fields):
    return msgspec.msgpack.encode({"v": PROTOCOL_MAJOR, "id": 1, "op": "call", **fields})


@pytest.mark.parametrize("frames, match", [
    ([], "empty message"),
    ([b"\x93\x01"], "not a treadle header"),
    ([b"\xc1"], "not a treadle header"),
    ([msgspec.msgpack.encode({"v": 9, "id": 1})], "v9.*v1"),
    ([_header(op="explode")], "unknown op 'explode'"),
    ([_header(type="Nope", body={})], "unknown record type 'Nope'"),
    ([_header(type="Control", body={"op": 5})], "Expected `str`, got `int`"),
    ([_header(type="Control", body={"op": "x", "bogus": 1})], "unknown field `bogus`"),
    ([_header(type="GenerateResult", body={"response_token_ids": 5})], "must be an array, got int 5"),
    ([_header(type="GenerateResult", body={"response_token_ids": msgspec.msgpack.Ext(1, msgspec.msgpack.encode(
        [1, "int32", [4], "np"]))}), b"123"], "3 bytes, but shape \\[4\\] of int32 needs 16"),
    ([_header(type="GenerateResult", body={"response_token_ids": msgspec.msgpack.Ext(1, msgspec.msgpack.encode(
        [5, "int32", [1], "np"]))})], "refers to frame 5"),
    ([_header(type="GenerateResult", body={"response_token_ids": msgspec.msgpack.Ext(2, msgspec.msgpack.encode(
        ["int99", [1], "np", b"1234"]))})], "unknown dtype 'int99'"),
    ([_header(type="GenerateResult", body={"response_token_ids": msgspec.msgpack.Ext(2, msgspec.msgpack.encode(
        ["int32", [-1], "np", b"1234"]))})], "shape entries must be ints >= 0"),
    ([_header(type="GenerateResult", body={"response_token_ids": msgspec.msgpack.Ext(9, b"")})], "extension"),
    ([_header(type="Ack", body={}), b"extra"], "body refers to 0"),
    ([_header(op="cancel"), b"extra"], "without a body"),
])
def test_malformed_frames_raise_codec_error_naming_the_problem(frames, match):
    with pytest.raises(CodecError, match=match):
        decode(frames)


def test_version_mismatch_names_both_versions():
    with pytest.raises(VersionMismatch) as exc:
        decode([msgspec.msgpack.encode({"v": PROTOCOL_MAJOR + 1, "id": 3})])
    assert f"v{PROTOCOL_MAJOR + 1}" in str(exc.value) and f"v{PROTOCOL_MAJOR}" in str(exc.value)


def test_frame_size_limit():
    frames = encode(_weights([np.zeros(10_000, np.uint8)]))
    with pytest.raises(FrameTooLarge, match="frame 1 has 10000 bytes; the limit is 4096"):
        decode(frames, max_frame_bytes=4096)
    assert decode(frames, max_frame_bytes=10_000).msg is not None


def test_record_validation_runs_on_decode():
    bad = _header(type="Trajectory", body={"prompt_token_ids": msgspec.msgpack.Ext(2, msgspec.msgpack.encode(
        ["int32", [1], "np", b"\0\0\0\0"])), "response_token_ids": msgspec.msgpack.Ext(2, msgspec.msgpack.encode(
            ["int32", [2], "np", b"\0" * 8])), "rollout_logprobs": msgspec.msgpack.Ext(2, msgspec.msgpack.encode(
                ["float32", [1], "np", b"\0" * 4])), "loss_mask": msgspec.msgpack.Ext(2, msgspec.msgpack.encode(
                    ["uint8", [2], "np", b"\0\0"]))})
    with pytest.raises(CodecError, match="rollout_logprobs has length 1, expected 2"):
        decode([bad])


@settings(max_examples=150, deadline=None)
@given(arr=hnp.arrays(dtype=st.sampled_from([np.dtype(d) for d in NP_DTYPES]),
                      shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=40)))
def test_property_any_array_roundtrips(arr):
    out = roundtrip(_weights([arr]), inline_max=256).tensors[0]
    assert same(out, arr)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200), st.lists(st.binary(max_size=50), max_size=3))
def test_property_random_bytes_only_ever_raise_codec_error(head, rest):
    with contextlib.suppress(CodecError):
        decode([head, *rest])


def test_trajectory_roundtrip_keeps_everything():
    t = goldens._traj(3, 3000)
    assert same(roundtrip(t), t)


def test_stream_reply_envelope_fields():
    m = decode(encode(GenerateResult(response_token_ids=np.arange(3, dtype=np.int32)), id=77, op="chunk", method="g"))
    assert (m.v, m.id, m.op, m.method) == (PROTOCOL_MAJOR, 77, "chunk", "g")


def test_top_logprobs_travel_as_buffers_and_only_when_asked():
    n, k = 4096, 20  # a long sample with OpenAI's most alternatives: 640 KiB of out-of-band buffers
    rng = np.random.default_rng(0)
    res = GenerateResult(response_token_ids=np.arange(n, dtype=np.int32), logprobs=np.full(n, -1.0, np.float32),
                         top_token_ids=rng.integers(0, 1000, (n, k), dtype=np.int32),
                         top_logprobs=-np.sort(rng.random((n, k), dtype=np.float32), axis=1))
    frames = encode(res)
    assert len(frames) == 5 and max(len(memoryview(f).cast("B")) for f in frames[1:]) == n * k * 4
    assert same(decode(frames, max_frame_bytes=n * k * 4).msg, res)
    plain = GenerateResult(response_token_ids=np.arange(3, dtype=np.int32), logprobs=np.zeros(3, np.float32))
    assert b"top_" not in bytes(memoryview(encode(plain)[0]).cast("B"))  # RL traffic carries none of it


@pytest.mark.parametrize("ids_shape,lps_shape,match", [
    ((3, 2), None, "come together"),
    ((3, 21), (3, 21), r"shape \[3, k\]"),
    ((2, 2), (2, 2), r"shape \[3, k\]"),
    ((3, 2), (3, 3), "must match"),
    ((3,), (3,), r"shape \[3, k\]"),
])
def test_top_logprobs_shapes_are_checked(ids_shape, lps_shape, match):
    with pytest.raises(ValueError, match=match):
        GenerateResult(response_token_ids=np.arange(3, dtype=np.int32), top_token_ids=np.zeros(ids_shape, np.int32),
                       top_logprobs=None if lps_shape is None else np.zeros(lps_shape, np.float32))


def test_every_record_type_has_a_golden_example():
    assert set(goldens.examples()) == set(RECORD_TYPES)


def _golden_files():
    return sorted(goldens.GOLDEN_DIR.glob("v*/*.msgpack"))


@pytest.mark.parametrize("path", _golden_files(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_committed_goldens_decode(path):
    version = int(path.parent.name[1:])
    frames = msgspec.msgpack.decode(path.read_bytes())
    if version != PROTOCOL_MAJOR:  # an older wire: decodes through a compat path, or fails clearly
        with pytest.raises(VersionMismatch, match=f"v{version}"):
            decode(frames)
        return
    rec, kw = goldens.examples()[path.stem]
    msg = decode(frames)
    assert same(msg.msg, rec) and msg.id == kw["id"] and msg.op == kw["op"]


@pytest.mark.parametrize("name", sorted(RECORD_TYPES))
def test_encoding_today_matches_the_goldens_byte_for_byte(name):
    """A failure here means the wire changed: older peers would misread us. Bump PROTOCOL_MAJOR."""
    path = goldens.GOLDEN_DIR / f"v{PROTOCOL_MAJOR}" / f"{name}.msgpack"
    assert path.exists(), f"no golden for {name}: run python {Path(goldens.__file__).name}"
    assert msgspec.msgpack.decode(path.read_bytes()) == goldens.frames_of(name)

