"""On CUDA (the GPU machine, ``-m gpu``): a packed row computes what padded rows do with the
attention kernels there (SDPA; treadle_varlen with each of its kernels that fits: FlashAttention-4
where flash-attn-4 is installed, PyTorch's varlen flash kernel; flash-attention's varlen path
when flash-attn is installed), and treadle_varlen's kernels equal fp32 attention, gradients too."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.data.batching import pack_batch, pad_batch
from treadle.trainer.data.samples import Sample, TokenSeq
from treadle.trainer.models.actor import Actor
from treadle.trainer.models.loading import load_causal_lm
from treadle.trainer.ops.logprobs import sequence_sums

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
KERNELS = [("sdpa", "fp32", 1e-4), ("sdpa", "bf16", 0.15), ("treadle_varlen", "bf16", 0.15),
           ("treadle_varlen:flash_varlen", "bf16", 0.15), ("treadle_varlen", "fp32", 1e-4)]
if importlib.util.find_spec("flash_attn_2_cuda") is not None:
    KERNELS.append(("flash_attention_2", "bf16", 0.15))


def _samples(n: int = 6) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 200, (1,), generator=g))
        ids = torch.randint(3, 500, (length,), generator=g).tolist()
        out.append(Sample(seqs=(TokenSeq.of(ids, [True] * length),), index=i))
    return out


@pytest.mark.parametrize(("attn", "dtype", "tol"), KERNELS)
def test_packed_equals_padded_on_cuda(tiny, attn, dtype, tol):
    attn, _, kernel = attn.partition(":")
    ds = DeepSpeedConfig(param_dtype=dtype, attn_implementation=attn, varlen_kernel=kernel or "auto")
    model = load_causal_lm(str(tiny), ds, trainable=False).cuda()
    samples = _samples()
    pad, pack = pad_batch(samples, pad_id=0).to("cuda"), pack_batch(samples).to("cuda")
    with torch.no_grad():
        a, b = Actor(model)(pad).logprobs, Actor(model)(pack).logprobs
    sa = sequence_sums(a, pad.target_mask, pad.seq_index, pad.num_seqs)
    sb = sequence_sums(b, pack.target_mask, pack.seq_index, pack.num_seqs)
    per_token = (a[pad.target_mask] - b[pack.target_mask]).abs().max().item()
    assert per_token < tol, per_token
    assert torch.allclose(sa, sb, rtol=1e-3 if dtype == "fp32" else 2e-2, atol=1e-3 if dtype == "fp32" else 1.0)


def test_logprobs_and_entropy_compiled_on_cuda_equal_the_fp32_formulas():
    """On CUDA each chunk's math is compiled (one graph for every chunk length): log-probs and
    entropies, values and gradients, equal the plain fp32 formulas' for rows of several lengths
    and vocabularies."""
    from treadle.trainer.ops.logprobs import chunked_entropy, picked_logprobs

    def log_softmax(x):
        return torch.log_softmax(x.float() / 0.7, dim=-1)

    cases = {"logprobs": (lambda x, ids: picked_logprobs(x, ids, 0.7, chunk=512),
                          lambda x, ids: log_softmax(x).gather(-1, ids[..., None]).squeeze(-1)),
             "entropy": (lambda x, ids: chunked_entropy(x, 0.7, chunk=512),
                         lambda x, ids: -(log_softmax(x).exp() * log_softmax(x)).sum(-1))}
    g = torch.Generator(device="cuda").manual_seed(0)
    for length, vocab in ((1500, 32000), (777, 32000), (300, 1000)):
        base = (torch.randn(2, length, vocab, device="cuda", generator=g) * 4).bfloat16()
        ids = torch.randint(0, vocab, (2, length), device="cuda", generator=g)
        weights = torch.randn(2, length, device="cuda", generator=g)
        for name, (chunked, formula) in cases.items():
            a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
            got, want = chunked(a, ids), formula(b, ids)
            assert (got - want).abs().max().item() < 1e-4, name
            (got * weights).sum().backward()
            (want * weights).sum().backward()
            assert a.grad.dtype == torch.bfloat16
            err = (a.grad.float() - b.grad.float()).abs().max().item()
            assert err <= 0.01 * b.grad.float().abs().max().item(), (name, err)


@pytest.mark.parametrize(("lengths", "heads"), [([300, 77, 1024, 5, 2999, 17], (16, 16)), ([700, 1500, 33], (16, 4))])
def test_varlen_kernels_equal_fp32_attention_forward_and_backward(lengths, heads):
    """Each of treadle_varlen's bf16 kernels that fits here (FA4 where flash-attn-4 is installed;
    PyTorch's varlen FA2) against causal SDPA per sequence in fp32: outputs and q / k / v grads
    within bf16 rounding (measured on an H200: both kernels' errors 0.009-0.03, equal)."""
    from treadle.trainer.ops import varlen_attention as va

    g = torch.Generator(device="cuda").manual_seed(0)
    n, (h, hk) = sum(lengths), heads
    q, do = (torch.randn(n, h, 128, device="cuda", generator=g) for _ in range(2))
    k, v = (torch.randn(n, hk, 128, device="cuda", generator=g) for _ in range(2))
    seg = va.segments(torch.cat([torch.arange(x, device="cuda") for x in lengths])[None])

    def run(kernel, dtype):
        va.register(kernel)
        xs = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        assert va.kernel_name(xs[0]) == kernel
        out = va.varlen_attention(*xs, seg.cu, seg.max_len, 128 ** -0.5)
        out.backward(do.to(dtype))
        return [out.detach().float(), *(x.grad.float() for x in xs)]

    try:
        ref = run("sdpa_by_sequence", torch.float32)
        kernels = [k for k in ("fa4_varlen", "flash_varlen") if va._fits(k, q.bfloat16())]
        assert "flash_varlen" in kernels
        for kernel in kernels:
            for name, got, want in zip(("out", "dq", "dk", "dv"), run(kernel, torch.bfloat16), ref, strict=True):
                err = (got - want).abs().max().item()
                assert err <= 0.01 * want.abs().max().item() + 0.01, (kernel, name, err)
    finally:
        va.register()


@pytest.mark.parametrize(("lengths", "size"), [([300, 77, 1024, 5], 2), ([4096], 2), ([999, 3000, 17], 4)])
def test_ring_cuda_flash_tiles_equal_the_math_tiles(lengths, size):
    """Every ring step's local work (forward out / lse, backward dq / dk / dv) through PyTorch's
    flash varlen kernels equals the fp32 ``math`` kernel within bf16 rounding, on every rank."""
    from treadle.trainer.ring.blocks import backward_step, default_kernel, forward_step, plan
    from treadle.trainer.ring.layout import zigzag_layout

    dev = torch.device("cuda")
    assert default_kernel(dev) == "cuda_flash"
    g = torch.Generator(device=dev).manual_seed(0)
    for r in range(size):
        lay = zigzag_layout(torch.tensor(lengths), size, r)
        t = lay.local_length
        q, do = (torch.randn(2, 3, t, 64, device=dev, generator=g).bfloat16() for _ in range(2))
        kv = torch.randn(2, 2, t, 64, device=dev, generator=g).bfloat16()
        got = {}
        for kernel in ("cuda_flash", "math"):
            blocks = plan(lay, dev, kernel=kernel).blocks
            out, lse = torch.zeros(2, 3, t, 64, device=dev), torch.full((2, 3, t), float("-inf"), device=dev)
            for blk in blocks:
                forward_step(q, kv, blk, kernel, 0.125, out, lse)
            dq, dkv = torch.zeros_like(out), torch.zeros(2, 2, t, 64, device=dev)
            for blk in blocks:
                backward_step(do, q, out, lse, kv, blk, kernel, 0.125, dq, dkv)
            got[kernel] = (out, lse, dq, dkv)
        for a, b, tol in zip(got["cuda_flash"], got["math"], (0.02, 1e-4, 0.03, 0.06), strict=True):
            assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item() / 4), (r, tol)


@pytest.mark.parametrize("kernel", ["fa4_varlen", "flash_varlen"])
def test_compiled_layers_keep_the_flash_kernels_in_their_graph(kernel):
    """Decoder layers compiled with fullgraph=True (a graph break raises) around treadle_varlen's
    flash kernels (FlashAttention-4 as treadle's custom operators; PyTorch's varlen operator) on a
    packed row that names its sequences: logits and gradients equal the eager layers' within bf16
    rounding. Before, the attention broke each layer's graph in two and AOTAutograd copied the
    q / k / v gradients crossing the break (72 [T, H, d] copies a 1.35B step)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from treadle.trainer.ops import varlen_attention as va
    from treadle.trainer.strategy.deepspeed import decoder_layers

    if not va._fits(kernel, torch.empty(1, 1, 128, dtype=torch.bfloat16, device="cuda")):
        pytest.skip(f"{kernel} does not run here")
    name = va.register(kernel)
    try:
        cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=500, use_cache=False)
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(AutoModelForCausalLM.from_config(cfg, attn_implementation=name, dtype=torch.bfloat16).cuda())
        for layer in decoder_layers(models[1]):
            layer.forward = torch.compile(layer.forward, fullgraph=True)
        results = []
        for lengths in ((300, 77, 1024, 5), (999, 31)):  # a second shape: the compiled layers go dynamic
            batch = pack_batch(_samples_of(lengths)).to("cuda")
            for model in models:
                model.zero_grad()
                logits = model(**batch.model_inputs()).logits
                logits.float().square().mean().backward()
                with torch.no_grad():  # as the experience maker runs the policy (another graph)
                    frozen = model(**batch.model_inputs()).logits.float()
                results.append((logits.detach().float(), [p.grad.float() for p in model.parameters()], frozen))
        for (want, want_g, want_f), (got, got_g, got_f) in zip(results[::2], results[1::2], strict=True):
            assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
            assert (got_f - want_f).abs().max().item() <= 0.02 * want_f.abs().max().item()
            for a, b in zip(got_g, want_g, strict=True):
                assert (a - b).abs().max().item() <= 0.03 * b.abs().max().item() + 1e-6
    finally:
        va.register()


def _samples_of(lengths: tuple[int, ...]) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    return [Sample(seqs=(TokenSeq.of(torch.randint(3, 500, (n,), generator=g).tolist(), [True] * n),), index=i)
            for i, n in enumerate(lengths)]


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_liger_kernels_patch_the_model_and_keep_its_logprobs_and_gradients(tiny, dtype, monkeypatch):
    """``--ds.use_liger_kernel``: the tiny Qwen2's norms and MLPs run Liger's forwards (Liger
    patches instances: their ``_get_name`` says so), a model loaded without the flag afterwards
    does not, and the log-probs and the gradient of their sum stay those of the unpatched model
    (fp32: 1e-4; bf16: the kernels' own rounding)."""
    from transformers.models.qwen2 import modeling_qwen2

    from treadle.trainer.models.loading import check_liger

    check_liger([str(tiny)])
    # Liger swaps the RoPE function module-wide: undone after the test, for the next parameter
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", modeling_qwen2.apply_rotary_pos_emb)
    samples = _samples()
    pack = pack_batch(samples).to("cuda")
    outs = []
    def load(liger: bool) -> torch.nn.Module:
        ds = DeepSpeedConfig(param_dtype=dtype, attn_implementation="sdpa", use_liger_kernel=liger)
        model = load_causal_lm(str(tiny), ds, trainable=True).cuda()
        names = {m._get_name() for m in model.modules()}
        norm = type(model.model.norm).forward is not model.model.norm.forward.__func__
        assert ("LigerSwiGLUMLP" in names and norm) == liger, (names, norm)
        return model

    for liger in (False, True):
        model = load(liger)
        logprobs = Actor(model)(pack).logprobs
        logprobs[pack.target_mask].sum().backward()
        grad = model.model.layers[0].mlp.down_proj.weight.grad.float()
        outs.append((logprobs.detach().float(), grad))
    load(False)  # the patch did not outlive its model
    (a, ga), (b, gb) = outs
    tol = 1e-4 if dtype == "fp32" else 0.15
    assert (a[pack.target_mask] - b[pack.target_mask]).abs().max().item() < tol
    assert torch.allclose(ga, gb, rtol=1e-2 if dtype == "fp32" else 0.1, atol=1e-4 if dtype == "fp32" else 1e-2)
