"""LoRA adapter weight updates (issue 33): an engine serves its base model with the adapter an
update carries (``WeightUpdate.adapter``), and computes what the merged model computes.

Both backends, in this process: the hf engine (PEFT's layers injected) and vLLM's CPU build
(``enable_lora``, the adapter staged as a PEFT folder). The reference is PEFT's own merge of the
same adapter into tiny model "a", run by transformers in fp32.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from treadle.common.errors import BadRequest, WeightMismatch
from treadle.common.records import GenerateRequest, InlineWeights, LoraAdapter, SamplingParams

PROMPT = list(range(5, 45))
TOL = 1e-4  # fp32 both sides: the adapter's product added in the forward vs merged into W


def lora_model(base: Any, seed: int) -> Any:
    """PEFT adapters (r 4, alpha 8) on every linear layer of a copy of ``base``, B nonzero."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def adapter_update(model: Any, version: int, **over: Any) -> InlineWeights:
    """The adapter of ``model`` as PEFT saves it, as an inline update."""
    from peft import get_peft_model_state_dict

    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    cfg = model.peft_config["default"]
    adapter = LoraAdapter(rank=cfg.r, alpha=cfg.lora_alpha, target_modules=sorted(cfg.target_modules))
    fields = dict(version=version, names=list(state), dtypes=["float32"] * len(state),
                  shapes=[list(t.shape) for t in state.values()], tensors=list(state.values()), adapter=adapter)
    return InlineWeights(**{**fields, **over})


@pytest.fixture(scope="module")
def lora_vllm(aio, models):
    pytest.importorskip("vllm")
    from treadle.rollout.engine import ENGINES

    cls, cfg = ENGINES["vllm"]
    engine = cls(cfg(model=str(models["a"]), engine_id="vllm-lora", max_model_len=512, dtype="float32",
                     enforce_eager=True, eos_token_ids=(), kv_cache_memory_bytes=32 << 20, max_lora_rank=8))
    aio(engine.start(), timeout=300)
    yield engine
    aio(engine.close())


@pytest.fixture(params=["hf", "vllm"])
def engine(request, hf_engine):
    return hf_engine.engine if request.param == "hf" else request.getfixturevalue("lora_vllm")


def greedy(aio, engine: Any) -> tuple[list[int], np.ndarray]:
    async def go() -> Any:
        req = GenerateRequest(key="k", prompt_token_ids=np.asarray(PROMPT, dtype=np.int32),
                              sampling=SamplingParams(max_tokens=8, temperature=0.0, logprobs=True))
        return [r async for r in engine.generate(req)][0]

    res = aio(go())
    return res.response_token_ids.tolist(), res.logprobs


def test_adapter_spec_names_every_adapted_weight(models):
    from treadle.rollout.engine.weights import adapter_spec, spec_from_checkpoint

    spec = adapter_spec(spec_from_checkpoint(models["a"]), 4, ["q_proj", "down_proj"], "float32")
    q = spec.required["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    d = spec.required["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert q.shape == (4, 64) and d.shape == (64, 4)  # tiny: hidden 64, intermediate 128
    assert len(spec.required) == 2 * 2 * 2  # 2 modules x 2 layers x (A, B)
    with pytest.raises(WeightMismatch, match="target_modules"):
        adapter_spec(spec_from_checkpoint(models["a"]), 4, ["no_such"], "float32")


def test_vllm_without_lora_refuses_an_adapter_update_naming_the_flag(models):
    from treadle.rollout.engine.vllm_engine import VllmEngine, VllmEngineConfig

    e = VllmEngine(VllmEngineConfig(model=str(models["a"])))
    with pytest.raises(BadRequest, match="--engine.max_lora_rank >= 4"):
        e._check_adapter(LoraAdapter(rank=4, alpha=8, target_modules=["q_proj"]))
    e = VllmEngine(VllmEngineConfig(model=str(models["a"]), max_lora_rank=8))
    with pytest.raises(BadRequest, match="rank 16 > the engine's --engine.max_lora_rank 8"):
        e._check_adapter(LoraAdapter(rank=16, alpha=8, target_modules=["q_proj"]))


def test_adapter_update_serves_the_merged_model(aio, engine, ref, models, tools):
    base = ref["a"]
    before = aio(engine.weight_digest())
    try:
        for seed in (1, 2):  # the second adapter replaces the first (not added to it)
            model = lora_model(base, seed)
            merged = copy.deepcopy(model).merge_and_unload()
            assert aio(engine.update_weights(adapter_update(model, engine.weight_version + 1))) == engine.weight_version
            got = aio(engine.prompt_logprobs(PROMPT))
            np.testing.assert_allclose(got, tools.prompt_logprobs(merged, PROMPT), rtol=0, atol=TOL)
            assert np.abs(got - tools.prompt_logprobs(base, PROMPT)).max() > 0.05  # the adapter does something
            tokens, lps = greedy(aio, engine)
            np.testing.assert_allclose(lps, tools.logprobs(merged, PROMPT, tokens, temperature=0.0), rtol=0, atol=TOL)
            with torch.no_grad():
                want = merged(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1:].argmax(-1).tolist()
            assert tokens == want
        assert aio(engine.weight_digest()) != before
    finally:  # a full update drops the adapter: the base model again
        state = tools.checkpoint(models["a"])
        aio(engine.update_weights(InlineWeights(
            version=engine.weight_version + 1, names=list(state), dtypes=["float32"] * len(state),
            shapes=[list(t.shape) for t in state.values()], tensors=list(state.values()))))
    np.testing.assert_allclose(aio(engine.prompt_logprobs(PROMPT)), tools.prompt_logprobs(base, PROMPT),
                               rtol=0, atol=TOL)


def test_a_wrong_adapter_is_refused_before_anything_is_loaded(aio, engine, ref):
    model = lora_model(ref["a"], 3)
    good = adapter_update(model, engine.weight_version + 1)
    short = adapter_update(model, good.version, names=good.names[:-1], dtypes=good.dtypes[:-1],
                           shapes=good.shapes[:-1], tensors=good.tensors[:-1])
    v, lp = engine.weight_version, aio(engine.prompt_logprobs(PROMPT))
    with pytest.raises(WeightMismatch, match="missing 1 tensor"):
        aio(engine.update_weights(short))
    wide = LoraAdapter(rank=4, alpha=8, target_modules=["q_proj"])  # claims fewer modules than it carries
    # vLLM checks it against the model; the hf engine, whose layers were injected for another
    # adapter (the test before), refuses any other shape of adapter first
    with pytest.raises(BadRequest, match="no such tensor|needs a new engine"):
        aio(engine.update_weights(adapter_update(model, good.version, adapter=wide)))
    assert engine.weight_version == v
    np.testing.assert_array_equal(aio(engine.prompt_logprobs(PROMPT)), lp)
