"""Run untrusted Python (a model's code answer) in a jail, one process per run, and say how it ended.

``Sandbox(limits).run(code, stdin)`` -> ``ExecResult``. Each run gets:

- its own process tree, started in a new session; at ``wall_s`` the parent kills the whole
  process group (SIGKILL), and, under ``namespaces`` isolation, killing the pid namespace's
  init takes every process of the run with it (a double-forked daemon too);
- ``RLIMIT_CPU`` (SIGXCPU at ``cpu_s``), ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_NPROC``
  (``nproc``), ``RLIMIT_FSIZE`` (``fsize_mb``: files *and* its stdout/stderr, which are files the
  parent opened, so a flood of output is cut by the kernel), ``RLIMIT_NOFILE``, no core dumps;
- a fresh temporary working directory (``HOME`` and ``TMPDIR`` point there), removed afterwards
  (or, when its process was killed mid-run, by the next ``Sandbox`` made on the machine);
- output read back capped at ``max_output_bytes`` per stream.

Isolation levels (``isolation``; ``auto`` picks the first that works and ``describe()`` says which):

- ``namespaces`` (root): new network namespace (no interfaces but a down loopback: every
  connect fails), new mount namespace with every mount remounted read-only except the working
  directory, new pid namespace, and the code runs as an unprivileged uid taken from a pool
  (``uid_base`` .. ``uid_base + uid_slots - 1``, one per concurrent run, held with a file lock), so
  ``RLIMIT_NPROC`` is enforced (the kernel ignores it for root) and the uid owns nothing else.
- ``rlimits`` (fallback when not root): the rlimits above plus a Python audit hook that refuses
  socket creation, ctypes, process creation and writes outside the working directory. The hook
  binds Python code only; the code runs with the daemon user's rights otherwise. Prefer running
  the reward daemon as root in a container, or as a dedicated user, when executing model code.

Not here: deciding what a test case is or how it is scored (``code_reward``); CPU/IO fairness
between runs (run fewer at once).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal

LAUNCHER = Path(__file__).resolve().parent / "_sandbox" / "launcher.py"
Isolation = Literal["auto", "namespaces", "rlimits"]
Status = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed"]
_SETUP_FAILED = 121
_RESOLVED: dict[tuple[str, int], str] = {}  # (python, euid) -> isolation that worked


class SandboxUnavailable(RuntimeError):
    """The jail could not be built (not the program's fault: its sample is failed, not scored 0)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxLimits:
    """Per-run limits. Keep them small: a fork bomb gets ``nproc`` processes for ``wall_s``."""

    cpu_s: float = 5.0
    """CPU seconds (user + system) before SIGXCPU; rounded up to whole seconds."""
    wall_s: float = 10.0
    """Wall-clock seconds before the whole run is killed."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) in MiB."""
    nproc: int = 32
    """Processes + threads the run's uid may have (RLIMIT_NPROC; enforced under namespaces only)."""
    fsize_mb: int = 16
    """Largest file the run may write, its stdout/stderr included (RLIMIT_FSIZE), in MiB."""
    nofile: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_output_bytes: int = 65536
    """Bytes of stdout and of stderr read back into the result (the rest is dropped)."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        for name in ("memory_mb", "nproc", "fsize_mb", "nofile", "max_output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.memory_mb < 64:
            raise ValueError(f"SandboxLimits.memory_mb must be >= 64 (Python itself needs it), got {self.memory_mb}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecResult:
    """How one run ended."""

    status: Status
    """ok: exit 0; error: non-zero exit; timeout: killed at wall_s; cpu_limit / memory_limit /
    output_limit: a limit stopped it; killed: ended by another signal."""
    exit_code: int | None
    """The exit status when it exited by itself."""
    signal: int | None
    """The signal that ended it, if one did."""
    stdout: str
    """Standard output (capped at max_output_bytes, decoded as UTF-8 with replacement)."""
    stderr: str
    """Standard error (capped likewise)."""
    wall_s: float
    """Wall time of the run, set-up included."""
    cpu_s: float
    """CPU time of the program (0 when unknown, e.g. after a wall-clock kill)."""


class Sandbox:
    """Runs Python source under ``limits``; safe to call from several threads at once."""

    def __init__(self, limits: SandboxLimits | None = None, *, isolation: Isolation = "auto",
                 uid_base: int = 61000, uid_slots: int = 64, python: str | None = None,
                 audit_hook: bool = True) -> None:
        if isolation not in ("auto", "namespaces", "rlimits"):
            raise ValueError(f"isolation must be auto, namespaces or rlimits, got {isolation!r}")
        if uid_base < 1000 or uid_slots < 1:
            raise ValueError(f"uid_base must be >= 1000 and uid_slots >= 1, got {uid_base}, {uid_slots}")
        self.limits = limits or SandboxLimits()
        self.python = python or sys.executable
        self._requested = isolation
        self.audit_hook = audit_hook
        """Whether runs install the Python audit hook (on by default; off only to test the kernel layer)."""
        self._uids = range(uid_base, uid_base + uid_slots)
        self._lock_dir = Path(tempfile.gettempdir()) / "treadle-sandbox-uids"
        self._runs_dir = Path(tempfile.gettempdir()) / f"treadle-sandbox-{os.geteuid()}"
        self._runs_dir.mkdir(mode=0o711, exist_ok=True)
        sweep_stale_runs(self._runs_dir)

    @property
    def isolation(self) -> str:
        """The isolation runs get (``auto`` resolved by one probe run, remembered per process)."""
        if self._requested != "auto":
            return self._requested
        key = (self.python, os.geteuid())
        if key not in _RESOLVED:
            _RESOLVED[key] = self._probe()
        return _RESOLVED[key]

    def _probe(self) -> str:
        if os.geteuid() != 0:
            return "rlimits"
        try:
            self._run("pass", "", "namespaces")
            return "namespaces"
        except SandboxUnavailable as e:
            from treadle.common.log import get_logger  # noqa: PLC0415  (only on this rare path)

            get_logger(__name__).warning("sandbox: namespaces unavailable (%s); using rlimits + audit hook", e)
            return "rlimits"

    def describe(self) -> dict[str, Any]:
        """Limits and isolation, for a result's provenance."""
        return {"isolation": self.isolation, **asdict(self.limits)}

    def run(self, code: str, stdin: str = "") -> ExecResult:
        """Run ``code`` as ``__main__`` with ``stdin``; raises ``SandboxUnavailable`` if the jail fails."""
        return self._run(code, stdin, self.isolation)

    # ---- one run ------------------------------------------------------------------------

    def _run(self, code: str, stdin: str, isolation: str) -> ExecResult:
        workdir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self._runs_dir)).resolve()
        try:
            with self._uid(isolation) as uid:
                (workdir / "solution.py").write_text(code, encoding="utf-8")
                if uid is not None:
                    for p in (workdir, workdir / "solution.py"):
                        os.chown(p, uid, uid)
                    os.chmod(workdir, 0o700)
                return self._spawn(workdir, uid, stdin, isolation)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _config(self, workdir: Path, uid: int | None, status_fd: int, isolation: str) -> str:
        lim = self.limits
        return json.dumps({
            "workdir": str(workdir), "code_path": str(workdir / "solution.py"), "code_name": "solution.py",
            "uid": uid, "isolation": isolation, "status_fd": status_fd, "parent_pid": os.getpid(),
            "audit_hook": self.audit_hook, "expose": _interpreter_dirs(self.python),
            "limits": {"cpu_s": math.ceil(lim.cpu_s), "memory_bytes": lim.memory_mb << 20, "nproc": lim.nproc,
                       "fsize_bytes": lim.fsize_mb << 20, "nofile": lim.nofile},
        })

    def _spawn(self, workdir: Path, uid: int | None, stdin: str, isolation: str) -> ExecResult:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
               "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONIOENCODING": "utf-8"}
        status_r, status_w = os.pipe()
        start = time.monotonic()
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
            fin.write(stdin.encode("utf-8"))
            fin.seek(0)
            try:
                proc = subprocess.Popen(
                    [self.python, "-s", str(LAUNCHER), self._config(workdir, uid, status_w, isolation)],
                    stdin=fin, stdout=fout, stderr=ferr, cwd=workdir, env=env, pass_fds=(status_w,),
                    start_new_session=True, close_fds=True)
            finally:
                os.close(status_w)
            try:
                timed_out = self._wait(proc, self.limits.wall_s)
                status = _read_status(status_r)
            finally:
                os.close(status_r)
            wall = time.monotonic() - start
            if "setup_error" in status:
                raise SandboxUnavailable(f"{isolation} sandbox set-up failed: {status['setup_error']}")
            if proc.returncode == _SETUP_FAILED and not status:
                raise SandboxUnavailable(f"{isolation} sandbox launcher failed: {_cap(ferr, 2000)}")
            return _result(status, timed_out, wall, _cap(fout, self.limits.max_output_bytes),
                           _cap(ferr, self.limits.max_output_bytes), self.limits)

    @staticmethod
    def _wait(proc: subprocess.Popen[bytes], wall_s: float) -> bool:
        """Wait up to ``wall_s``; past it kill the process group. True when it had to be killed."""
        try:
            proc.wait(timeout=wall_s)
            return False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # before reaping: the group id cannot be reused yet
            proc.wait()
            return True

    @contextlib.contextmanager
    def _uid(self, isolation: str):  # -> Iterator[int | None]
        """A uid from the pool no other run holds (namespaces as root), else None."""
        if isolation != "namespaces" or os.geteuid() != 0:
            yield None
            return
        self._lock_dir.mkdir(mode=0o700, exist_ok=True)
        deadline = time.monotonic() + self.limits.wall_s + 30.0
        while True:
            for uid in self._uids:
                fh = open(self._lock_dir / f"{uid}.lock", "a")  # noqa: SIM115  (held across the yield)
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fh.close()
                    continue
                try:
                    yield uid
                finally:
                    fh.close()  # closing releases the lock
                return
            if time.monotonic() > deadline:
                raise SandboxUnavailable(f"all {len(self._uids)} sandbox uids are busy; raise uid_slots")
            time.sleep(0.01)


def sweep_stale_runs(runs_dir: Path) -> int:
    """Remove run folders whose creating process is gone (a reward worker killed mid-run cannot
    clean up after itself); folders are named ``<pid>-<random>``. Returns how many went."""
    removed = 0
    for d in runs_dir.iterdir():
        pid = d.name.split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed


_DIRS: dict[str, list[str]] = {}


def _interpreter_dirs(python: str) -> list[str]:
    """Folders the interpreter needs (prefixes, its bin folder), asked of it once per process."""
    if python not in _DIRS:
        probe = ("import os, sys; print('\\n'.join({sys.prefix, sys.base_prefix, sys.exec_prefix, "
                 "sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}))")
        if python == sys.executable:
            out = "\n".join({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                             os.path.dirname(os.path.realpath(sys.executable))})
        else:
            out = subprocess.run([python, "-s", "-c", probe], capture_output=True, text=True, check=True,
                                 timeout=60).stdout
        _DIRS[python] = sorted(os.path.realpath(p) for p in out.split("\n") if p.strip())
    return _DIRS[python]


def _read_status(fd: int) -> dict[str, Any]:
    """The launcher's JSON status line ({} if it died before writing one)."""
    chunks = []
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks).decode() or "{}")
    except ValueError:
        return {}


def _cap(f: IO[bytes], limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace")


def _result(status: dict[str, Any], timed_out: bool, wall: float, out: str, err: str,
            limits: SandboxLimits) -> ExecResult:
    code, sig = status.get("exit"), status.get("signal")
    cpu = float(status.get("cpu_s", 0.0))
    if timed_out:
        kind: Status = "timeout"
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= math.ceil(limits.cpu_s)):
        kind = "cpu_limit"
    elif sig == signal.SIGXFSZ:
        kind = "output_limit"
    elif sig is not None or code is None:
        kind = "killed"
    elif code == 0:
        kind = "ok"
    else:
        kind = "memory_limit" if "MemoryError" in err else "error"
    return ExecResult(status=kind, exit_code=code, signal=sig, stdout=out, stderr=err,
                      wall_s=round(wall, 4), cpu_s=cpu)
