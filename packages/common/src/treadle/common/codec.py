"""The wire codec: a msgpack header frame plus raw array buffers, no pickle.

A message is a list of frames. Frame 0 is a msgpack map::

    {"v": PROTOCOL_MAJOR, "id": <request id>, "op": <op>, "method": <name>,
     "type": <record wire name>, "body": <the record as a msgpack map>}

Arrays inside the body are msgpack extension values: ``EXT_BUFFER`` points at a later frame
(``[frame_index, dtype, shape, lib]``, the buffer itself is sent with ``copy=False`` and read
back with ``np.frombuffer``: no copy on either side); arrays below ``inline_max`` bytes travel
inside the header as ``EXT_INLINE`` (``[dtype, shape, lib, bytes]``), which is cheaper than an
extra frame. ``lib`` is ``"np"`` or ``"pt"``: torch tensors come back as torch tensors (bf16 and
fp8 included) when torch is importable. Decoding validates every field's type against the
record's annotations; anything unexpected raises ``CodecError`` naming what and where.

Not here: sockets and request lifecycles (``rpc``); the records themselves (``records``).
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Generic, Literal, TypeVar

import msgspec
import numpy as np

from treadle.common.errors import CodecError, FrameTooLarge, VersionMismatch
from treadle.common.records import RECORD_TYPES, Record

PROTOCOL_MAJOR = 1
"""Bumped on any change an older peer cannot decode; a mismatch is a ``VersionMismatch``."""
INLINE_MAX_BYTES = 2048
"""Arrays smaller than this travel inside the header instead of as their own frame."""
EXT_BUFFER = 1
EXT_INLINE = 2
MAX_NDIM = 32

Op = Literal["call", "reply", "chunk", "end", "cancel", "error", "data"]
OPS: frozenset[str] = frozenset(("call", "reply", "chunk", "end", "cancel", "error", "data"))

# Canonical dtype names -> numpy storage dtype. bf16 / fp8 are stored as same-width ints.
_NP_STORAGE: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in ("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", "float32", "float64", "complex64", "complex128")
}
_NP_STORAGE.update({
    "bfloat16": np.dtype("uint16"), "float8_e4m3fn": np.dtype("uint8"), "float8_e5m2": np.dtype("uint8"),
})
_TORCH_ONLY = frozenset(("bfloat16", "float8_e4m3fn", "float8_e5m2"))
# numpy dtype -> canonical name; dtype.name is slow on the hot path, a dict lookup is not.
# Big-endian dtypes hash differently, miss here, and are refused.
_NAME_OF: dict[np.dtype, str] = {dt: name for name, dt in _NP_STORAGE.items() if name not in _TORCH_ONLY}


class Envelope(msgspec.Struct, kw_only=True):
    """The header frame as it travels; ``body`` stays raw until its type is known."""

    v: int = PROTOCOL_MAJOR
    id: int = 0
    op: str = "call"
    method: str = ""
    type: str = ""
    body: msgspec.Raw = msgspec.Raw(b"\xc0")


class Message(msgspec.Struct, kw_only=True, frozen=True):
    """What ``decode`` returns."""

    v: int
    """Protocol major version of the sender."""
    id: int
    """Request id (the client's counter; replies echo it)."""
    op: str
    """One of ``OPS``."""
    method: str
    """Handler name on the server ("generate", "health", ...); may be empty on replies."""
    msg: Record | None
    """The record, or None when the message has no body."""


_tls = threading.local()
# What decoding hostile bytes can raise. RecursionError: msgpack nested deeper than msgspec's
# limit (a few hundred levels); without it here such a message escaped as a non-treadle error
# and the server dropped it unanswered.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError, RecursionError)
_HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(Envelope)


def _torch():
    """torch if it is already imported or importable; None otherwise (common never needs it)."""
    mod = sys.modules.get("torch")
    if mod is not None:
        return mod
    try:
        import torch  # noqa: PLC0415  (heavy import at the leaf, only when a tensor shows up)
    except ImportError:
        return None
    return torch


def _array_parts(obj: Any) -> tuple[np.ndarray, str, str]:
    """(contiguous numpy storage view, canonical dtype name, lib) of an ndarray or tensor."""
    if isinstance(obj, np.generic):  # numpy scalar: a 0-d array on the wire
        obj = np.asarray(obj)
    if isinstance(obj, np.ndarray):
        arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj).reshape(obj.shape)
        name = _NAME_OF.get(arr.dtype)
        if name is None:
            raise CodecError(f"cannot encode numpy dtype {arr.dtype!s}: supported are {sorted(_NAME_OF)}")
        return arr, name, "np"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _NP_STORAGE:
            raise CodecError(f"cannot encode torch dtype {t.dtype}: supported are {sorted(_NP_STORAGE)}")
        storage = _NP_STORAGE[name]
        if name in _TORCH_ONLY:
            t = t.view(getattr(torch, storage.name))
        return t.numpy(), name, "pt"
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _enc_hook(obj: Any) -> Any:
    try:
        arr, name, lib = _array_parts(obj)
    except TypeError:
        raise NotImplementedError(f"treadle codec cannot encode {type(obj).__name__}: no pickle on the wire") from None
    shape = list(arr.shape)
    if arr.nbytes < _tls.inline_max or arr.nbytes == 0:
        return msgspec.msgpack.Ext(EXT_INLINE, msgspec.msgpack.encode([name, shape, lib, arr.tobytes()]))
    buffers = _tls.buffers
    buffers.append(arr)  # non-empty here (nbytes >= inline_max > 0); sent as-is, no copy
    return msgspec.msgpack.Ext(EXT_BUFFER, msgspec.msgpack.encode([len(buffers), name, shape, lib]))


_BODY_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_encode_item = _HEADER_ENCODER.encode
# The header is the msgpack map of ``Envelope`` (all six fields, in declaration order), built
# from cached pieces: "v" and "id" keys, the id, then the op / method / type entries (a handful
# of distinct triples per process), then the body. Byte for byte what encoding an ``Envelope``
# gives (the goldens pin it), at about half the cost for a small record.
_HEAD = b"\x86" + _encode_item("v") + _encode_item(PROTOCOL_MAJOR) + _encode_item("id")
_SMALL_IDS = [_encode_item(i) for i in range(128)]
_MIDDLES: dict[tuple[str, str, str], bytes] = {}
_MAX_MIDDLES = 4096
_NIL_BODY = b"\xc0"


_WIRE_NAMES: dict[type, str] = {}
"""Record class -> wire name: a dict hit costs a fraction of ``isinstance`` on a msgspec Struct."""


def _wire_name(msg: Any) -> str:
    if not isinstance(msg, Record):
        raise CodecError(f"can only encode treadle records, got {type(msg).__name__}")
    name = _WIRE_NAMES[type(msg)] = msg.wire_name
    return name


def _middle(op: str, method: str, type_name: str) -> bytes:
    """The encoded ``op``, ``method``, ``type`` entries and the ``body`` key."""
    if op not in OPS:
        raise CodecError(f"unknown op {op!r}; expected one of {sorted(OPS)}")
    if len(_MIDDLES) >= _MAX_MIDDLES:  # a peer inventing method names must not grow this forever
        _MIDDLES.clear()
    mid = _MIDDLES[(op, method, type_name)] = b"".join(map(_encode_item, (
        "op", op, "method", method, "type", type_name, "body")))
    return mid


def encode(msg: Record | None, *, id: int = 0, op: Op = "call", method: str = "",
           inline_max: int = INLINE_MAX_BYTES) -> list[Any]:
    """Frames for ``msg``: ``[header_bytes, buffer, buffer, ...]``; buffers are not copied."""
    type_name = "" if msg is None else _WIRE_NAMES.get(type(msg)) or _wire_name(msg)
    mid = _MIDDLES.get((op, method, type_name)) or _middle(op, method, type_name)
    idb = _SMALL_IDS[id] if type(id) is int and 0 <= id < 128 else _encode_item(id)
    if msg is None:
        return [b"".join((_HEAD, idb, mid, _NIL_BODY))]
    tls = _tls
    tls.buffers = buffers = []
    tls.inline_max = inline_max
    try:
        body = _BODY_ENCODER.encode(msg)
    except (NotImplementedError, TypeError, OverflowError) as e:
        buffers.clear()
        raise CodecError(f"cannot encode {type_name}: {e}") from None
    header = b"".join((_HEAD, idb, mid, body))
    return [header, *buffers] if buffers else [header]


def _check_shape(shape: Any, where: str) -> tuple[int, ...]:
    if type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:
        return (shape[0],)  # the common case, fast
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise CodecError(f"{where}: shape must be a list of at most {MAX_NDIM} ints, got {shape!r}")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise CodecError(f"{where}: shape entries must be ints >= 0, got {shape!r}")
    return tuple(shape)


def _make_array(buf: Any, name: Any, shape: Any, lib: Any, where: str) -> Any:
    if name not in _NP_STORAGE:
        raise CodecError(f"{where}: unknown dtype {name!r}")
    if lib not in ("np", "pt"):
        raise CodecError(f"{where}: unknown array library {lib!r}")
    dims = _check_shape(shape, where)
    storage = _NP_STORAGE[name]
    want = math.prod(dims) * storage.itemsize
    if len(buf) != want:
        raise CodecError(f"{where}: {len(buf)} bytes, but shape {list(dims)} of {name} needs {want}")
    if not want:
        arr = np.zeros(dims, dtype=storage)
    else:
        arr = np.frombuffer(buf, dtype=storage)
        if len(dims) != 1:
            arr = arr.reshape(dims)
    if lib == "np" and name not in _TORCH_ONLY:
        return arr
    torch = _torch()
    if torch is None:
        if name in _TORCH_ONLY:
            raise CodecError(f"{where}: a {name} tensor arrived but torch is not installed to hold it")
        return arr
    with warnings.catch_warnings():  # tensors alias the receive buffer: read-only by contract
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(getattr(torch, name)) if name in _TORCH_ONLY else t


def _ext_hook(code: int, data: memoryview) -> Any:
    try:
        parts = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as e:
        raise CodecError(f"array extension {code}: {e}") from None
    if code == EXT_INLINE:
        if not (isinstance(parts, list) and len(parts) == 4 and isinstance(parts[3], bytes)):
            raise CodecError(f"inline array must be [dtype, shape, lib, bytes], got {str(parts)[:200]}")
        return _make_array(parts[3], parts[0], parts[1], parts[2], "inline array")
    if code == EXT_BUFFER:
        if not (isinstance(parts, list) and len(parts) == 4 and isinstance(parts[0], int)):
            raise CodecError(f"buffer array must be [index, dtype, shape, lib], got {str(parts)[:200]}")
        frames = getattr(_tls, "frames", None)  # None: a one-frame message, nothing to refer to
        index = parts[0]
        n = 1 if frames is None else len(frames)
        if not 1 <= index < n:
            raise CodecError(f"array refers to frame {index}, but the message has {n} frames")
        _tls.used.add(index)
        return _make_array(frames[index], parts[1], parts[2], parts[3], f"frame {index}")
    raise CodecError(f"unknown msgpack extension type {code}")


_BODY_DECODERS: dict[str, msgspec.msgpack.Decoder] = {}


def _body_decoder(type_name: str) -> msgspec.msgpack.Decoder:
    dec = _BODY_DECODERS.get(type_name)
    if dec is None:
        cls = RECORD_TYPES.get(type_name)
        if cls is None:
            raise CodecError(f"unknown record type {type_name[:80]!r}; known: {sorted(RECORD_TYPES)}")
        dec = _BODY_DECODERS[type_name] = msgspec.msgpack.Decoder(cls, ext_hook=_ext_hook)
    return dec


def _as_buffer(frame: Any) -> bytes | memoryview:
    """A flat byte view of a frame (bytes, zmq.Frame received with copy=False, ndarray, ...)."""
    if type(frame) is bytes:
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    mv = memoryview(buf if buf is not None else frame)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def peek_header(frame0: Any) -> Envelope:
    """Decode only the header frame (version, id, op, method, type); raises CodecError."""
    try:
        env = _HEADER_DECODER.decode(_as_buffer(frame0))
    except _DECODE_ERRORS as e:
        raise CodecError(f"header frame is not a treadle header: {e}") from None
    return env


def decode(frames: Sequence[Any], *, max_frame_bytes: int | None = None) -> Message:
    """The ``Message`` in ``frames``; raises ``CodecError`` (or a subclass) on anything wrong."""
    env, msg = decode_parts(frames, max_frame_bytes)
    return Message(v=env.v, id=env.id, op=env.op, method=env.method, msg=msg)


def decode_parts(frames: Sequence[Any], max_frame_bytes: int | None = None) -> tuple[Envelope, Record | None]:
    """``decode`` as (checked header, record): the RPC layer's hot path, one object fewer.

    The header's ``v`` and ``op`` are checked; its ``body`` is the raw record and ``type`` its name.
    """
    if len(frames) != 1:
        return _decode_frames(frames, max_frame_bytes)
    # One frame (the common small request): no buffer frames, so no bookkeeping of their use.
    buf = frames[0]
    if type(buf) is not bytes:
        buf = _as_buffer(buf)
    if max_frame_bytes is not None and len(buf) > max_frame_bytes:
        raise FrameTooLarge(f"frame 0 has {len(buf)} bytes; the limit is {max_frame_bytes}")
    try:
        env = _HEADER_DECODER.decode(buf)
    except _DECODE_ERRORS:
        env = _checked_header(buf)  # raises the CodecError naming the problem
    if env.v != PROTOCOL_MAJOR or env.op not in OPS:
        _checked_header(buf)  # raises VersionMismatch or CodecError
    type_name = env.type
    if not type_name:
        return env, None
    decoder = _BODY_DECODERS.get(type_name) or _body_decoder(type_name)
    try:
        return env, decoder.decode(env.body)
    except CodecError:
        raise
    except _DECODE_ERRORS as e:
        raise CodecError(f"bad {type_name} body: {e}") from None


def _checked_header(buf: bytes | memoryview) -> Envelope:
    try:
        env = _HEADER_DECODER.decode(buf)
    except _DECODE_ERRORS as e:
        raise CodecError(f"header frame is not a treadle header: {e}") from None
    if env.v != PROTOCOL_MAJOR:
        raise VersionMismatch(f"peer speaks treadle protocol v{env.v}; this side speaks v{PROTOCOL_MAJOR}")
    if env.op not in OPS:
        raise CodecError(f"unknown op {env.op[:40]!r}; expected one of {sorted(OPS)}")
    return env


def _decode_frames(frames: Sequence[Any], max_frame_bytes: int | None) -> tuple[Envelope, Record | None]:
    """``decode_parts`` of a message with buffer frames (or none at all)."""
    if not frames:
        raise CodecError("empty message: no header frame")
    bufs = [_as_buffer(f) for f in frames]
    if max_frame_bytes is not None:
        for i, b in enumerate(bufs):
            if len(b) > max_frame_bytes:
                raise FrameTooLarge(f"frame {i} has {len(b)} bytes; the limit is {max_frame_bytes}")
    env = _checked_header(bufs[0])
    if not env.type:
        raise CodecError(f"message without a body carries {len(bufs) - 1} extra frames")
    decoder = _BODY_DECODERS.get(env.type) or _body_decoder(env.type)
    used: set[int] = set()
    _tls.frames, _tls.used = bufs, used
    try:
        msg = decoder.decode(env.body)
    except CodecError:
        raise
    except _DECODE_ERRORS as e:
        raise CodecError(f"bad {env.type} body: {e}") from None
    finally:
        _tls.frames = _tls.used = None
    if len(used) != len(bufs) - 1:
        raise CodecError(f"message has {len(bufs) - 1} buffer frames but the body refers to {len(used)}")
    return env, msg


T = TypeVar("T")


class _TypedEnvelope(msgspec.Struct, Generic[T], kw_only=True):
    """The header with its body decoded as ``T`` in the same pass (see ``StreamDecoder``)."""

    v: int = PROTOCOL_MAJOR
    id: int = 0
    op: str = "call"
    method: str = ""
    type: str = ""
    body: T


_TYPED_DECODERS: dict[str, msgspec.msgpack.Decoder] = {}


class StreamDecoder:
    """``decode_parts`` for one stream of messages, betting that a message has the record type
    of the one before it (a server's requests, a client's replies mostly do).

    A one-frame message then decodes in one pass, header and body together, instead of two;
    when the bet fails (another type, or anything wrong with the message) it decodes again the
    general way, which also raises the errors ``decode`` raises, so results are the same.
    """

    __slots__ = ("_type", "_decoder")

    def __init__(self) -> None:
        self._type = ""
        self._decoder: msgspec.msgpack.Decoder | None = None

    def decode(self, frames: Sequence[Any], max_frame_bytes: int | None = None) -> tuple[Any, Record | None]:
        """(header, record) as ``decode_parts`` returns them; the header may be a typed twin."""
        decoder = self._decoder
        if decoder is not None and len(frames) == 1:
            buf = frames[0]
            if type(buf) is bytes and (max_frame_bytes is None or len(buf) <= max_frame_bytes):
                try:
                    env = decoder.decode(buf)
                except Exception:  # noqa: BLE001  (the general path below names the problem)
                    env = None
                if env is not None and env.type == self._type and env.v == PROTOCOL_MAJOR and env.op in OPS:
                    return env, env.body
        env, msg = decode_parts(frames, max_frame_bytes)
        if msg is not None and env.type != self._type:
            self._type = env.type
            self._decoder = _TYPED_DECODERS.get(env.type) or _typed_decoder(env.type)
        return env, msg


def _typed_decoder(type_name: str) -> msgspec.msgpack.Decoder:
    dec = _TYPED_DECODERS[type_name] = msgspec.msgpack.Decoder(
        _TypedEnvelope[RECORD_TYPES[type_name]], ext_hook=_ext_hook)  # type: ignore[misc]
    return dec


def encode_record(msg: Record) -> list[Any]:
    """Frames for storing a record on disk or in a queue (op ``data``, id 0)."""
    return encode(msg, op="data")


def decode_record(frames: Sequence[Any]) -> Record:
    """Inverse of ``encode_record``."""
    msg = decode(frames).msg
    if msg is None:
        raise CodecError("stored message has no record")
    return msg
