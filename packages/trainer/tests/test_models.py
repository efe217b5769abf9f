"""Model roles on the tiny model, without DeepSpeed: a packed row computes exactly what padded
rows do (attention confined to each sequence), for the policy's log-probs and the reward
model's scores; the reference is frozen; a reward model round-trips through the HF export."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.data.batching import pack_batch, pad_batch
from treadle.trainer.data.samples import Sample, TokenSeq
from treadle.trainer.models.actor import Actor
from treadle.trainer.models.loading import attn_implementation, load_causal_lm
from treadle.trainer.models.reference import Reference
from treadle.trainer.models.reward_model import RewardModel
from treadle.trainer.ops.logprobs import sequence_sums

FP32 = DeepSpeedConfig(param_dtype="fp32", attn_implementation="sdpa")


def _samples(n: int = 5, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        seqs = []
        for _ in range(2):
            length = int(torch.randint(3, 40, (1,), generator=g))
            ids = torch.randint(3, 500, (length,), generator=g).tolist()
            seqs.append(TokenSeq.of(ids, [j >= length // 2 for j in range(length)]))
        out.append(Sample(seqs=tuple(seqs), index=i))
    return out


@pytest.fixture(scope="module")
def lm(tiny):
    return load_causal_lm(str(tiny), FP32, trainable=False)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_equals_padded_rows(tiny, attn):
    model = load_causal_lm(str(tiny), DeepSpeedConfig(param_dtype="fp32", attn_implementation=attn), trainable=False)
    actor, samples = Actor(model), _samples()
    pad, pack = pad_batch(samples, pad_id=0), pack_batch(samples)
    with torch.no_grad():
        lp_pad, lp_pack = actor(pad, with_entropy=True), actor(pack, with_entropy=True)
    sums_pad = sequence_sums(lp_pad.logprobs, pad.target_mask, pad.seq_index, pad.num_seqs)
    sums_pack = sequence_sums(lp_pack.logprobs, pack.target_mask, pack.seq_index, pack.num_seqs)
    assert torch.allclose(sums_pad, sums_pack, atol=1e-4, rtol=1e-5)
    tok_pad = lp_pad.logprobs[pad.target_mask]
    tok_pack = lp_pack.logprobs[pack.target_mask]
    assert torch.allclose(tok_pad, tok_pack, atol=1e-5)
    assert torch.allclose(lp_pad.entropy[pad.target_mask], lp_pack.entropy[pack.target_mask], atol=1e-5)


@pytest.mark.parametrize("layout", ["packed", "padded", "no_targets"])
def test_targets_only_equals_the_full_head_at_the_targets(tiny, layout):
    """``targets_only`` runs the LM head on the target-predicting columns only: log-probs,
    entropies and the gradients they send into the model equal the full computation's at every
    target token, and the other tokens read 0."""
    from treadle.trainer.models.actor import keeps_logits, target_columns

    model = load_causal_lm(str(tiny), FP32, trainable=True)
    assert keeps_logits(model)
    samples = _samples()
    if layout == "no_targets":
        samples = [Sample(seqs=tuple(TokenSeq.of(list(q.ids), [False] * len(q.ids)) for q in s.seqs), index=s.index)
                   for s in samples]
    batch = pad_batch(samples, pad_id=0) if layout == "padded" else pack_batch(samples)
    cols = target_columns(batch.target_mask)
    assert cols is not None and cols.numel() < batch.input_ids.shape[1] - 1  # prompts are skipped
    actor, grads, outs = Actor(model), [], []
    for only in (False, True):
        model.zero_grad()
        out = actor(batch, with_entropy=True, targets_only=only)
        m = batch.target_mask
        (out.logprobs[m].sum() + 0.5 * out.entropy[m].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        outs.append(out)
    full, only = outs
    m = batch.target_mask
    assert torch.allclose(only.logprobs[m], full.logprobs[m], atol=1e-5)
    assert torch.allclose(only.entropy[m], full.entropy[m], atol=1e-5)
    skipped = torch.ones(batch.input_ids.shape[1], dtype=torch.bool)
    skipped[cols + 1] = False
    skipped[1] = skipped[1] and cols.numel() > 0  # no target at all: one column is computed anyway
    assert skipped.any() and not only.logprobs[:, skipped].any() and not only.entropy[:, skipped].any()
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-5), n


def test_packing_without_position_restarts_would_differ(lm):
    """The check above has teeth: the same row with plain positions (one long sequence) differs."""
    samples = _samples()
    pack = pack_batch(samples)
    leaky = type(pack)(**{**{f: getattr(pack, f) for f in pack.__dataclass_fields__},
                          "position_ids": torch.arange(pack.input_ids.shape[1])[None]})
    with torch.no_grad():
        a = Actor(lm)(pack).logprobs[pack.target_mask]
        b = Actor(lm)(leaky).logprobs[pack.target_mask]
    assert (a - b).abs().max() > 1e-2


def test_reward_scores_equal_packed_and_padded(tiny):
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(str(tiny), FP32).eval()
    samples = _samples(4, seed=1)
    pad, pack = pad_batch(samples, pad_id=0), pack_batch(samples)
    with torch.no_grad():
        a = RewardModel.scores(rm(**pad.model_inputs()), pad)
        b = RewardModel.scores(rm(**pack.model_inputs()), pack)
    assert a.shape == (8,) and torch.allclose(a, b, atol=1e-5)


def test_reward_model_export_loads_as_sequence_classification(tiny, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from treadle.trainer.checkpoint.export import save_reward_model

    torch.manual_seed(1)
    rm = RewardModel.from_pretrained(str(tiny), FP32).eval()
    out = save_reward_model(rm.state_dict(), rm.config, tokenizer, tmp_path / "rm", mean=0.5, std=2.0)
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == 1 and hf.config.reward_mean == 0.5 and hf.config.reward_std == 2.0
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        ours = rm(input_ids=ids)[0, -1]
        theirs = hf.score(hf.model(input_ids=ids).last_hidden_state)[0, -1, 0]
        logits = hf(input_ids=ids).logits[0, 0]  # HF's own last-token pooling
    assert torch.allclose(ours, theirs, atol=1e-5) and torch.allclose(ours, logits, atol=1e-5)
    again = RewardModel.from_pretrained(str(out), FP32)  # our loader reads the saved head back
    assert torch.equal(again.score.weight, rm.score.weight)


def test_reference_is_frozen_and_matches_the_actor(lm, tiny):
    ref = Reference(load_causal_lm(str(tiny), FP32, trainable=False), torch.device("cpu"), offload=True)
    assert not any(p.requires_grad for p in ref.module.parameters())
    batch = pad_batch(_samples(2), pad_id=0)
    with torch.no_grad():
        assert torch.allclose(ref.logprobs(batch), Actor(lm)(batch).logprobs)


def test_attention_choice():
    assert attn_implementation(None) in ("sdpa", "flash_attention_2")
    assert attn_implementation("eager") == "eager"
    assert attn_implementation("treadle_varlen") == "treadle_varlen"
    assert attn_implementation(None, packing=True, cuda=False) == "sdpa"
    if importlib.util.find_spec("flash_attn_2_cuda") is None:
        # packed rows on CUDA without flash-attn: SDPA would build a block-diagonal mask over the whole row
        assert attn_implementation(None, packing=True, cuda=True) == "treadle_varlen"
        assert attn_implementation(None, packing=False, cuda=True) == "sdpa"
    if not torch.cuda.is_available():
        from treadle.common.config import ConfigError

        with pytest.raises(ConfigError, match="flash-attn"):
            attn_implementation("flash_attention_2")


def test_flash_attn_4_alone_is_not_taken_for_flash_attention_2(monkeypatch):
    """flash-attn-4 installs a ``flash_attn`` package (``flash_attn.cute``) without FlashAttention-2's
    kernels: packed rows on CUDA still get treadle_varlen (whose fastest kernel is FA4's)."""
    real = importlib.util.find_spec

    def fa4_only(name, *a, **kw):
        if name == "flash_attn":
            return real("json")  # any spec: the package is there
        return None if name == "flash_attn_2_cuda" else real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", fa4_only)
    assert attn_implementation(None, packing=True, cuda=True) == "treadle_varlen"


def test_varlen_kernel_choice_starts_where_named_and_falls_back():
    from treadle.trainer.ops import varlen_attention as va

    q = torch.zeros(4, 2, 8)
    try:
        assert attn_implementation("treadle_varlen", varlen_kernel="flash_varlen") == "treadle_varlen"
        assert va.kernel_name(q) == "sdpa_by_sequence"  # CPU fp32: neither flash kernel fits
        assert va._start == "flash_varlen"
        with pytest.raises(ValueError, match="'fa3'"):
            va.register("fa3")
    finally:
        va.register()
    assert va._start == "fa4_varlen"


def test_lora_trains_only_adapters_and_exports_merged(tiny, tokenizer, tmp_path):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from treadle.trainer.checkpoint.export import full_state_dict, save_causal_lm
    from treadle.trainer.config.deepspeed import LoraConfig

    ds = DeepSpeedConfig(param_dtype="fp32", attn_implementation="sdpa", lora=LoraConfig(rank=4, alpha=8))
    model = load_causal_lm(str(tiny), ds, trainable=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    torch.manual_seed(0)
    with torch.no_grad():  # peft starts B at 0 (a no-op adapter): give it weights so merging matters
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    state = full_state_dict(SimpleNamespace(module=model), zero_stage=0, is_main=True)
    assert not any("lora_" in k or "base_layer" in k for k in state)
    out = save_causal_lm(state, model.get_base_model().config, tokenizer, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-5)
    assert any("lora_" in n for n, _ in model.named_parameters())  # the trained model keeps its adapters


def test_critic_gives_a_value_per_token_the_same_packed_or_padded(tiny):
    from treadle.trainer.models.critic import Critic

    torch.manual_seed(0)
    critic = Critic.from_pretrained(str(tiny), FP32).eval()
    samples = _samples(3, seed=2)
    pad, pack = pad_batch(samples, pad_id=0), pack_batch(samples)
    with torch.no_grad():
        a, b = critic(**pad.model_inputs()), critic(**pack.model_inputs())
    assert a.shape == pad.input_ids.shape and b.shape == pack.input_ids.shape
    assert torch.allclose(a[pad.seq_index >= 0], b[0], atol=1e-5)


def test_sequence_positions_find_each_sequence_padded_or_packed():
    from treadle.trainer.models.reference import sequence_positions

    samples = _samples()
    want = [list(q.ids) for s in samples for q in s.seqs]
    for batch in (pad_batch(samples, pad_id=0), pack_batch(samples)):
        got = [batch.input_ids[r, c].tolist() for r, c in sequence_positions(batch.seq_index)]
        assert got == want


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_reference_scored_by_a_daemon_equals_the_ranks_own(tiny, lm, helpers, layout):
    """``--ref.remote_url``: a real ``treadle-rollout serve --backend hf`` of the same model scores
    every sequence at temperature 0.7; the [R, T] log-probs equal ``Reference.logprobs`` of the
    batch at the target tokens (fp32: to 1e-5) and are 0 elsewhere (``targets_only``)."""
    from treadle_testing import rollout_daemon

    from treadle.rollout.client import SyncRolloutClient
    from treadle.trainer.models.reference import Reference, RemoteReference

    samples = _samples()
    batch = pad_batch(samples, pad_id=0) if layout == "padded" else pack_batch(samples)
    want = Reference(lm, torch.device("cpu")).logprobs(batch, temperature=0.7, targets_only=True)
    with rollout_daemon(tiny, helpers.child_env(), "--backend", "hf", "--engine.dtype", "float32",
                        "--engine.max_model_len", "256") as url:
        remote = RemoteReference(SyncRolloutClient(url))
        try:
            got = remote.logprobs(batch, temperature=0.7, targets_only=True)
        finally:
            remote.close()
    m = batch.target_mask
    assert got.shape == want.shape and torch.allclose(got[m], want[m], atol=1e-5), (got[m] - want[m]).abs().max()
    assert not got[~m].any() and want[m].abs().min() > 0
