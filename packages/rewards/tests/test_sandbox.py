"""Sandbox escapes, each contained by its limit: network, writes outside the folder, fork bomb,
infinite loop, sleeping forever, memory hog, output flood; and ordinary stdin/stdout programs.

Both layers are checked under namespace isolation: with the audit hook (the Python-level refusal)
and without it (the kernel: no network, read-only mounts, RLIMIT_NPROC for the run's uid). The
rlimits-only fallback is checked too. Limits are small: this machine has two cores.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from treadle.rewards.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

ROOT_LINUX = os.geteuid() == 0
LIMITS = SandboxLimits(cpu_s=1, wall_s=20, memory_mb=256, nproc=8, fsize_mb=1, max_output_bytes=4096)
needs_root = pytest.mark.skipif(not ROOT_LINUX, reason="namespace isolation needs root")


@pytest.fixture(scope="module", params=["namespaces", "namespaces-nohook", "rlimits"])
def sandbox(request):
    if request.param.startswith("namespaces"):
        if not ROOT_LINUX:
            pytest.skip("namespace isolation needs root")
        sb = Sandbox(LIMITS, isolation="namespaces", audit_hook=request.param == "namespaces")
        try:
            sb.run("pass")
        except SandboxUnavailable as e:
            pytest.skip(f"namespaces unavailable here: {e}")
        return sb
    return Sandbox(LIMITS, isolation="rlimits")


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if p.stat().st_uid == uid:
                    pids.append(int(p.name))
            except FileNotFoundError:
                pass
    return pids


def test_stdin_to_stdout(sandbox):
    res = sandbox.run("a, b = map(int, input().split())\nprint(a + b)", "2 3\n")
    assert res.status == "ok" and res.stdout == "5\n" and res.exit_code == 0


def test_exceptions_and_exit_codes(sandbox):
    res = sandbox.run("raise ValueError('nope')")
    assert res.status == "error" and res.exit_code == 1 and "ValueError: nope" in res.stderr
    assert sandbox.run("import sys; sys.exit(3)").exit_code == 3


def test_network_connect_is_contained(sandbox):
    code = ("import socket\ns = socket.socket(); s.settimeout(1)\n"
            "print(s.connect_ex(('127.0.0.1', 22)), s.connect_ex(('1.1.1.1', 80)))")
    res = sandbox.run(code)
    if res.status == "ok":  # no audit hook: the kernel answers, no route anywhere (ENETUNREACH)
        assert res.stdout.split() == ["101", "101"]
    else:
        assert "socket" in res.stderr and "not allowed" in res.stderr


@pytest.mark.parametrize("folder", ["/tmp", "/dev/shm"])
def test_write_outside_the_folder_is_contained(sandbox, folder):
    target = Path(folder) / f"treadle-escape-{uuid.uuid4().hex}.txt"  # world-writable folders
    try:
        res = sandbox.run(f"open({str(target)!r}, 'w').write('x')")
        assert res.status == "error" and not target.exists()
        assert "Read-only file system" in res.stderr or "outside the working directory" in res.stderr
    finally:
        target.unlink(missing_ok=True)
    inside = sandbox.run("open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())")
    assert inside.status == "ok" and inside.stdout == "ok\n"


def test_fork_bomb_is_contained(sandbox):
    code = ("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            import time; time.sleep(60)\n        n += 1\nexcept OSError as e:\n    print(n, e)\n")
    res = sandbox.run(code)
    assert res.status == "ok"
    if sandbox.isolation == "namespaces":  # forking is allowed; RLIMIT_NPROC stops it
        assert "Resource temporarily unavailable" in res.stdout
        assert int(res.stdout.split()[0]) < LIMITS.nproc
        assert not any(_uid_processes(uid) for uid in range(61000, 61064))  # the sleepers died with the run
    else:  # no namespaces: the audit hook refuses the first fork
        assert res.stdout.startswith("0 ") and "os.fork is not allowed" in res.stdout


def test_infinite_loop_hits_the_cpu_limit(sandbox):
    res = sandbox.run("while True:\n    pass")  # wall_s=20: even on a loaded machine CPU comes first
    assert res.status == "cpu_limit" and res.cpu_s > 0.9  # SIGXCPU at 1 s (tick granularity)


def test_sleeping_forever_is_killed_at_the_wall_clock(sandbox):
    hasty = Sandbox(dataclasses.replace(LIMITS, wall_s=1.5), isolation=sandbox.isolation, audit_hook=sandbox.audit_hook)
    res = hasty.run("import time\ntime.sleep(600)")
    assert res.status == "timeout" and res.cpu_s == 0.0


def test_memory_hog_hits_the_memory_limit(sandbox):
    res = sandbox.run("x = bytearray(1 << 30)\nprint('allocated')")
    assert res.status == "memory_limit" and "allocated" not in res.stdout


def test_output_flood_is_cut(sandbox):
    res = sandbox.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert res.status == "output_limit"
    assert len(res.stdout) == LIMITS.max_output_bytes  # read back capped


@needs_root
def test_namespace_run_uses_an_unprivileged_uid_and_its_own_pid_namespace():
    sb = Sandbox(LIMITS, isolation="namespaces")
    res = sb.run("import os\nprint(os.getuid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    uid, pids = res.stdout.split(" ", 1)
    assert 61000 <= int(uid) < 61064 and pids.strip() == "[1, 2]"
    assert sb.describe()["isolation"] == "namespaces" and sb.describe()["cpu_s"] == 1


def test_limits_are_validated():
    with pytest.raises(ValueError):
        SandboxLimits(memory_mb=16)
    with pytest.raises(ValueError):
        SandboxLimits(wall_s=0)


def test_run_folders_of_dead_processes_are_swept(tmp_path):
    from treadle.rewards.sandbox import sweep_stale_runs

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"{dead.pid}-abc").mkdir()
    (tmp_path / f"{os.getpid()}-def").mkdir()
    assert sweep_stale_runs(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{os.getpid()}-def"]


@pytest.mark.parametrize("parent_alive", [True, False])
def test_a_jail_whose_launcher_died_before_it_was_watching_exits(parent_alive):
    """The namespace's init cannot see its launcher's pid (it reads 0 whether the launcher lives
    or not), so it learns of a death that came before its PR_SET_PDEATHSIG from a pipe only the
    launcher writes to: at end of file it exits (121) instead of running the code unwatched."""
    from treadle.rewards.sandbox import LAUNCHER

    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); import launcher\n"
            "r, w = os.pipe()\n"
            f"{'' if parent_alive else 'os.close(w)'}\n"
            "launcher._die_with_parent(alive_fd=r)\n"
            "print('running')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(LAUNCHER.parent)],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == ((0, "running") if parent_alive else (121, "")), proc.stderr
