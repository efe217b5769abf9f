"""ZeRO-3 tuning knobs in the DeepSpeed dict, compiled decoder layers, and packed-row attention
(``ops.varlen_attention``) against per-sequence SDPA on CPU."""

from __future__ import annotations

import pytest
import torch

from treadle.common.config import ConfigError
from treadle.trainer.config.deepspeed import DeepSpeedConfig, LoraConfig
from treadle.trainer.config.optim import OptimizerConfig
from treadle.trainer.ops import varlen_attention as va
from treadle.trainer.ops.varlen_attention import register, segments, varlen_attention
from treadle.trainer.strategy.deepspeed import (
    compile_layers,
    compiles_layers,
    decoder_layers,
    ds_config,
)


def _tiny(attn: str, layers: int = 2) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, use_cache=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def test_zero3_knobs_default_to_the_tuned_values_and_stay_out_of_lower_stages():
    zero = ds_config(DeepSpeedConfig(zero_stage=3), OptimizerConfig(), micro_batch=1, grad_accum=1,
                     world=2)["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == 500_000_000
    assert zero["stage3_param_persistence_threshold"] == 1_000_000
    assert zero["stage3_max_live_parameters"] == 1_000_000_000 and zero["reduce_bucket_size"] == 500_000_000
    ds = DeepSpeedConfig(zero_stage=3, zero3_prefetch_bucket_size=7, zero3_param_persistence_threshold=0)
    zero = ds_config(ds, None, micro_batch=1, grad_accum=1, world=1)["zero_optimization"]
    assert (zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"]) == (7, 0)
    assert "memory_efficient_linear" not in zero
    compiled = DeepSpeedConfig(zero_stage=3, compile_layers=True)
    compiled_zero = ds_config(compiled, None, micro_batch=1, grad_accum=1, world=1)["zero_optimization"]
    assert compiled_zero["memory_efficient_linear"] is False
    lower = ds_config(DeepSpeedConfig(zero_stage=2), None, micro_batch=1, grad_accum=1, world=1)["zero_optimization"]
    assert not {"stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                "reduce_bucket_size"} & lower.keys()
    # overlap_comm unset: DeepSpeed's own rule (ZeRO-3 on, the lower stages off); set: as set
    assert zero["overlap_comm"] is True and lower["overlap_comm"] is False
    for stage, value in ((3, False), (2, True)):
        zero = ds_config(DeepSpeedConfig(zero_stage=stage, overlap_comm=value), None, micro_batch=1, grad_accum=1,
                         world=1)["zero_optimization"]
        assert zero["overlap_comm"] is value


def test_layers_compile_by_default_for_zero3_on_cuda_only_and_not_with_untried_features():
    model = _tiny("sdpa")
    z3 = DeepSpeedConfig(zero_stage=3)
    assert compiles_layers(z3, "cuda", model) and not compiles_layers(z3, "cpu", model)
    assert not compiles_layers(DeepSpeedConfig(zero_stage=2), "cuda", model)
    for untried in (dict(lora=LoraConfig(rank=8)), dict(ring_attn_size=2, packing_samples=True),
                    dict(tensor_parallel_size=2), dict(param_offload=True), dict(use_liger_kernel=True)):
        assert not compiles_layers(DeepSpeedConfig(zero_stage=3, **untried), "cuda", model), untried
    assert not compiles_layers(z3, "cuda", torch.nn.Sequential(torch.nn.Linear(2, 2)))  # no layer classes
    assert compiles_layers(DeepSpeedConfig(zero_stage=2, compile_layers=True), "cpu", model)  # asked for
    assert not compiles_layers(DeepSpeedConfig(zero_stage=3, compile_layers=False), "cuda", model)
    # compiled layers around Liger's kernels crashed on an H200 (docs/benchmarks.md): refused together
    with pytest.raises(ConfigError, match=r"--compile_layers with --use_liger_kernel: .*illegal memory access"):
        DeepSpeedConfig(zero_stage=3, compile_layers=True, use_liger_kernel=True)


def test_layers_whose_compile_fails_run_eagerly_after_one_warning(monkeypatch, caplog):
    """A backend that cannot compile (no Triton, an unsupported model) leaves every layer eager
    with one warning naming the flag, and the same logits."""
    import functools

    calls = []

    def broken(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=broken))
    model = _tiny("sdpa", layers=3)
    ids = torch.randint(0, 97, (2, 9))
    expected = model(input_ids=ids).logits
    compile_layers(model, DeepSpeedConfig(zero_stage=2))
    with caplog.at_level("WARNING", logger="treadle.trainer.ops.compiled"):
        torch.testing.assert_close(model(input_ids=ids).logits, expected)
        torch.testing.assert_close(model(input_ids=ids).logits, expected)
    assert len(calls) == 1  # the first layer's failure stops the others' attempts
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "--ds.compile_layers False" in warnings[0] and "no compiler here" in warnings[0]


def test_config_rejects_negative_buckets_and_two_compilers():
    with pytest.raises(ConfigError, match="--zero3_prefetch_bucket_size must be >= 0"):
        DeepSpeedConfig(zero3_prefetch_bucket_size=-1)
    with pytest.raises(ConfigError, match="--compile_layers and --deepcompile"):
        DeepSpeedConfig(compile_layers=True, deepcompile=True)


def test_compile_layers_marks_zero3_leaves_and_compiles_each_layer_forward():
    from deepspeed.utils import z3_leaf_module

    model = _tiny("sdpa", layers=3)
    ids = torch.randint(0, 97, (2, 9))
    expected = model(input_ids=ids).logits
    assert compile_layers(model, DeepSpeedConfig(zero_stage=3)) == 3
    assert torch._dynamo.config.recompile_limit >= 2 * 3 + 8
    layers = decoder_layers(model)
    assert [type(m).__name__ for m in layers] == ["Qwen2DecoderLayer"] * 3
    assert all(z3_leaf_module(m) for m in layers) and not z3_leaf_module(model.model)
    assert all("forward" in vars(m) for m in layers)  # the instance's compiled forward shadows the method
    assert torch.allclose(model(input_ids=ids).logits, expected, atol=1e-5)
    plain = _tiny("sdpa")
    compile_layers(plain, DeepSpeedConfig(zero_stage=2))
    assert not any(z3_leaf_module(m) for m in decoder_layers(plain))


def test_compile_layers_names_the_flag_for_models_without_layer_classes():
    with pytest.raises(ConfigError, match="--ds.compile_layers: Sequential names no decoder-layer class"):
        compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)), DeepSpeedConfig(zero_stage=3))


def test_segments_start_at_each_zero_position_and_each_row():
    packed = segments(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert packed.bounds == (0, 3, 5, 9) and packed.max_len == 4
    assert packed.cu.dtype == torch.int32 and packed.cu.tolist() == [0, 3, 5, 9]
    padded = segments(torch.arange(4).expand(3, 4).clone())
    assert padded.bounds == (0, 4, 8, 12)
    cut = segments(torch.tensor([[2, 3, 0, 1]]))  # a row that starts mid-sequence still starts a segment
    assert cut.bounds == (0, 2, 4)


def test_memo_recomputes_for_a_new_tensor_or_an_in_place_change():
    pos = torch.tensor([[0, 1, 0, 1]])
    first = va._found_segments(pos, 1)
    assert va._found_segments(pos, 1) is first
    same_values = pos.clone()
    assert va._found_segments(same_values, 1) is not first and va._found_segments(same_values, 1).bounds == first.bounds
    same_values[0, 2] = 2  # in place: one sequence now
    assert va._found_segments(same_values, 1).bounds == (0, 4)


def test_varlen_attention_equals_causal_sdpa_per_sequence_with_gqa():
    torch.manual_seed(1)
    lengths = [5, 1, 7]
    q, k, v = torch.randn(13, 4, 8), torch.randn(13, 2, 8), torch.randn(13, 2, 8)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    seg = segments(pos)
    out = varlen_attention(q, k, v, seg.cu, seg.max_len, 8 ** -0.5)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].repeat_interleave(2, 1).transpose(0, 1),
            v[sl].repeat_interleave(2, 1).transpose(0, 1), is_causal=True)
        torch.testing.assert_close(out[sl], ref.transpose(0, 1))
        start += n


def test_packed_row_with_treadle_varlen_equals_each_sequence_alone():
    """A packed row of three sequences gives each sequence's own logits (what a padded batch with
    SDPA and a mask gives), and a padded batch needs no mask since right padding follows."""
    name = register()
    varlen, sdpa = _tiny(name), _tiny("sdpa")
    seqs = [torch.randint(0, 97, (n,)) for n in (6, 3, 8)]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        packed = varlen(input_ids=ids, position_ids=pos).logits[0]
        padded_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        width = torch.arange(8).expand(3, 8)
        padded = varlen(input_ids=padded_ids, position_ids=width).logits
        alone = [sdpa(input_ids=s[None]).logits[0] for s in seqs]
    start = 0
    for k, (s, ref) in enumerate(zip(seqs, alone, strict=True)):
        torch.testing.assert_close(packed[start:start + len(s)], ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(padded[k, : len(s)], ref, atol=1e-5, rtol=1e-4)
        start += len(s)


def _sample_batch(lengths: tuple[int, ...]) -> list:
    from treadle.trainer.data.samples import Sample, TokenSeq

    g = torch.Generator().manual_seed(3)
    return [Sample(seqs=(TokenSeq.of(torch.randint(3, 97, (n,), generator=g).tolist(), [True] * n),), index=i)
            for i, n in enumerate(lengths)]


def test_packed_batches_name_their_sequences_the_way_flash_attention_kwargs_do():
    from treadle.trainer.data.batching import pack_batch, pad_batch

    packed = pack_batch(_sample_batch((6, 3, 8))).to("cpu")
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == [0, 6, 9, 17]
    assert packed.max_seqlen == 8
    inputs = packed.model_inputs()
    assert inputs["cu_seq_lens_q"] is inputs["cu_seq_lens_k"] is packed.cu_seqlens
    assert inputs["max_length_q"] == inputs["max_length_k"] == 8
    padded = pad_batch(_sample_batch((6, 3)), pad_id=0)
    assert padded.cu_seqlens is None and set(padded.model_inputs()) == {"input_ids", "position_ids", "attention_mask"}


def test_varlen_attention_takes_the_named_sequences_without_reading_the_positions(monkeypatch):
    from treadle.trainer.data.batching import pack_batch

    model = _tiny(register())
    batch = pack_batch(_sample_batch((6, 3, 8)))
    with torch.no_grad():
        found = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits

        def no_host_read(*_):
            raise AssertionError("the sequences were found from position_ids although the batch named them")

        monkeypatch.setattr(va, "_found_segments", no_host_read)
        named = model(**batch.model_inputs()).logits
    torch.testing.assert_close(named, found)


def _masked_attention(q, k, v, cu, max_len, scale):
    """Stand-in for the CUDA-only flash kernels: the same causal attention within each sequence of
    ``cu``, as one dense masked SDPA, and traceable (no host reads)."""
    idx = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu[1:].long(), idx, right=True)
    mask = (seq[:, None] == seq[None, :]) & (idx[:, None] >= idx[None, :])
    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def test_compiled_layers_keep_varlen_attention_in_their_graph_when_the_sequences_are_named(monkeypatch):
    """With the flash kwargs nothing in treadle_varlen breaks a layer's graph (fullgraph=True
    raises on a break; before, the whole function was excluded from compilation), and the compiled
    layers compute the eager values and gradients. The kernel is the traceable stand-in above (the
    flash kernels need CUDA; test_gpu.py compiles FlashAttention-4's custom operators there)."""
    from treadle.trainer.data.batching import pack_batch

    monkeypatch.setitem(va._RUN, "sdpa_by_sequence", _masked_attention)
    batch = pack_batch(_sample_batch((6, 3, 8, 5)))
    name = register()
    eager, compiled = _tiny(name), _tiny(name)
    for layer in decoder_layers(compiled):
        layer.forward = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    results = []
    for model in (eager, compiled):
        logits = model(**batch.model_inputs()).logits
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0])
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
