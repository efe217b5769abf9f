"""Process plumbing of the launcher: free ports, process trees, signals, reaping (Linux).

Daemons start their workers in sessions of their own (so a Ctrl-C meant for the daemon does not
reach an engine half-way through a weight update), which means killing a daemon's process group
does not kill its workers, and a daemon killed with SIGKILL leaves them orphaned. So the launcher
remembers every descendant it has seen (``Tree``) and, as the command-line entry point, makes
itself a child subreaper: orphans of its components are re-parented to it, not to init, and
the final sweep finds them.

Not here: what to start (``plan``) or when to stop (``supervise``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the usual bind-to-0 probe; another process may take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (held open together while choosing, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()  # loaded here, never between fork and exec (dlopen there could deadlock)


def die_with_parent() -> None:
    """In a child between fork and exec: get SIGTERM when the launcher dies, even by SIGKILL (Linux).

    So a launcher killed hard still stops its components cleanly (each shuts down on SIGTERM).
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux prctl); False where unsupported."""
    return _LIBC is not None and _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


class Tree:
    """The descendants of ``root`` seen so far, kept as (pid, start time) so a reused pid is not hit."""

    __slots__ = ("root", "seen")

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, float] = {}

    def refresh(self) -> None:
        """Remember the root and its current descendants."""
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(self.root)
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(p.pid, p.create_time())

    def alive(self) -> list[psutil.Process]:
        """Remembered processes still running (zombies excluded)."""
        out = []
        for pid, started in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def kill(self, spare: frozenset[int] = frozenset()) -> int:
        """SIGKILL every remembered process still running but ``spare``; how many were signalled."""
        self.refresh()
        victims = [p for p in self.alive() if p.pid not in spare]
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.kill()
        return len(victims)


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (a session leader started by us)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def kill_children(exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """SIGKILL every descendant of this process but ``exclude``; how many were signalled."""
    victims = [p for p in psutil.Process().children(recursive=True) if p.pid not in exclude]
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return len(victims)


def reap(exclude: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Collect exited children that are not ``exclude`` (orphans adopted as subreaper).

    Our own ``Popen`` children are excluded: reaping them here would lose their exit status.
    """
    for p in psutil.Process().children():
        if p.pid in exclude:
            continue
        with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
            if p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)


def describe_signal(code: int | None) -> str:
    """``-9`` -> ``killed by SIGKILL``; ``3`` -> ``exit status 3``."""
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"
