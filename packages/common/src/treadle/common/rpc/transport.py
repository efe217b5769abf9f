"""Endpoints and socket options shared by the RPC server and client.

Decides which endpoints are safe without encryption (loopback TCP, ``ipc://``, ``inproc://``),
normalises ``tcp://host:0`` to a random port, and sets the size limits: the RPC layer checks
frames against ``max_frame_bytes`` itself (so an oversized frame gets a typed Error reply); the
socket's ``ZMQ_MAXMSGSIZE`` is only a larger hard net (libzmq drops the connection beyond it).

Not here: key handling (``curve``), message handling (``server`` / ``client``).
"""

from __future__ import annotations

import ipaddress

import zmq

from treadle.common import env

HOW_TO_KEYS = (
    "make keys with `treadle-keys generate DIR` (or `python -m treadle.common.rpc.security "
    "generate DIR`), start the server with curve=load_server_keys(DIR) (DIR/authorized_clients/ "
    "holds the public keys of allowed clients) and the client with curve=load_client_keys(DIR)"
)
_HARD_LIMIT_FACTOR = 4
_HARD_LIMIT_MIN = 64 << 20


class InsecureEndpoint(ValueError):
    """A non-loopback TCP endpoint was asked for without CURVE keys."""


def default_max_frame_bytes() -> int:
    """Frame size limit from the TREADLE_MAX_FRAME_BYTES knob."""
    return int(env.get("TREADLE_MAX_FRAME_BYTES"))


def hard_limit(max_frame_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE: ``max(4 * max_frame_bytes, 64 MiB)``, capped at int64."""
    return min(max(_HARD_LIMIT_FACTOR * max_frame_bytes, _HARD_LIMIT_MIN), (1 << 63) - 1)


def split_tcp(endpoint: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); raises ValueError on anything else."""
    rest = endpoint.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"bad tcp endpoint {endpoint!r}: expected tcp://HOST:PORT")
    return host, port


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs; interface names, wildcards and DNS names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def off_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` is a tcp address on a non-loopback host: what treadle's daemons serve
    only with CURVE keys. ipc:// and inproc:// are not; a malformed tcp endpoint raises ValueError."""
    return endpoint.startswith("tcp://") and not is_loopback(split_tcp(endpoint)[0])


def check_endpoint(endpoint: str, *, secure: bool, role: str) -> str:
    """The endpoint to bind/connect, after the safety rules; ``role`` is "bind" or "connect".

    tcp port 0 becomes ``*`` (a random free port). A non-loopback tcp endpoint without CURVE
    (``secure=False``) raises ``InsecureEndpoint`` saying how to make keys.
    """
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"unsupported endpoint {endpoint!r}: use tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    host, port = split_tcp(endpoint)
    if not secure and not is_loopback(host):
        raise InsecureEndpoint(
            f"refusing to {role} {endpoint} without CURVE keys: anyone who can reach a non-loopback "
            f"address could call this service. Either {HOW_TO_KEYS}, or use tcp://127.0.0.1:PORT "
            f"or ipc://PATH."
        )
    if port == "0":
        port = "*"
    return f"tcp://{host}:{port}"


def configure(sock: zmq.Socket, endpoint: str, *, max_frame_bytes: int) -> None:
    """Options both roles share: unbounded send queues, the hard size net, IPv6 when asked."""
    # Unbounded send queue: a ROUTER drops (or with ROUTER_MANDATORY refuses) messages to a peer
    # at its high-water mark, and a reply must never vanish; in-flight limits bound the memory.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, hard_limit(max_frame_bytes))
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
