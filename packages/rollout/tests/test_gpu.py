"""GPU: the engines on CUDA, receiving weights over NCCL and by CUDA IPC.

NCCL needs 2 GPUs (NCCL refuses two ranks on one device): the sender broadcasts from cuda:0 in a
thread, the HF engine receives on cuda:1. CUDA IPC needs one: a sender process packs the tiny
model "b" into buckets on cuda:0 and shares them (``ipc.encode_buckets``); the engine on cuda:0
maps and loads them (``IpcWeights``). Run by `make test-gpu` on the GPU machine (the vLLM case
only where vLLM is installed for CUDA).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from treadle.common.records import (
    CollectiveWeights,
    GenerateRequest,
    IpcWeights,
    SamplingParams,
    WeightGroupSpec,
)
from treadle.common.weights import WeightGroup, plan_buckets
from treadle.rollout.engine.hf_engine import HfEngine, HfEngineConfig

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_hf_engine_on_gpu_receives_nccl_broadcast(models, ref, tools):
    b = tools.checkpoint(models["b"])
    names = list(b)
    on_gpu0 = [t.to("cuda:0") for t in b.values()]
    spec = WeightGroupSpec(host="127.0.0.1", port=tools.free_port(), world_size=2, rank=0, backend="nccl",
                           timeout_s=120)
    upd = CollectiveWeights(version=1, names=names, dtypes=["float32"] * len(names),
                            shapes=[list(t.shape) for t in on_gpu0],
                            bucket_sizes=plan_buckets([t.numel() * 4 for t in on_gpu0], 64 << 10))
    prompt = np.arange(3, 30, dtype=np.int32)

    def sender():
        torch.cuda.set_device(0)
        group = WeightGroup(spec)
        tools.send_buckets(group, on_gpu0, upd.bucket_sizes)
        torch.cuda.synchronize()
        group.close()

    async def scenario():
        engine = HfEngine(HfEngineConfig(model=str(models["a"]), device="cuda:1", eos_token_ids=()))
        async with engine:
            req = GenerateRequest(prompt_token_ids=prompt, sampling=SamplingParams(n=2, max_tokens=16, seed=1))
            before = [r async for r in engine.generate(req)]
            thread = threading.Thread(target=sender)
            thread.start()
            await engine.join_weight_group(spec.with_rank(1))
            await engine.receive_weights(upd)
            await asyncio.to_thread(thread.join, 60)
            after = [r async for r in engine.generate(req)]
            received = {n: p.detach().cpu() for n, p in engine.model.state_dict().items()}
            await engine.leave_weight_group()
            return before, after, received, await engine.prompt_logprobs(prompt)

    before, after, received, scored = asyncio.run(scenario())
    assert all(torch.equal(received[n].view(torch.uint8), b[n].view(torch.uint8)) for n in names)  # bit-identical
    for model, results in ((ref["a"], before), (ref["b"], after)):
        for r in results:
            assert np.abs(tools.logprobs(model, prompt, r.response_token_ids) - r.logprobs).max() <= 1e-4
    assert np.abs(scored - tools.prompt_logprobs(ref["b"], prompt)).max() <= 1e-4
    assert {r.weight_version for r in after} == {1}


# The sender's process: model b's tensors packed back to back into one CUDA buffer of buckets,
# shared once; it keeps the buffer until the engine has answered (a line on stdin).
_IPC_SENDER = """
import json, sys, torch
from safetensors.torch import load_file
from treadle.common import ipc
from treadle.common.weights import bucket_layout, bucket_ranges, bucket_views, plan_buckets
w = load_file(sys.argv[1])
names = sorted(w)
ts = [w[n].float().to("cuda:0") for n in names]
shapes = [list(t.shape) for t in ts]
sizes = plan_buckets([t.numel() * 4 for t in ts], int(sys.argv[2]))
ranges = bucket_ranges(sizes, len(ts))
totals = [bucket_layout(["float32"] * (hi - lo), shapes[lo:hi])[1] for lo, hi in ranges]
buf = torch.zeros(sum(totals), dtype=torch.uint8, device="cuda:0")
spans, at = [], 0
for (lo, hi), n in zip(ranges, totals):
    for view, t in zip(bucket_views(buf[at:at + n], ["float32"] * (hi - lo), shapes[lo:hi]), ts[lo:hi]):
        view.copy_(t)
    spans.append((at, n))
    at += n
torch.cuda.synchronize()
handles = ipc.encode_buckets(buf, spans)
print(json.dumps({"names": names, "shapes": shapes, "sizes": sizes, "handles": [h.hex() for h in handles]}), flush=True)
sys.stdin.readline()
"""


def _vllm_on_gpu(models):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip("needs vLLM built for CUDA")
    from treadle.rollout.engine.vllm_engine import VllmEngine, VllmEngineConfig

    return VllmEngine(VllmEngineConfig(model=str(models["a"]), dtype="float32", enforce_eager=True, max_model_len=512,
                                       gpu_memory_utilization=0.3, eos_token_ids=(), engine_id="vllm-ipc"))


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_engine_on_gpu_loads_cuda_ipc_buckets_of_a_colocated_sender(models, ref, tools, backend):
    engine = (HfEngine(HfEngineConfig(model=str(models["a"]), device="cuda:0", eos_token_ids=()))
              if backend == "hf" else _vllm_on_gpu(models))
    prompt = np.arange(3, 30, dtype=np.int32)
    sender = subprocess.Popen([sys.executable, "-c", _IPC_SENDER, str(Path(models["b"]) / "model.safetensors"), str(64 << 10)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        plan = json.loads(sender.stdout.readline())
        update = IpcWeights(version=1, names=plan["names"], dtypes=["float32"] * len(plan["names"]),
                            shapes=plan["shapes"], bucket_sizes=plan["sizes"],
                            handles=[bytes.fromhex(h) for h in plan["handles"]])

        async def scenario():
            async with engine:
                version = await engine.update_weights(update)
                return version, await engine.prompt_logprobs(prompt), engine.stats()

        version, scored, stats = asyncio.run(scenario())
        sender.stdin.write("done\n")
        sender.stdin.flush()
        assert sender.wait(60) == 0  # the sender frees its buffer: nothing of the engine's still maps it
    finally:
        if sender.poll() is None:
            sender.kill()
    assert len(plan["sizes"]) > 1 and version == 1 and not stats.broken
    assert np.abs(scored - tools.prompt_logprobs(ref["b"], prompt)).max() <= 1e-4
