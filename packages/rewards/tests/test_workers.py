"""Worker pools: user functions run in their own processes; raising, hanging, crashing and
memory-hungry functions fail only their samples, and the pool keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys

import pytest

from treadle.rewards.api import RewardBatch
from treadle.rewards.loader import FunctionSpec, load, parse_ref
from treadle.rewards.workers import FunctionPool, WorkerDied

MISBEHAVING = """
    import asyncio, os, subprocess, sys, time

    def reward_func(queries, prompts, labels, **kwargs):
        print("chatty functions print to stdout:", queries)  # must not break the worker protocol
        for label in labels:
            if label == "raise":
                raise ValueError("this label is bad")
            if label == "crash":
                os._exit(3)
            if label == "memory":
                return {"rewards": [len(bytearray(2 << 30))] * len(queries)}
            if label.startswith("hang:"):
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                with open(label[5:], "w") as f:
                    f.write(f"{os.getpid()} {child.pid}")
                time.sleep(600)
        return {"rewards": [float(len(q)) for q in queries], "extra_logs": {"n": len(queries)}}
"""


def batch(*labels: str) -> RewardBatch:
    return RewardBatch(queries=[f"q{i}" for i in range(len(labels))], prompts=[""] * len(labels), labels=list(labels))


def run(coro):
    return asyncio.run(coro)


async def _with_pool(spec, body, **kw):
    pool = FunctionPool(spec, **{"size": 1, "timeout_s": 5.0, **kw})
    await pool.start()
    try:
        return await body(pool)
    finally:
        await pool.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_raising_samples_fail_alone(write_file):
    spec = parse_ref(str(write_file("misbehaving.py", MISBEHAVING)))

    async def body(pool):
        out = await pool.score(batch("ok", "raise", "ok"))
        assert out.rewards == [2.0, 0.0, 2.0]  # retried one by one: only the bad one fails
        assert out.failed == [False, True, False] and "ValueError: this label is bad" in out.errors[1]
        assert out.extra_logs["n"] == [1.0, 0.0, 1.0]
        whole = await pool.score(batch("ok", "ok"))
        assert whole.rewards == [2.0, 2.0] and whole.extra_logs["n"] == [2.0, 2.0]

    run(_with_pool(spec, body))


def test_without_isolation_the_whole_batch_fails(write_file):
    spec = parse_ref(str(write_file("misbehaving.py", MISBEHAVING)))

    async def body(pool):
        out = await pool.score(batch("ok", "raise"))
        assert out.failed == [True, True]

    run(_with_pool(spec, body, isolate=False))


def test_a_hang_is_killed_with_its_children_and_the_pool_recovers(write_file, tmp_path):
    spec = parse_ref(str(write_file("misbehaving.py", MISBEHAVING)))
    pids_file = tmp_path / "pids"
    events = []

    async def body(pool):
        out = await pool.score(batch(f"hang:{pids_file}", "ok"))
        assert out.failed == [True, True] and "timed out after 1.5 s" in out.errors[0]
        worker_pid, child_pid = map(int, pids_file.read_text().split())
        await asyncio.sleep(0.2)
        assert not _alive(worker_pid) and not _alive(child_pid)  # the whole process group was killed
        again = await pool.score(batch("ok"))  # a fresh worker took over
        assert again.rewards == [2.0] and again.failed == []

    run(_with_pool(spec, body, timeout_s=1.5, on_event=events.append))
    assert events[:2] == ["timeout", "restart"]


def test_a_crash_fails_the_batch_and_the_pool_recovers(write_file):
    spec = parse_ref(str(write_file("misbehaving.py", MISBEHAVING)))

    async def body(pool):
        out = await pool.score(batch("crash"))
        assert out.failed == [True] and "worker died" in out.errors[0] and "status 3" in out.errors[0]
        assert (await pool.score(batch("ok"))).rewards == [2.0]

    run(_with_pool(spec, body))


def test_memory_limit_turns_a_hog_into_a_failed_sample(write_file):
    spec = parse_ref(str(write_file("misbehaving.py", MISBEHAVING)))

    async def body(pool):
        out = await pool.score(batch("memory", "ok"))
        assert out.failed == [True, False] and "MemoryError" in out.errors[0]

    run(_with_pool(spec, body, memory_mb=512))


def test_async_functions_and_native_functions(write_file):
    path = write_file("various.py", """
        import asyncio
        from treadle.rewards.api import RewardOutput, native

        async def reward_func(queries, prompts, labels):
            await asyncio.sleep(0)
            return [1.0] * len(queries)

        @native(version="7")
        def typed(batch):
            return RewardOutput(rewards=[float(l) for l in batch.labels], failed=[l < 0 for l in batch.labels],
                                errors=["negative" if l < 0 else "" for l in batch.labels])
    """)

    async def body_async(pool):
        assert (await pool.score(batch("a", "b"))).rewards == [1.0, 1.0]

    async def body_native(pool):
        out = await pool.score(RewardBatch(queries=["x", "y"], prompts=["", ""], labels=[2, -1]))
        assert out.rewards == [2.0, -1.0] and out.failed == [False, True]
        assert pool.provenance["api"] == "native" and pool.provenance["version"] == "7"

    run(_with_pool(parse_ref(str(path)), body_async))
    run(_with_pool(parse_ref(f"{path}:typed"), body_native))


def test_a_broken_file_fails_at_start_with_the_reason(write_file):
    spec = parse_ref(str(write_file("broken.py", "def reward_func(queries, prompts, labels):\n    return [\n")))
    with pytest.raises(WorkerDied, match="SyntaxError"):
        run(_with_pool(spec, None))
    spec = parse_ref(str(write_file("two_args.py", "def reward_func(queries, prompts):\n    return queries\n")))
    with pytest.raises(WorkerDied, match="takes 2 arguments"):
        run(_with_pool(spec, None))


def test_refs_and_provenance(write_file):
    path = write_file("rf.py", "def reward_func(q, p, l):\n    return [0.0] * len(q)\ndef other(q, p, l):\n    return q\n")
    assert parse_ref("math").builtin and parse_ref(str(path)).name == "rf"
    assert parse_ref(f"{path}:other") == FunctionSpec(name="rf.other", source=str(path.resolve()), function="other")
    with pytest.raises(ValueError, match="neither a built-in"):
        parse_ref("nonsense")
    with pytest.raises(ValueError, match="does not exist"):
        parse_ref("missing.py")
    prov = load(parse_ref(str(path))).provenance
    assert prov["kind"] == "file" and prov["api"] == "openrlhf" and len(prov["sha256"]) == 64


def _launchers() -> list[int]:
    """Pids of sandbox launchers (L, I and U all run launcher.py) alive now."""
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if b"_sandbox/launcher.py" in f.read() and _alive(int(p)):
                        pids.append(int(p))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return pids


def test_killing_a_worker_takes_its_running_sandbox_with_it():
    spec = parse_ref("code", {"cpu_s": 5, "wall_s": 60, "memory_mb": 256, "nproc": 8})
    sleeper = RewardBatch(queries=["```python\nimport time\ntime.sleep(600)\n```"], prompts=[""],
                          labels=[{"tests": [{"input": "", "output": ""}]}])

    async def body(pool):
        assert _launchers() == []
        out = await pool.score(sleeper)
        assert out.failed == [True] and "timed out" in out.errors[0]
        # The kernel delivers the signals asynchronously, and a process inside a mount or namespace
        # call (the jail's set-up, on a machine busy tearing other jails down) dies when it returns.
        for _ in range(300):
            if not _launchers():
                break
            await asyncio.sleep(0.1)
        assert _launchers() == [], _describe(_launchers())

    run(_with_pool(spec, body, timeout_s=2.0))


def _describe(pids: list[int]) -> dict[int, str]:
    """What a failure report needs of a process: state, parent, group, pids in its namespaces."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            out[pid] = " ".join(line.strip() for line in f if line.split(":")[0] in ("State", "PPid", "NSpid", "NSpgid"))
    return out


def test_own_sessions_are_the_children_that_lead_their_own_group():
    from treadle.rewards.workers import own_sessions

    alone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    along = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = own_sessions(os.getpid())
        assert alone.pid in found and along.pid not in found
    finally:
        for p in (alone, along):
            p.kill()
            p.wait()
