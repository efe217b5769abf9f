"""``--exit_with_pid``: a daemon whose starter dies (killed hard, so it never stops the daemon) shuts
itself down, engines included (the trainer's own daemon was left running after a SIGKILL, found by
tools/openrlhf_scripts.py). A real daemon of one hf engine; the starter is a ``sleep`` process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil


def test_the_daemon_and_its_engine_exit_once_the_pid_is_gone(models, tools):
    from treadle.rollout.client import SyncRolloutClient

    starter = subprocess.Popen(["sleep", "600"])
    endpoint = f"tcp://127.0.0.1:{tools.free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "treadle.rollout", "serve", "--endpoint", endpoint, "--model",
                             str(models["a"]), "--engines", "1", "--backend", "hf", "--exit_with_pid",
                             str(starter.pid)], start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        with SyncRolloutClient(endpoint) as rc:
            rc.wait_ready(timeout=300)
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        assert len(tree) >= 2  # the front end and its engine worker
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        assert proc.wait(timeout=120) == 0  # a clean shutdown, as on SIGTERM
        _, alive = psutil.wait_procs([psutil.Process(p) for p in tree if psutil.pid_exists(p)], timeout=60)
        assert not alive, alive
    finally:
        starter.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
