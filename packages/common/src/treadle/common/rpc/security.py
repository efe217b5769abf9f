"""``treadle-keys``: make the CURVE key folder that non-loopback RPC services require.

    treadle-keys generate DIR [--clients client trainer0 ...] [--overwrite]
    python -m treadle.common.rpc.security generate DIR

writes a server key pair, one pair per client name, and ``DIR/authorized_clients/`` (the
server's allow-list). The key functions themselves live in ``curve`` and are re-exported here.

Not here: applying keys to sockets (``curve``), endpoint rules (``transport``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from treadle.common.rpc.curve import (
    ALLOW_DIR,
    ClientCurve,
    ServerCurve,
    generate_keys,
    load_client_keys,
    load_server_keys,
)

__all__ = ["ALLOW_DIR", "ClientCurve", "GenerateKeys", "ServerCurve", "generate_keys", "load_client_keys",
           "load_server_keys", "main"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateKeys:
    """Write a server key pair, client key pairs and the server's allow-list into DIR."""

    dir: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="DIR")]
    """Folder to write the keys into (created if missing)."""
    clients: tuple[str, ...] = ("client",)
    """Names of the client key pairs to make; each public key is allow-listed."""
    overwrite: bool = False
    """Replace existing key pairs instead of keeping them."""

    def __post_init__(self) -> None:
        if not self.clients:
            raise ValueError("--clients needs at least one name")
        for name in self.clients:
            if name == "server" or not name or "/" in name or name.startswith("."):
                raise ValueError(f"bad client name {name!r}: a plain file name other than 'server'")

    def run(self) -> dict[str, Path]:
        return generate_keys(self.dir, clients=self.clients, overwrite=self.overwrite)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``treadle-keys``."""
    cmd = tyro.extras.subcommand_cli_from_dict({"generate": GenerateKeys}, prog="treadle-keys", args=argv)
    written = cmd.run()
    for name, public in written.items():
        print(f"{name}: {public} (secret: {public.with_name(public.name + '_secret')})")
    print(f"allow-list: {Path(cmd.dir) / ALLOW_DIR}")


if __name__ == "__main__":
    main()
