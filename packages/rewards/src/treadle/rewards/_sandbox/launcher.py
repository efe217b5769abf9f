"""Child side of ``treadle.rewards.sandbox``: set up the jail, run one program, report how it ended.

Run as ``python -s launcher.py CONFIG_JSON`` by the parent, with its working directory already
set to the run's temporary folder and a minimal environment. Standard library only: nothing of
treadle (or anything on the parent's ``PYTHONPATH``) is importable here, on purpose; this file
sits alone in its folder so the script directory that Python puts first on ``sys.path`` can
shadow nothing.

Process tree (``namespaces`` isolation, as root)::

    launcher L   unshare(net, mount, pid); private mounts; every mount read-only but the workdir
      init I     pid 1 of the new pid namespace; fresh /proc; waits, reports, exits
        user U   drops to the run's uid, sets rlimits, installs the audit hook, runs the code

When I exits, the kernel kills every process left in the namespace (a fork bomb's children, a
daemonised grandchild) and reaps them, so nothing outlives a run. Each of L, I and U dies with its
parent (``PR_SET_PDEATHSIG``), so a killed reward worker takes its running jail with it. ``rlimits`` isolation (not
root) skips L's namespaces: I is L itself and the audit hook also refuses fork/exec/ctypes.

The status pipe (``status_fd``) gets one JSON line: ``{"exit": c}`` or ``{"signal": s}`` plus
``cpu_s``/``maxrss_kb`` of U, or ``{"setup_error": "..."}`` when the jail could not be built.
What this file does not do: time limits by the wall clock (the parent kills the process group),
reading output (stdout/stderr are files the parent opened).
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
_KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
SETUP_FAILED = 121
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enc(s):
    return None if s is None else s.encode()


def _mount(source, target, fstype, flags, what):
    _check(_libc.mount(_enc(source), _enc(target), _enc(fstype), ctypes.c_ulong(flags), None), what)


def _mounts():
    """(mount point, per-mount flags to keep, writable) of every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \040 etc. in names
            opts = fields[5].split(",")
            keep = 0
            for opt in opts:
                keep |= _KEEP.get(opt, 0)
            out.append((point, keep, "rw" in opts))
    return out


def _die_with_parent(parent_pid=None, alive_fd=None):
    """SIGKILL this process when its parent dies (a killed reward worker must not leave a run
    behind). The parent may have died before the prctl took effect: then ``getppid()`` is no
    longer ``parent_pid``, or, where the parent lives outside this pid namespace (its pid reads 0
    here, dead or alive), ``alive_fd`` (the read end of a pipe whose write end only the parent
    holds) is at end of file."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(SETUP_FAILED)
    if alive_fd is not None:
        os.set_blocking(alive_fd, False)
        try:
            gone = os.read(alive_fd, 1) == b""
        except BlockingIOError:  # open and empty: the parent is alive
            gone = False
        os.close(alive_fd)
        if gone:
            os._exit(SETUP_FAILED)


def _blocking_ancestor(path):
    """(A, E): the top-most folder A on the way to ``path`` that others cannot enter, and E, the
    entry below A leading to ``path``; None when others can reach ``path``."""
    parts = path.strip("/").split("/")
    for i in range(len(parts)):
        a = "/" + "/".join(parts[:i])
        if not os.stat(a).st_mode & 0o001:
            return a, parts[i]
    return None


def _expose(workdir, paths):
    """Make ``paths`` (the interpreter's own folders) reachable by the unprivileged uid.

    A Python installed under a private folder (pyenv in /root) is unreadable once U drops root.
    For each such private ancestor A: bind the needed entries of A aside, cover A with an empty
    tmpfs (hiding the rest of it), and move the entries back. Only this namespace sees it.
    """
    wanted = {}
    for p in paths:
        hit = _blocking_ancestor(p)
        if hit is not None:
            wanted.setdefault(hit[0], set()).add(hit[1])
    for i, (a, entries) in enumerate(sorted(wanted.items())):
        staged = []
        for j, entry in enumerate(sorted(entries)):
            stage = os.path.join(workdir, f".stage{i}_{j}")
            os.mkdir(stage)
            _mount(os.path.join(a, entry), stage, None, MS_BIND | MS_REC, f"stage {a}/{entry}")
            staged.append((stage, entry))
        _mount("tmpfs", a, "tmpfs", MS_NOSUID | MS_NODEV, f"cover {a}")
        os.chmod(a, 0o755)
        for stage, entry in staged:
            os.mkdir(os.path.join(a, entry))
            _mount(stage, os.path.join(a, entry), None, MS_MOVE, f"expose {a}/{entry}")
            os.rmdir(stage)


def _jail_filesystem(workdir, expose):
    """Private mount tree; everything read-only except ``workdir`` (a bind mount of itself)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, "make mounts private")
    _mount(workdir, workdir, None, MS_BIND, "bind the workdir")
    _expose(workdir, expose)
    for point, keep, writable in _mounts():
        if point == workdir:
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, f"remount {point} read-only")
        except OSError:
            # Kernel pseudo-filesystems only take writes from root, which U is not; any other
            # mount left writable would be a hole in the jail.
            if writable and not point.startswith(("/proc", "/sys")):
                raise
    _mount(None, workdir, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, "remount the workdir nosuid")


def _set_limits(lim):
    cpu = int(lim["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL 1 s later
    mem = lim["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["fsize_bytes"], lim["fsize_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PATH_EVENTS = {  # event -> indexes of path arguments that must stay inside the workdir
    "os.remove": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.mkdir": (0,),
    "os.rmdir": (0,), "os.chmod": (0,), "os.chown": (0,), "os.symlink": (1,), "os.link": (1,),
    "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,),
    "shutil.move": (1,),
}
_ALWAYS_BLOCKED = {"socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo",
                   "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "sys.remote_exec"}
_PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system",
                   "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "pty.spawn"}


def _audit_hook(workdir, block_processes):
    """The hook U installs before running the code: refuses network, ctypes, writes outside
    ``workdir`` (and, without namespaces, new processes). Defence in depth: it binds Python code
    only; the kernel limits are what hold against anything else."""
    root = os.path.realpath(workdir)
    blocked = _ALWAYS_BLOCKED | (_PROCESS_EVENTS if block_processes else set())
    realpath, join, fspath, sep = os.path.realpath, os.path.join, os.fspath, os.sep

    def inside(path):
        if isinstance(path, int) or path is None:
            return True  # an fd we already hold, or a path-less call
        p = realpath(join(root, fspath(path) if not isinstance(path, bytes) else os.fsdecode(path)))
        return p == root or p.startswith(root + sep) or p == "/dev/null"

    def hook(event, args):
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (flags or 0) & _WRITE_FLAGS or (isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args) and not inside(args[i]):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the working directory")

    return hook


def _run_user(cfg):
    """Body of U: drop privileges, limit, hook, run. Never returns."""
    rc = 1
    try:
        import traceback  # loaded now: printing the program's error must need no import later

        os.close(cfg["status_fd"])
        os.chdir(cfg["workdir"])  # again: the inherited cwd still points below the bind mount
        with open(cfg["code_path"], encoding="utf-8") as f:
            code = compile(f.read(), cfg["code_name"], "exec")
        if cfg.get("uid") is not None and os.geteuid() == 0:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        _set_limits(cfg["limits"])
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; at the size limit, die by it
        if cfg.get("audit_hook", True):
            sys.addaudithook(_audit_hook(cfg["workdir"], cfg["isolation"] != "namespaces"))
        sys.argv = [cfg["code_name"]]
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
    except BaseException:  # the program's own failure: print it like Python would
        try:
            traceback.print_exc()
        except BaseException:
            os.write(2, f"sandbox: the program failed: {sys.exc_info()[0]!r}\n".encode())
        rc = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    os._exit(rc & 0xFF)


def _supervise(cfg, pid_namespace):
    """Body of I: run U, reap everything, report U's end on the status pipe. Never returns."""
    if pid_namespace:
        # Without a fresh /proc the read-only host one stays; U's uid cannot signal or trace anything there.
        with contextlib.suppress(OSError):
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mount /proc")
    me = os.getpid()
    user = os.fork()
    if user == 0:
        _die_with_parent(parent_pid=me)
        _run_user(cfg)
    status = {}
    while True:
        try:
            pid, st, ru = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if pid == user:
            status = {"exit": os.WEXITSTATUS(st)} if os.WIFEXITED(st) else {"signal": os.WTERMSIG(st)}
            status.update(cpu_s=round(ru.ru_utime + ru.ru_stime, 4), maxrss_kb=ru.ru_maxrss)
            break  # leaving kills what U left behind (pid namespace); the parent's killpg otherwise
    os.write(cfg["status_fd"], (json.dumps(status) + "\n").encode())
    os._exit(0)


def main():
    cfg = json.loads(sys.argv[1])
    _die_with_parent(parent_pid=cfg["parent_pid"])
    namespaces = cfg["isolation"] == "namespaces"
    if namespaces:
        try:
            _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare(net, mount, pid)")
            _jail_filesystem(cfg["workdir"], cfg.get("expose", ()))
        except OSError as e:
            os.write(cfg["status_fd"], (json.dumps({"setup_error": str(e)}) + "\n").encode())
            os._exit(SETUP_FAILED)
        alive_r, alive_w = os.pipe()  # L keeps the write end until it exits
        init = os.fork()  # the first child is pid 1 of the new namespace
        if init == 0:
            os.close(alive_w)
            _die_with_parent(alive_fd=alive_r)  # L lives outside the namespace: its pid reads 0 in here
            # ...and when init dies, the kernel kills the whole namespace
            _supervise(cfg, pid_namespace=True)
        os.close(alive_r)
        _, st = os.waitpid(init, 0)
        os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)
    _supervise(cfg, pid_namespace=False)


if __name__ == "__main__":
    main()
