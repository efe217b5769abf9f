"""GPU: the HF engine on CUDA, receiving weights over NCCL through the same group code as gloo.

Needs 2 GPUs (NCCL refuses two ranks on one device): the sender broadcasts from cuda:0 in a
thread, the engine receives on cuda:1. Run by `make test-gpu` on the GPU machine (no vLLM there).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from treadle.common.records import GenerateRequest, SamplingParams, WeightUpdate
from treadle.rollout.engine.group import GroupSpec, WeightGroup, send_buckets
from treadle.rollout.engine.hf_engine import HfEngine, HfEngineConfig
from treadle.rollout.engine.weights import plan_buckets

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_hf_engine_on_gpu_receives_nccl_broadcast(models, ref, tools):
    b = tools.checkpoint(models["b"])
    names = list(b)
    on_gpu0 = [t.to("cuda:0") for t in b.values()]
    spec = GroupSpec(host="127.0.0.1", port=tools.free_port(), world_size=2, rank=0, backend="nccl", timeout_s=120)
    upd = WeightUpdate(version=1, names=names, dtypes=["float32"] * len(names),
                       shapes=[list(t.shape) for t in on_gpu0], transport="collective",
                       bucket_sizes=plan_buckets([t.numel() * 4 for t in on_gpu0], 64 << 10))
    prompt = np.arange(3, 30, dtype=np.int32)

    def sender():
        torch.cuda.set_device(0)
        group = WeightGroup(spec)
        send_buckets(group, on_gpu0, upd.bucket_sizes)
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
