"""GPU: the vLLM backend on CUDA (vLLM 0.26 on the GPU machine, brought by tools/gpu_vllm).

- The conformance suite: test_conformance.py's own test functions, collected here with
  ``subject`` bound to the vLLM engine only (conftest's ``vllm_engine``: fp32, eager, on CUDA
  there); the hf engine stays on CPU as the reference of the cross-backend greedy test. fp32 is
  exact only with Triton's IEEE fp32 dots (vLLM's Triton attention multiplies fp32 in TF32
  otherwise): tools/gpu_tests.sh sets ``TRITON_F32_DEFAULT=ieee``.
- bf16: sampled and prompt logprobs against the HF model in bf16 (the same rounded weights).
- Real sleep: levels 1 and 2 give GPU memory back; level 1 keeps the weights bit for bit, level 2
  drops them until a weight update brings them back (weight digests equal).

Run by `make test-gpu` (tools/gpu_tests.sh) on the GPU machine once vLLM is carried there.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from treadle_testing import load_by_path, load_tool

from treadle.common.records import GenerateRequest, InlineWeights, SamplingParams

# device_count(), not is_available(): that asks the CUDA runtime, which poisons fork, and vLLM forks its
# engine core ("Cannot re-initialize CUDA in forked subprocess"); device_count() asks NVML.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs CUDA")]

# Every test_* of the conformance module, collected again here (this module's fixtures apply).
_suite = load_by_path("treadle_rollout_conformance", Path(__file__).with_name("test_conformance.py"))
globals().update({k: v for k, v in vars(_suite).items() if k.startswith("test_")})

PROMPTS = _suite.PROMPTS
BF16_TOL = 5e-2  # max |logprob gap| vLLM bf16 vs HF bf16 (PLATFORM.md: bf16 ~5e-2)
GIB = 1 << 30


@pytest.fixture
def subject(vllm_engine):
    return vllm_engine


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tools/tiny_model.py's "small" preset (untied lm_head, head_dim 64, ~12M parameters)."""
    return load_tool("tiny_model").build("small", tmp_path_factory.mktemp("small") / "m", seed=0).out


@pytest.fixture(scope="module")
def bf16_engine(aio, small):
    """A bf16 vLLM engine with sleep mode and a 2 GiB KV cache (small, so that the daemon's engines
    that start after it, at vLLM's default 0.9 of the GPU, find that much free even before its
    engine core has gone)."""
    pytest.importorskip("vllm")
    from treadle.rollout.engine.vllm_engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(VllmEngineConfig(model=str(small), engine_id="vllm-bf16", dtype="bfloat16",
                                         max_model_len=1024, enforce_eager=True, eos_token_ids=(),
                                         gpu_memory_utilization=0.05, kv_cache_memory_bytes=2 * GIB,
                                         enable_sleep_mode=True))
    aio(engine.start(), timeout=300)
    yield engine
    aio(engine.close())


@pytest.fixture(scope="module")
def hf_bf16(small):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small, dtype=torch.bfloat16).eval()


def _generate(aio, engine, reqs):
    async def all_of():
        return await asyncio.gather(*(_suite.collect(engine, q) for q in reqs))

    return aio(all_of())


# top-k / top-p are left out: in bf16 a token at the cut falls on either side of it (an infinite gap)
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0)])
def test_bf16_logprobs_match_the_hf_model(bf16_engine, hf_bf16, aio, tools, temperature, top_k, top_p):
    reqs = [GenerateRequest(prompt_token_ids=p, sampling=SamplingParams(
        n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=32, seed=11)) for p in PROMPTS]
    outs = _generate(aio, bf16_engine, reqs)
    gaps = np.concatenate([
        np.abs(tools.logprobs(hf_bf16, p, r.response_token_ids, temperature=temperature, top_k=top_k,
                              top_p=top_p) - r.logprobs)
        for p, res in zip(PROMPTS, outs, strict=True) for r in res])
    print(f"bf16 vLLM vs HF T={temperature} top_k={top_k} top_p={top_p}: |gap| max {gaps.max():.2e} "
          f"mean {gaps.mean():.2e} over {gaps.size} tokens")
    assert gaps.max() <= BF16_TOL
    got = aio(bf16_engine.prompt_logprobs(PROMPTS[2]))
    assert np.abs(got - tools.prompt_logprobs(hf_bf16, PROMPTS[2])).max() <= BF16_TOL


def _gpu_used() -> int:
    """Bytes in use on GPU 0, from NVML (CUDA in this process would keep vLLM from forking)."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


def test_sleep_levels_give_memory_back_and_wake_serves_the_same_weights(bf16_engine, aio, small, tools):
    e = bf16_engine
    before, digest = aio(e.prompt_logprobs(PROMPTS[2])), aio(e.weight_digest())
    awake = _gpu_used()

    one = aio(e.sleep(1))
    asleep1 = _gpu_used()
    aio(e.wake())
    after1 = aio(e.prompt_logprobs(PROMPTS[2]))
    two = aio(e.sleep(2))
    asleep2 = _gpu_used()
    aio(e.wake())
    print(f"GPU used: awake {awake / GIB:.2f} GiB, level 1 {asleep1 / GIB:.2f} GiB, level 2 {asleep2 / GIB:.2f} GiB")
    assert one.memory_released and not one.weights_dropped and awake - asleep1 > GIB
    assert two.memory_released and two.weights_dropped and awake - asleep2 > GIB
    assert np.array_equal(after1, before)  # level 1 kept the weights
    assert e.stats().broken  # level 2 dropped them: refused until a weight update

    base = {n: t.to(torch.bfloat16) for n, t in tools.checkpoint(small).items()}
    aio(e.update_weights(InlineWeights(version=e.weight_version + 1, names=list(base), dtypes=["bfloat16"] * len(base),
                                      shapes=[list(t.shape) for t in base.values()], tensors=list(base.values()))))
    assert not e.stats().broken and aio(e.weight_digest()) == digest  # bit-identical again
    assert np.abs(aio(e.prompt_logprobs(PROMPTS[2])) - before).max() <= 1e-3
