"""Fuzzing helpers of the chaos suite: hostile ZeroMQ messages and a pipelined flood through one
DEALER that says which went unanswered; malformed HTTP bodies and a sender that tallies answers.

``Fuzzer(seed, bases, fixed, limit).message()`` -> one multipart message (``list[bytes]``): random
bytes of varied lengths, random msgpack, or a valid request (a ``Base`` encoded with a fresh id)
mutated: bit flips, byte edits, truncation, extension (past the frame limit now and then),
frames swapped / duplicated / dropped / added, header fields or body fields replaced with values
of the wrong type, declared lengths far beyond the data, deep nesting, other ops and versions.
``fixed`` messages (hand-made wrong-valued calls of a daemon's own methods, ``patched``) are
sent as they are, never mutated, so no mutation can turn them into a valid state-changing call.

``expected_id(frames, limit)`` says what the protocol promises for a message (``server.py``):
exactly one terminal reply (``reply``, ``end`` or ``error``) carrying the header's id when the
header frame can be read, else id 0; none for a well-formed ``cancel``. ``flood`` sends the
messages with a window of replies outstanding and counts, per id, terminal replies expected
against received: ``unanswered`` and ``extra`` must both be 0.

Silent by design (not counted as expected): a well-formed ``cancel`` (the protocol has no reply
for it), and a frame above libzmq's ``ZMQ_MAXMSGSIZE`` hard net, which makes libzmq drop the
connection before the server sees anything (``drop_oversize`` checks that case on its own
socket: no reply, and the same socket is served again once it has reconnected).

HTTP: ``HttpCases(seed, valid, max_body).take(n)`` -> bodies around an endpoint's valid body
(truncated, garbage, bad UTF-8, wrong types, huge numbers, deep nesting, odd content types and
encodings, lone surrogates, oversized, a gzip bomb); ``send_cases`` tallies statuses, 5xx and
4xx bodies that are not JSON errors.

Not here: starting daemons (``conftest``), what each daemon is sent (``test_fuzz``).
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from treadle.common.codec import EXT_INLINE, decode, decode_parts, encode, peek_header
from treadle.common.records import Record

MsgpackExt = msgspec.msgpack.Ext
HEADER_KEYS = ("v", "id", "op", "method", "type", "body")
TYPE_NAMES = ("GenerateRequest", "Control", "RewardRequest", "Error", "WeightUpdate", "Trajectory", "NoSuchRecord",
              "__class__", "")
WEIRD_STRINGS = ("", "call", "cancel", "reply", "chunk", "end", "error", "data", "CALL", "health\x00",
                 "é" * 40, "x" * 5000, "\ud7ff", *TYPE_NAMES)
EDGE_INTS = (0, -1, 1, 2, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
             2**63 - 1, -(2**63), 2**64 - 1)
EDGE_FLOATS = (0.0, -0.0, 1e308, -1e308, 5e-324, float("inf"), float("-inf"), float("nan"))
# Byte strings that declare a length (or element count) far beyond the bytes that follow.
HUGE_DECLARED = (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
                 b"\xdb\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff",
                 b"\xc5\xff\xff", b"\xda\xff\xff", b"\xc8\xff\xff\x02")


@dataclass(frozen=True, slots=True, kw_only=True)
class Base:
    """A valid request to mutate: ``method`` called with ``record`` (None: no body)."""

    method: str
    record: Record | None = None
    weight: float = 1.0

    def frames(self, rid: int) -> list[bytes]:
        return [bytes(f) for f in encode(self.record, id=rid, op="call", method=self.method)]


def native(rnd: random.Random, depth: int = 0) -> Any:
    """A random msgpack-native value: scalars at the edges of their types, short containers."""
    k = rnd.randrange(10 if depth < 3 else 6)
    if k == 0:
        return None
    if k == 1:
        return rnd.random() < 0.5
    if k == 2:
        return rnd.choice(EDGE_INTS) if rnd.random() < 0.7 else rnd.randrange(-(2**40), 2**40)
    if k == 3:
        return rnd.choice(EDGE_FLOATS) if rnd.random() < 0.7 else rnd.uniform(-1e6, 1e6)
    if k == 4:
        return rnd.choice(WEIRD_STRINGS) if rnd.random() < 0.5 else rnd.randbytes(rnd.randrange(12)).decode("latin-1")
    if k == 5:
        return rnd.randbytes(rnd.randrange(40))
    if k == 6:
        return MsgpackExt(rnd.choice((1, 2, 3, -1, 127)), rnd.randbytes(rnd.randrange(24)))
    if k in (7, 8):
        return [native(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    return {rnd.choice((*HEADER_KEYS, "args", "op", "prompt_token_ids", "sampling", "queries", "x")):
            native(rnd, depth + 1) for _ in range(rnd.randrange(4))}


def deep(depth: int) -> bytes:
    """``depth`` nested one-element msgpack arrays around nil (past any recursion limit)."""
    return b"\x91" * depth + b"\xc0"


class Fuzzer:
    """Deterministic (``seed``) stream of hostile messages for one daemon."""

    def __init__(self, seed: int, bases: list[Base], fixed: list[list[bytes]], limit: int,
                 first_id: int = 1_000_000) -> None:
        self.rnd = random.Random(seed)
        self.bases, self.weights = bases, [b.weight for b in bases]
        self.fixed, self.limit = fixed, limit
        self.next_id = first_id
        self.kinds: Counter[str] = Counter()
        self._table: list[tuple[str, Callable[[], list[bytes]], float]] = [
            ("random", self._random, 14), ("msgpack", self._msgpack, 8), ("flip", self._flip, 16),
            ("edit", self._edit, 8), ("truncate", self._truncate, 7), ("extend", self._extend, 5),
            ("frames", self._frames, 9), ("header", self._header, 11), ("body", self._body, 10),
            ("declared", self._declared, 4), ("nesting", self._nesting, 1.5), ("op", self._op, 4),
            ("fixed", self._fixed, 1.5)]

    def message(self) -> list[bytes]:
        name, make, _ = self.rnd.choices(self._table, weights=[w for *_, w in self._table])[0]
        self.kinds[name] += 1
        frames = make()
        return frames or [b""]

    # ---- pieces -------------------------------------------------------------------------

    def _length(self) -> int:
        r = self.rnd.random()
        if r < 0.05:
            return 0
        if r < 0.55:
            return self.rnd.randrange(1, 32)
        if r < 0.9:
            return self.rnd.randrange(32, 512)
        if r < 0.9995:
            return self.rnd.randrange(512, 16384)
        return self.limit + self.rnd.randrange(1, 4096)  # past the frame limit: frame_too_large

    def _valid(self) -> list[bytes]:
        base = self.rnd.choices(self.bases, weights=self.weights)[0]
        self.next_id += 1
        return base.frames(self.next_id)

    def _header_map(self) -> tuple[dict[str, Any], list[bytes]]:
        frames = self._valid()
        return msgspec.msgpack.decode(frames[0]), frames

    # ---- kinds --------------------------------------------------------------------------

    def _random(self) -> list[bytes]:
        return [self.rnd.randbytes(self._length()) for _ in range(self.rnd.choice((1, 1, 1, 2, 3, 5)))]

    def _msgpack(self) -> list[bytes]:
        value = native(self.rnd) if self.rnd.random() < 0.3 else {
            k: native(self.rnd) for k in self.rnd.sample(HEADER_KEYS, self.rnd.randrange(1, 7))}
        return [msgspec.msgpack.encode(value), *self._random()[: self.rnd.randrange(2)]]

    def _flip(self) -> list[bytes]:
        frames = [bytearray(f) for f in self._valid()]
        for _ in range(self.rnd.randrange(1, 9)):
            f = self.rnd.choice(frames)
            if f:
                f[self.rnd.randrange(len(f))] ^= 1 << self.rnd.randrange(8)
        return [bytes(f) for f in frames]

    def _edit(self) -> list[bytes]:
        frames = [bytearray(f) for f in self._valid()]
        f = self.rnd.choice(frames)
        for _ in range(self.rnd.randrange(1, 5)):
            pos = self.rnd.randrange(len(f) + 1)
            how = self.rnd.randrange(3)
            if how == 0 and pos < len(f):
                f[pos] = self.rnd.randrange(256)
            elif how == 1:
                f[pos:pos] = self.rnd.randbytes(self.rnd.randrange(1, 9))
            else:
                del f[pos:pos + self.rnd.randrange(1, 9)]
        return [bytes(f) for f in frames]

    def _truncate(self) -> list[bytes]:
        frames = self._valid()
        i = self.rnd.randrange(len(frames))
        frames[i] = frames[i][: self.rnd.randrange(len(frames[i]) + 1)]
        return frames

    def _extend(self) -> list[bytes]:
        frames = self._valid()
        i = self.rnd.randrange(len(frames))
        frames[i] += self.rnd.randbytes(self._length())
        return frames

    def _frames(self) -> list[bytes]:
        frames = self._valid()
        how = self.rnd.randrange(5)
        if how == 0 and len(frames) > 1:
            i, j = self.rnd.sample(range(len(frames)), 2)
            frames[i], frames[j] = frames[j], frames[i]
        elif how == 1:
            frames.insert(self.rnd.randrange(len(frames) + 1), self.rnd.choice(frames))
        elif how == 2:
            del frames[self.rnd.randrange(len(frames))]
        elif how == 3:
            frames += self._random()
        else:
            frames.reverse()
        return frames

    def _header(self) -> list[bytes]:
        header, frames = self._header_map()
        for _ in range(self.rnd.randrange(1, 3)):
            key = self.rnd.choice((*HEADER_KEYS, "extra"))
            if self.rnd.random() < 0.2:
                header.pop(key, None)
            else:
                header[key] = native(self.rnd)
        frames[0] = msgspec.msgpack.encode(header)
        return frames

    def _body(self) -> list[bytes]:
        header, frames = self._header_map()
        body = header.get("body")
        if isinstance(body, dict) and body and self.rnd.random() < 0.7:
            key = self.rnd.choice([*body, "unknown_field"])
            body[key] = native(self.rnd)
        else:  # a body of another shape, or the record type swapped under it
            header["type"] = self.rnd.choice(TYPE_NAMES)
        frames[0] = msgspec.msgpack.encode(header)
        return frames

    def _declared(self) -> list[bytes]:
        header, frames = self._header_map()
        header.pop("body", None)
        head = msgspec.msgpack.encode(header)
        huge = self.rnd.choice(HUGE_DECLARED) + self.rnd.randbytes(self.rnd.randrange(16))
        # The map claims one more entry (the body), whose value claims gigabytes.
        frames[0] = bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode("body") + huge
        return frames if self.rnd.random() < 0.5 else [huge]

    def _nesting(self) -> list[bytes]:
        header, frames = self._header_map()
        depth = self.rnd.choice((200, 2000, 20000, 100000))
        where = self.rnd.choice(("body", "args", "extra"))
        head = {k: v for k, v in header.items() if k != where and (where != "args" or k != "body")}
        if where == "args":
            head["type"] = "Control"
        raw = msgspec.msgpack.encode(head)
        value = deep(depth) if where != "args" else (
            b"\x82" + msgspec.msgpack.encode("op") + msgspec.msgpack.encode("x")
            + msgspec.msgpack.encode("args") + b"\x81" + msgspec.msgpack.encode("a") + deep(depth))
        key = "body" if where == "args" else where
        frames[0] = bytes([raw[0] + 1]) + raw[1:] + msgspec.msgpack.encode(key) + value
        return frames

    def _op(self) -> list[bytes]:
        header, frames = self._header_map()
        header["op"] = self.rnd.choice(("cancel", "cancel", "reply", "chunk", "end", "error", "data", "Call", ""))
        if self.rnd.random() < 0.3:
            header["v"] = self.rnd.choice((0, 2, -1, 2**64 - 1))
        if header["op"] == "cancel" and self.rnd.random() < 0.5:
            header["id"] = self.rnd.randrange(1_000_000, self.next_id + 1)  # maybe one in flight
        frames[0] = msgspec.msgpack.encode(header)
        return frames

    def _fixed(self) -> list[bytes]:
        return list(self.rnd.choice(self.fixed)) if self.fixed else self._valid()


def inline_array(arr: Any) -> MsgpackExt:
    """``arr`` as the codec's inline array extension, whatever its dtype or shape."""
    return MsgpackExt(EXT_INLINE, msgspec.msgpack.encode([arr.dtype.name, list(arr.shape), "np", arr.tobytes()]))


def patched(method: str, record: Record | None, changes: dict[str, Any] | None, rid: int) -> list[bytes]:
    """``record`` encoded as a call, then body fields overwritten (``"sampling.n": 0``): values the
    record's own checks would refuse to build, which the receiving codec must refuse instead."""
    frames = [bytes(f) for f in encode(record, id=rid, op="call", method=method)]
    if changes:
        header = msgspec.msgpack.decode(frames[0])
        for path, value in changes.items():
            *parents, leaf = path.split(".")
            node = header["body"]
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        frames[0] = msgspec.msgpack.encode(header)
    return frames


Call = tuple[str, "Record | None", "dict[str, Any] | None"]


def fixed_calls(calls: list[Call], first_id: int = 10) -> list[list[bytes]]:
    """Encoded (patched) calls, sent unmutated (ids below the fuzzer's, one per call)."""
    return [patched(m, rec, ch, first_id + i) for i, (m, rec, ch) in enumerate(calls)]


def expected_id(frames: list[bytes], limit: int) -> int | None:
    """The id of the one terminal reply the protocol promises for ``frames``; None: no reply."""
    try:
        env, _ = decode_parts(frames, limit)
    except Exception:  # noqa: BLE001  (whatever the codec raises, the spec promises an Error)
        if not frames or len(frames[0]) > limit:
            return 0
        try:
            return peek_header(frames[0]).id
        except Exception:  # noqa: BLE001
            return 0
    return None if env.op == "cancel" else env.id


@dataclass(slots=True)
class Flood:
    """What one flood did and got back."""

    sent: int = 0
    frames_sent: int = 0
    silent_by_design: int = 0  # well-formed cancels
    replies: int = 0  # terminal replies: reply, end, error
    chunks: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    undecodable_replies: int = 0
    unanswered: int = 0
    extra: int = 0
    stalls: int = 0  # times the window was widened because replies had stopped
    seconds: float = 0.0
    examples: list[str] = field(default_factory=list)


def _describe(frames: list[bytes]) -> str:
    return " | ".join(f"{len(f)}B {f[:48].hex()}" for f in frames[:4])


def _receive(sock: zmq.Socket, out: Flood, got: Counter[int]) -> None:
    while True:
        try:
            reply = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            msg = decode(reply)
        except Exception:  # noqa: BLE001
            out.undecodable_replies += 1
            continue
        if msg.op == "chunk":
            out.chunks += 1
            continue
        out.replies += 1
        got[msg.id] += 1
        if msg.op == "error":
            out.errors[getattr(msg.msg, "code", "?")] += 1


def flood(endpoint: str, messages: Iterator[list[bytes]], n: int, *, limit: int, window: int = 256,
          stall_s: float = 3.0, settle_s: float = 20.0) -> Flood:
    """Send ``n`` messages with at most ``window`` replies outstanding; count what came back.

    A message that never gets its reply would hold the window shut: when nothing arrives for
    ``stall_s`` the window is widened by what is outstanding (``Flood.stalls``); after the last
    send, replies are awaited until nothing arrives for ``settle_s``.
    """
    out, expected, got = Flood(), Counter(), Counter()
    total = credit = 0  # total: sum(expected.values()); credit: window widening after stalls
    first: dict[int, list[bytes]] = {}  # one example message per expected id, for the report
    sock = zmq.Context.instance().socket(zmq.DEALER)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
        sock.setsockopt(opt, value)
    sock.connect(endpoint)
    start = last_reply = time.monotonic()
    try:
        while True:
            outstanding = total - out.replies
            while out.sent < n and outstanding < window + credit:
                frames = next(messages)
                rid = expected_id(frames, limit)
                sock.send_multipart(frames)
                out.sent += 1
                out.frames_sent += len(frames)
                if rid is None:
                    out.silent_by_design += 1
                    continue
                expected[rid] += 1
                total += 1
                outstanding += 1
                if rid not in first:
                    first[rid] = frames if sum(map(len, frames)) < 4096 else [f[:64] for f in frames]
            idle = time.monotonic() - last_reply
            # Done when every expected id has its replies. The global count alone is not enough:
            # a reply under an id other than the one expected (two messages sharing id 0, say)
            # would let the count reach zero while a reply is still on its way to this socket.
            if out.sent >= n and (idle > settle_s or outstanding <= 0 and _all_answered(expected, got)):
                break
            if out.sent < n and idle > stall_s:
                credit, last_reply = credit + outstanding, time.monotonic()
                out.stalls += 1
            if sock.poll(100):
                _receive(sock, out, got)
                last_reply = time.monotonic()
    finally:
        sock.close(linger=0)
    out.seconds = time.monotonic() - start
    for rid, want in expected.items():
        have = got.get(rid, 0)
        if have < want:
            out.unanswered += want - have
            if len(out.examples) < 10:
                out.examples.append(f"id {rid}: {have}/{want} replies; e.g. {_describe(first.get(rid, []))}")
    out.extra = sum(max(0, have - expected.get(rid, 0)) for rid, have in got.items())
    return out


def _all_answered(expected: Counter[int], got: Counter[int]) -> bool:
    return all(got.get(rid, 0) >= want for rid, want in expected.items())


class RssSampler:
    """Samples ``measure()`` (MiB) every ``period_s`` in a thread while in a ``with`` block."""

    def __init__(self, measure: Callable[[], float], period_s: float = 0.2) -> None:
        self.measure, self.period_s = measure, period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(self.measure())

    def __enter__(self) -> RssSampler:
        self.samples.append(self.measure())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.measure())

    @property
    def peak(self) -> float:
        return max(self.samples)


def drop_oversize(endpoint: str, size: int, then: list[bytes], wait_s: float = 3.0) -> tuple[int, bool]:
    """Send one ``size``-byte frame (past ZMQ_MAXMSGSIZE), then ``then`` on the same DEALER.

    Returns (replies to the oversize frame within ``wait_s``, whether ``then`` was answered once
    the socket had reconnected): libzmq drops the connection, the DEALER reconnects by itself.
    """
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(bytes(size))
        early = len(sock.recv_multipart()) if sock.poll(int(wait_s * 1000)) else 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the first tries may go down the dropped pipe
            sock.send_multipart(then)
            if sock.poll(1000):
                return (1 if early else 0), decode(sock.recv_multipart()).op == "reply"
        return (1 if early else 0), False
    finally:
        sock.close(linger=0)



# ---------------------------------------------------------------------------------- HTTP

RAW_NUMBERS = ("1e999", "-1e999", "NaN", "Infinity", "-Infinity", "9" * 4000, "9" * 5000, "18446744073709551616",
               "-9223372036854775809", "1" + "0" * 400, "0." + "0" * 5000 + "1", "1e-99999", "-0")
CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
                 "application/json; charset=latin-1", "application/json; charset=utf-16", "application/json; charset=bogus",
                 "application/json; charset=utf-8; x=1", "", "application/msgpack")
RAW = "\x00RAW\x00"  # stands for a leaf whose JSON text is written by hand


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpCase:
    """One malformed (or surprising) request body."""

    kind: str
    body: bytes
    headers: dict[str, str]


def json_value(rnd: random.Random, depth: int = 0) -> Any:
    """A random JSON value, at the edges of its types."""
    k = rnd.randrange(8 if depth < 2 else 5)
    if k == 0:
        return rnd.choice((None, True, False))
    if k == 1:
        return rnd.choice((0, -1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1, 10**30, -(10**30)))
    if k == 2:
        return rnd.choice((0.5, -0.0, 1e308, -1e308, 5e-324, 1.5e300))
    if k in (3, 4):
        return rnd.choice(("", "x", "é" * 20, "\u2028", "<|im_start|>", "\\boxed{1}", "\x00", "x" * 3000))
    if k == 5:
        return [json_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    return {rnd.choice(("a", "role", "content", "query", "tokens", "")): json_value(rnd, depth + 1)
            for _ in range(rnd.randrange(4))}


def _replace_leaf(obj: Any, rnd: random.Random, value: Any) -> Any:
    """A copy of ``obj`` with one random node (a dict value or list item, any depth) set to ``value``."""
    if isinstance(obj, dict) and obj and rnd.random() < 0.75:
        key = rnd.choice(list(obj))
        return {**obj, key: _replace_leaf(obj[key], rnd, value)}
    if isinstance(obj, list) and obj and rnd.random() < 0.75:
        i = rnd.randrange(len(obj))
        return [*obj[:i], _replace_leaf(obj[i], rnd, value), *obj[i + 1:]]
    return value


def _with_raw(valid: Any, rnd: random.Random, raw: str) -> bytes:
    return json.dumps(_replace_leaf(valid, rnd, RAW)).replace(json.dumps(RAW), raw).encode()


@functools.lru_cache(maxsize=4)
def gzip_bomb(size: int) -> bytes:
    """``size`` spaces, gzipped (about 1/1000 of it on the wire)."""
    return gzip.compress(b" " * size, compresslevel=9)


class HttpCases:
    """Deterministic malformed bodies around one valid body of an endpoint."""

    def __init__(self, seed: int, valid: Any, max_body: int) -> None:
        self.rnd, self.valid, self.max_body = random.Random(seed), valid, max_body
        self.text = json.dumps(valid).encode()
        self._bomb = gzip_bomb(3 * max_body)
        self._table: list[tuple[str, Callable[[], tuple[bytes, dict[str, str]]], float]] = [
            ("truncated", self._truncated, 12), ("garbage", self._garbage, 8), ("bad_utf8", self._bad_utf8, 6),
            ("wrong_type", self._wrong_type, 22), ("huge_number", self._huge_number, 8), ("deep", self._deep, 3),
            ("scalar", self._scalar, 5), ("content_type", self._content_type, 6), ("dup_keys", self._dup_keys, 3),
            ("big_string", self._big_string, 2), ("surrogate", self._surrogate, 4), ("unknown", self._unknown, 5),
            ("empty", lambda: (b"", {}), 3), ("encoding", self._encoding, 3), ("oversize", self._oversize, 0.3),
            ("bomb", lambda: (self._bomb, {"Content-Encoding": "gzip"}), 0.2)]

    def take(self, n: int) -> list[HttpCase]:
        out = []
        for _ in range(n):
            kind, make, _ = self.rnd.choices(self._table, weights=[w for *_, w in self._table])[0]
            body, headers = make()
            out.append(HttpCase(kind=kind, body=body, headers={"Content-Type": "application/json", **headers}))
        return out

    def _truncated(self) -> tuple[bytes, dict[str, str]]:
        return self.text[: self.rnd.randrange(len(self.text))], {}

    def _garbage(self) -> tuple[bytes, dict[str, str]]:
        return self.rnd.randbytes(self.rnd.randrange(1, 512)), {}

    def _bad_utf8(self) -> tuple[bytes, dict[str, str]]:
        cut = self.rnd.randrange(len(self.text))
        return self.text[:cut] + self.rnd.choice((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80")) \
            + self.text[cut:], {}

    def _wrong_type(self) -> tuple[bytes, dict[str, str]]:
        return json.dumps(_replace_leaf(self.valid, self.rnd, json_value(self.rnd))).encode(), {}

    def _huge_number(self) -> tuple[bytes, dict[str, str]]:
        return _with_raw(self.valid, self.rnd, self.rnd.choice(RAW_NUMBERS)), {}

    def _deep(self) -> tuple[bytes, dict[str, str]]:
        d = self.rnd.choice((50, 1000, 100_000))
        raw = "[" * d + "]" * d if self.rnd.random() < 0.5 else '{"a":' * d + "1" + "}" * d
        return _with_raw(self.valid, self.rnd, raw), {}

    def _scalar(self) -> tuple[bytes, dict[str, str]]:
        return self.rnd.choice((b"null", b"1", b'"s"', b"[]", b"{}", b"true", b"[1, 2]", b"-0.0")), {}

    def _content_type(self) -> tuple[bytes, dict[str, str]]:
        return self.text, {"Content-Type": self.rnd.choice(CONTENT_TYPES)}

    def _dup_keys(self) -> tuple[bytes, dict[str, str]]:
        if not isinstance(self.valid, dict) or not self.valid:
            return self._wrong_type()
        key = self.rnd.choice(list(self.valid))
        return self.text[:-1] + b", " + json.dumps({key: json_value(self.rnd)}).encode()[1:], {}

    def _big_string(self) -> tuple[bytes, dict[str, str]]:
        # 16 KiB of text: past socket buffer sizes, yet cheap for a tokenizer (an 8 MiB string took
        # the gateway's tokenizer 9 s) or math-verify (64 KiB labels hit its 5 s parse timeout)
        return json.dumps(_replace_leaf(self.valid, self.rnd, "x" * min(self.max_body // 8, 1 << 14))).encode(), {}

    def _surrogate(self) -> tuple[bytes, dict[str, str]]:
        return _with_raw(self.valid, self.rnd, self.rnd.choice(('"\\ud800"', '"a\\udfff"', '"\\ud800\\ud800"'))), {}

    def _unknown(self) -> tuple[bytes, dict[str, str]]:
        extra = {self.rnd.choice(("zzz", "stream", "n", "__proto__", "key")): json_value(self.rnd)}
        return json.dumps({**self.valid, **extra} if isinstance(self.valid, dict) else extra).encode(), {}

    def _encoding(self) -> tuple[bytes, dict[str, str]]:
        enc = self.rnd.choice(("gzip", "deflate", "br", "bogus", "gzip-valid"))
        if enc == "gzip-valid":
            return gzip.compress(self.text), {"Content-Encoding": "gzip"}
        return self.rnd.randbytes(64), {"Content-Encoding": enc}

    def _oversize(self) -> tuple[bytes, dict[str, str]]:
        return b" " * (self.max_body + 1) + self.text, {}


@dataclass(slots=True)
class HttpTally:
    """What one endpoint answered to a list of ``HttpCase``."""

    sent: int = 0
    status: Counter[int] = field(default_factory=Counter)
    not_json_4xx: int = 0  # 4xx whose body is not a JSON object with "error"
    parser_4xx: int = 0  # of those, 400s from aiohttp's HTTP parser (a Content-Encoding it lacks)
    server_errors: int = 0  # 5xx
    transport_errors: int = 0  # no HTTP answer at all (connection reset, ...)
    seconds: float = 0.0
    examples: list[str] = field(default_factory=list)


async def _one(session: Any, method: str, url: str, case: HttpCase, out: HttpTally) -> int:
    try:
        async with session.request(method, url, data=case.body, headers=case.headers) as r:
            text = await r.read()
            status = r.status
    except Exception as e:  # noqa: BLE001
        out.transport_errors += 1
        out.examples.append(f"{case.kind}: {type(e).__name__}: {e} ({case.body[:80]!r})")
        return 0
    out.status[status] += 1
    if status >= 500:
        out.server_errors += 1
        out.examples.append(f"{case.kind}: {status} {text[:200]!r} for {case.headers} {case.body[:120]!r}")
    elif status >= 400:
        try:
            ok = "error" in json.loads(text)
        except ValueError:
            ok = False
        if not ok:
            out.not_json_4xx += 1
            parser = status == 400 and text.startswith(b"Can not decode content-encoding")
            out.parser_4xx += parser
            if not parser:
                out.examples.append(f"{case.kind}: {status} not JSON: {text[:200]!r}")
    return status


async def send_cases(url: str, cases: list[HttpCase], *, method: str = "POST", headers: dict[str, str] | None = None,
                     concurrency: int = 16, after: Callable[[int], Any] | None = None) -> HttpTally:
    """Send every case to ``url`` (``concurrency`` at once; one at a time when ``after`` is
    given, which is awaited with each status, e.g. to re-create what a 200 consumed)."""
    import aiohttp

    out, sem = HttpTally(), asyncio.Semaphore(1 if after else concurrency)
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=120)
    # A connection per request: a server may close one after an error (a 413 it did not read
    # to the end), and a reused pooled connection would then fail on the client's side.
    async with aiohttp.ClientSession(timeout=timeout, headers=headers or {}, skip_auto_headers=("Content-Type",),
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        async def go(case: HttpCase) -> None:
            async with sem:
                status = await _one(session, method, url, case, out)
                out.sent += 1
                if after is not None:
                    await after(status)

        await asyncio.gather(*(go(c) for c in cases))
    out.seconds = time.monotonic() - start
    return out
