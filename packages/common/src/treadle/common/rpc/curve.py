"""CURVE keys for the RPC layer: make them, load them, apply them to sockets.

A key folder made by ``generate_keys(DIR)`` holds::

    DIR/server.key  DIR/server.key_secret          the server's pair
    DIR/client.key  DIR/client.key_secret          a client's pair (one per name asked for)
    DIR/authorized_clients/client.key              the server's allow-list: public keys only

Copy ``server.key`` and one client pair to each client machine; keep ``server.key_secret``
on the server. A client whose public key is not in the allow-list fails the handshake: its
requests never reach the server (they time out), and the server keeps serving the others.
Keys are z85 text files in pyzmq's ``zmq.auth`` certificate format.

Not here: the command line (``security``), endpoint rules (``transport``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from treadle.common import env

ALLOW_DIR = "authorized_clients"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerCurve:
    """What a CURVE server needs."""

    public_key: bytes
    """The server's z85 public key (40 bytes)."""
    secret_key: bytes
    """The server's z85 secret key (40 bytes)."""
    allow_dir: Path
    """Folder of ``*.key`` public-key files of the clients allowed to connect."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientCurve:
    """What a CURVE client needs."""

    public_key: bytes
    """The client's z85 public key; must be in the server's allow-list."""
    secret_key: bytes
    """The client's z85 secret key."""
    server_public_key: bytes
    """The server's z85 public key (the client refuses any other server)."""


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support; install pyzmq's wheel")


def generate_keys(key_dir: str | os.PathLike[str], *, clients: tuple[str, ...] = ("client",),
                  overwrite: bool = False) -> dict[str, Path]:
    """Write a server pair, one pair per client name and the allow-list; returns name -> public file.

    Existing keys are kept (and reused) unless ``overwrite``; secret files are made owner-only.
    """
    _require_curve()
    root = Path(key_dir)
    allow = root / ALLOW_DIR
    allow.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for name in ("server", *clients):
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad key name {name!r}: use a plain file name such as 'client' or 'trainer0'")
        public, secret = root / f"{name}.key", root / f"{name}.key_secret"
        if overwrite or not (public.exists() and secret.exists()):
            public_s, secret_s = zmq.auth.create_certificates(root, name)
            public, secret = Path(public_s), Path(secret_s)
        secret.chmod(0o600)
        if name != "server":
            shutil.copyfile(public, allow / public.name)
        out[name] = public
    return out


def _key_dir(key_dir: str | os.PathLike[str] | None) -> Path:
    if key_dir is None:
        key_dir = env.get("TREADLE_CURVE_DIR")
        if not key_dir:
            raise ValueError("no CURVE key folder given and TREADLE_CURVE_DIR is not set; "
                             "make one with `treadle-keys generate DIR`")
    return Path(key_dir)


def _load_pair(path: Path) -> tuple[bytes, bytes]:
    if not path.exists():
        raise FileNotFoundError(f"missing CURVE key file {path}; make keys with `treadle-keys generate {path.parent}`")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    return public, secret


def load_server_keys(key_dir: str | os.PathLike[str] | None = None, *,
                     allow_dir: str | os.PathLike[str] | None = None) -> ServerCurve:
    """The server pair in ``key_dir`` (default: the TREADLE_CURVE_DIR knob) and its allow-list."""
    _require_curve()
    root = _key_dir(key_dir)
    public, secret = _load_pair(root / "server.key_secret")
    allow = Path(allow_dir) if allow_dir is not None else root / ALLOW_DIR
    if not allow.is_dir():
        raise FileNotFoundError(f"CURVE allow-list folder {allow} does not exist")
    return ServerCurve(public_key=public, secret_key=secret, allow_dir=allow)


def load_client_keys(key_dir: str | os.PathLike[str] | None = None, *, name: str = "client",
                     server_public_file: str | os.PathLike[str] | None = None) -> ClientCurve:
    """Client pair ``name`` in ``key_dir`` (default: TREADLE_CURVE_DIR) plus the server's public key."""
    _require_curve()
    root = _key_dir(key_dir)
    public, secret = _load_pair(root / f"{name}.key_secret")
    server_file = Path(server_public_file) if server_public_file is not None else root / "server.key"
    if not server_file.exists():
        raise FileNotFoundError(f"missing the server's public key {server_file}")
    server_public, _ = zmq.auth.load_certificate(server_file)
    return ClientCurve(public_key=public, secret_key=secret, server_public_key=server_public)


def apply_server(sock: zmq.Socket, curve: ServerCurve) -> None:
    """Make ``sock`` a CURVE server (before bind)."""
    sock.curve_secretkey = curve.secret_key
    sock.curve_publickey = curve.public_key
    sock.curve_server = True


def apply_client(sock: zmq.Socket, curve: ClientCurve) -> None:
    """Make ``sock`` a CURVE client of ``curve.server_public_key`` (before connect)."""
    sock.curve_secretkey = curve.secret_key
    sock.curve_publickey = curve.public_key
    sock.curve_serverkey = curve.server_public_key


def start_authenticator(ctx: zmq.Context, curve: ServerCurve) -> ThreadAuthenticator:
    """A ZAP handler on ``ctx`` accepting only the allow-listed client keys (one per context).

    It runs in its own thread so handshakes are answered even while the server's loop is busy.
    The allow-list is read once here: restart the server after changing it.
    """
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(curve.allow_dir))
    return auth
