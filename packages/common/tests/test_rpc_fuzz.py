"""Fuzzing the RPC server with hypothesis over a real socket.

Random frames and mutated valid messages (bit flips, truncation, extra or missing frames, wrong
types in the header, oversized frames) must never crash the server: each one that is not a
valid request gets exactly one typed Error reply, addressed to the sender with the request id
when the header is readable (else 0), and ordinary calls keep working afterwards.

The mutated messages call the built-in ``health``, which the server answers inline, so replies
come back in the order the messages were sent: a sentinel call after each message tells where
its replies end.
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle.common.codec import decode, encode, peek_header
from treadle.common.errors import ERRORS, TreadleError
from treadle.common.records import Control, Error, GenerateRequest
from treadle.common.rpc import RpcServer, ServerThread, SyncRpcClient

LIMIT = 4096
SECRET_METHOD = "echo-after-fuzz"  # no fuzzed string will guess it: fuzzed calls stay inline
_sentinels = itertools.count(1 << 40)


async def echo(msg, ctx):
    return msg


@pytest.fixture(scope="module")
def fuzz_server():
    thread = ServerThread(RpcServer(name="fuzz", max_frame_bytes=LIMIT, handlers={SECRET_METHOD: echo}))
    endpoint = thread.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    yield thread, sock
    sock.close()
    thread.stop(grace_s=1)


def _valid_messages() -> list[list[bytes]]:
    with_buffer = GenerateRequest(prompt_token_ids=np.arange(700, dtype=np.int32), key="fuzz")  # 2800 B frame
    inline = Control(op="ping", args={"x": [1, 2.5, "s", None], "y": {"z": b"b"}})
    return [[bytes(f) for f in encode(rec, id=rid, op="call", method="health")]
            for rec, rid in ((with_buffer, 17), (inline, 23), (None, 42))]


VALID = _valid_messages()
HEADER_FIELDS = ("v", "id", "op", "method", "type", "body")
native = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@st.composite
def mutated(draw) -> list[bytes]:
    frames = [bytearray(f) for f in draw(st.sampled_from(VALID))]
    kind = draw(st.sampled_from(["flip", "truncate", "extra", "missing", "header", "oversize"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(frames) - 1))
            if frames[i]:
                pos = draw(st.integers(0, len(frames[i]) - 1))
                frames[i][pos] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        i = draw(st.integers(0, len(frames) - 1))
        frames[i] = frames[i][: draw(st.integers(0, max(len(frames[i]) - 1, 0)))]
    elif kind == "extra":
        frames += [bytearray(b) for b in draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))]
    elif kind == "missing":
        del frames[draw(st.integers(0, len(frames) - 1))]
        if not frames:
            frames = [bytearray()]
    elif kind == "header":
        header = msgspec.msgpack.decode(bytes(frames[0]))
        field = draw(st.sampled_from(HEADER_FIELDS))
        if draw(st.booleans()):
            header[field] = draw(native.filter(lambda v: v != "cancel"))
        else:
            header.pop(field)
        frames[0] = bytearray(msgspec.msgpack.encode(header))
    else:
        i = draw(st.integers(0, len(frames) - 1))
        frames[i] += bytes(LIMIT + 1 - len(frames[i]) + draw(st.integers(0, 100)))
    return [bytes(f) for f in frames]


random_frames = st.lists(st.binary(max_size=2 * LIMIT), min_size=1, max_size=4)


def _expected(frames: list[bytes]) -> tuple[int, int, bool]:
    """(replies expected, their id, must be an error) by the codec's own reading of the message."""
    try:
        m = decode(frames, max_frame_bytes=LIMIT)
    except TreadleError:
        try:
            rid = peek_header(frames[0]).id if len(frames[0]) <= LIMIT else 0
        except TreadleError:
            rid = 0
        return 1, rid, True
    if m.op == "cancel":
        return 0, m.id, False  # cancelling nothing: no reply by design
    return 1, m.id, m.op != "call" or m.method not in ("health", "stats")


def _exchange(sock: zmq.Socket, frames: list[bytes]) -> None:
    sentinel = next(_sentinels)
    sock.send_multipart(frames)
    sock.send_multipart(encode(None, id=sentinel, op="call", method="health"))
    replies = []
    while True:
        assert sock.poll(10_000), f"server stopped answering after {[f[:40] for f in frames]}"
        reply = decode(sock.recv_multipart())
        if reply.id == sentinel and reply.op == "reply":
            break
        replies.append(reply)
    n, rid, must_error = _expected(frames)
    assert len(replies) == n, (frames, replies)
    for reply in replies:
        assert reply.id == rid
        if must_error or reply.op == "error":
            assert reply.op == "error" and isinstance(reply.msg, Error)
            assert reply.msg.code in ERRORS and reply.msg.message
        else:
            assert reply.op == "reply" and isinstance(reply.msg, Control)


def _still_serves(thread: ServerThread) -> None:
    with SyncRpcClient(thread.endpoint) as client:
        req = GenerateRequest(prompt_token_ids=np.arange(600, dtype=np.int32), key="after")
        out = client.call(SECRET_METHOD, req, timeout=10)
        assert out.key == "after" and np.array_equal(out.prompt_token_ids, req.prompt_token_ids)
        stats = client.call("stats", timeout=10).args
    assert stats["in_flight"] == 0 and sum(stats["errors"].values()) > 0


FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])


def test_random_frames_get_error_replies(fuzz_server):
    thread, sock = fuzz_server

    @FAST
    @given(frames=random_frames)
    def check(frames):
        _exchange(sock, frames)

    check()
    _still_serves(thread)


def test_mutated_messages_get_error_replies(fuzz_server):
    thread, sock = fuzz_server

    @FAST
    @given(frames=mutated())
    def check(frames):
        _exchange(sock, frames)

    check()
    _still_serves(thread)


def test_every_error_kind_is_reachable(fuzz_server):
    """The oracle is not vacuous: known bad inputs give the codes they should."""
    _, sock = fuzz_server
    header = msgspec.msgpack.decode(VALID[1][0])
    cases = {
        "bad_message": [b"\xc1 not msgpack"],
        "version_mismatch": [msgspec.msgpack.encode({**header, "v": 2})],
        "frame_too_large": [VALID[0][0], VALID[0][1] + bytes(LIMIT)],
        "unknown_method": [msgspec.msgpack.encode({**header, "method": "nope"})],
        "bad_request": [msgspec.msgpack.encode({**header, "op": "end"})],
    }
    for code, frames in cases.items():
        sock.send_multipart(frames)
        assert sock.poll(10_000)
        reply = decode(sock.recv_multipart())
        assert reply.op == "error" and reply.msg.code == code, (code, reply)


@pytest.mark.slow
def test_mutated_and_random_messages_100k(fuzz_server):
    thread, sock = fuzz_server

    @settings(max_examples=100_000, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames=mutated() | random_frames)
    def check(frames):
        _exchange(sock, frames)

    check()
    _still_serves(thread)
