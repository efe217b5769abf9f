"""On 2 GPUs (``-m gpu``): weight sync from a bf16 ZeRO-3 trainer (2 ranks under torchrun) to
real ``treadle-rollout serve --backend hf --engine.device cuda`` daemons (bf16, tiny model "a"):
over NCCL to a daemon on GPU 1, over CUDA IPC to a daemon on GPU 0 (rank 0's GPU), bucketed
and per tensor, two versions each (``gpu_weight_scenarios.py``), over CUDA IPC from both ranks to
a daemon with an engine on each GPU (each maps its own GPU's copy), and by two senders taking
turns on the NCCL daemon. After every sync the daemon's
weights are bit-identical to the trainer's (digests) and its prompt logprobs match the
trainer's own forward; a cuda_ipc update to the daemon on the other GPU is refused.

The processes inherit this one's PYTHONPATH (on the GPU machine the wheels it lacks live there).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from treadle_testing import free_port, load_tool

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SRC = [ROOT / "packages" / p / "src" for p in ("common", "rollout", "trainer")]
MISSING = [m for m in ("deepspeed", "zmq", "msgspec") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
              pytest.mark.skipif(bool(MISSING), reason=f"needs {MISSING}")]
BF16_TOL = 0.05


def child_env() -> dict[str, str]:
    from treadle.common import env

    path = os.pathsep.join([*map(str, SRC), *filter(None, [os.environ.get("PYTHONPATH", "")])])
    return env.child_env({"PYTHONPATH": path, "TREADLE_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
                          "TOKENIZERS_PARALLELISM": "false", "NCCL_NVLS_ENABLE": "0"})


class GpuDaemon:
    """One ``treadle-rollout serve`` on one GPU (hf backend, bf16, one engine)."""

    def __init__(self, model: Path, gpu: str, cpus: str, engines: int = 1) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.rollout", "serve", "--endpoint", self.endpoint, "--model", str(model),
             "--backend", "hf", "--engines", str(engines), "--gpu_ids", *gpu.split(","), "--cpus", *cpus.split(","),
             "--engine.device", "cuda", "--engine.dtype", "bfloat16", "--health_interval_s", "1"],
            env=child_env(), start_new_session=True, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        from treadle.rollout.client import SyncRolloutClient

        with contextlib.closing(SyncRolloutClient(self.endpoint)) as c:
            c.wait_ready(180)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tiny = load_tool("tiny_model")
    root = tmp_path_factory.mktemp("models")
    return {n: tiny.build("tiny", root / n, seed=s).out for n, s in (("a", 0), ("b", 1))}


@pytest.fixture(scope="module")
def daemons(models: dict[str, Path]) -> dict[str, GpuDaemon]:
    started = {"nccl": GpuDaemon(models["a"], "1", "8,9,10,11"), "ipc": GpuDaemon(models["a"], "0", "12,13,14,15"),
               "pair": GpuDaemon(models["a"], "0,1", "4,5,6,7", engines=2)}
    try:
        for d in started.values():
            d.wait_ready()
        yield started
    finally:
        for d in started.values():
            d.stop()


def test_zero3_weights_reach_gpu_daemons_bit_identical_over_nccl_and_ipc(daemons, models, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "gpu_weight_scenarios.py"), "--model", str(models["b"]), "--out", str(tmp_path),
           "--nccl_endpoint", daemons["nccl"].endpoint, "--ipc_endpoint", daemons["ipc"].endpoint,
           "--pair_endpoint", daemons["pair"].endpoint]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    main = results[0]
    print(json.dumps({k: v for k, v in main.items() if k != "world"}, indent=None))
    for name in ("nccl_bucketed", "nccl_per_tensor", "ipc_bucketed", "ipc_per_tensor"):
        first, second = main[name]
        for r in (first, second):
            assert r["digest_ok"] and r["gap"] <= BF16_TOL, (name, r)
            assert r["report"]["updated"] == ["e0"] and r["version"] == r["report"]["version"], (name, r)
        assert second["version"] == first["version"] + 1
    for r in main["ipc_every_rank"]:  # each engine mapped the copy on its own GPU
        assert r["digest_ok"] and r["engines"] == 2 and r["report"]["updated"] == ["e0", "e1"], r
    assert main["nccl_bucketed"][0]["report"]["buckets"] > 1 and main["ipc_per_tensor"][0]["report"]["buckets"] == 26
    for r in main["two_senders"]:  # first, second, first again on one daemon's NCCL group
        assert r["digest_ok"] and r["report"]["updated"] == ["e0"], r
    assert [r["ipc_elsewhere"] for r in results] == ["BadRequest", "BadRequest"]
    assert main["ipc_elsewhere_unchanged"]
