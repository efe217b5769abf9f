"""The loss functions and log-prob helpers against values worked out by hand (arithmetic in the
comments), and the invariance the trainers rely on: token-mean with a step-wide normaliser is
the same however the step is split."""

from __future__ import annotations

import math

import pytest
import torch

from treadle.trainer.losses.preference import (
    PREFERENCE_LOSSES,
    dpo_loss,
    implicit_reward,
    ipo_loss,
    kto_kl_baseline,
    kto_loss,
)
from treadle.trainer.losses.rm import RM_LOSSES, logexp_loss, pair_accuracy, sigmoid_loss
from treadle.trainer.losses.sft import nll_loss, nll_loss_seq_mean
from treadle.trainer.ops.logprobs import (
    chunked_entropy,
    picked_logprobs,
    sequence_sums,
    token_entropy,
    token_logprobs,
)

T = torch.tensor


def test_token_logprobs_by_hand():
    # vocab 2, logits at t=0 are [0, ln 3]: p = [1/4, 3/4]; the next token is 1 -> log(3/4).
    logits = T([[[0.0, math.log(3.0)], [5.0, 5.0]]])
    ids = T([[0, 1]])
    lp = token_logprobs(logits, ids)
    assert lp.shape == (1, 2) and lp[0, 0] == 0.0
    assert lp[0, 1].item() == pytest.approx(math.log(0.75), abs=1e-6)
    # temperature 2 halves the logits: [0, ln 3 / 2] -> p1 = sqrt3 / (1 + sqrt3)
    s3 = math.sqrt(3.0)
    assert token_logprobs(logits, ids, 2.0)[0, 1].item() == pytest.approx(math.log(s3 / (1 + s3)), abs=1e-6)


def _reference_logprobs(logits, ids, tau):  # the plain fp32 formula the chunked function replaces
    z = logits.float() / tau
    return z.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


@pytest.mark.parametrize(("dtype", "tau", "chunk", "tol"), [
    (torch.float32, 1.0, 3, 1e-6), (torch.float32, 0.7, 1, 1e-6), (torch.float32, 1.0, 4096, 1e-6),
    (torch.bfloat16, 1.3, 5, 1e-5)])
def test_chunked_logprobs_equal_the_fp32_formula_in_value_and_gradient(dtype, tau, chunk, tol):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(3, 11, 37, generator=g) * 4).to(dtype)
    ids = torch.randint(0, 37, (3, 10), generator=g)
    weights = torch.randn(3, 10, generator=g)
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = picked_logprobs(a[:, :-1], ids, tau, chunk)  # a strided view, as token_logprobs passes
    want = _reference_logprobs(b[:, :-1], ids, tau)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=tol, rtol=0)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert a.grad.dtype == dtype and torch.equal(a.grad[:, -1], torch.zeros_like(a.grad[:, -1]))
    assert torch.allclose(a.grad.float(), b.grad.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)


@pytest.mark.parametrize(("dtype", "tau", "chunk"), [(torch.float32, 1.0, 3), (torch.float32, 0.6, 64),
                                                     (torch.bfloat16, 1.0, 4)])
def test_chunked_entropy_equals_the_log_softmax_formula_in_value_and_gradient(dtype, tau, chunk):
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(2, 9, 23, generator=g) * 3).to(dtype)
    weights = torch.randn(2, 8, generator=g)
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = chunked_entropy(a[:, :-1], tau, chunk)
    logp = torch.log_softmax(b[:, :-1].float() / tau, dim=-1)
    want = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert torch.allclose(a.grad.float(), b.grad.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_of_the_same_logits_backpropagate_together(dtype):
    """PPO's loss uses both of the same logits: neither backward may touch the saved logits (on
    fp32 ``.float()`` is the tensor itself; an in-place op there broke autograd's version check)."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 7, 11, generator=g).to(dtype)
    ids = torch.randint(0, 11, (2, 7), generator=g)
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    (token_logprobs(a, ids, 0.8).sum() + 0.1 * token_entropy(a, 0.8).sum()).backward()
    z = b[:, :-1].float() / 0.8
    logp = torch.log_softmax(z, -1)
    (logp.gather(-1, ids[:, 1:, None]).sum() - 0.1 * (logp.exp() * logp).sum()).backward()
    assert torch.equal(a.detach(), base)
    assert torch.allclose(a.grad.float(), b.grad.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_chunked_logprobs_refuse_a_zero_chunk():
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        picked_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), chunk=0)


def test_token_entropy_by_hand():
    # p = [1/4, 3/4]: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351...
    logits = T([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    h = token_entropy(logits)
    assert h[0, 1].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)


def test_sequence_sums_skip_padding_and_masked_tokens():
    values = T([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    mask = T([[False, True, True, True], [False, True, True, False]])
    index = T([[0, 0, 1, 1], [2, 2, 2, -1]])
    # seq 0: 2; seq 1: 3 + 4 = 7; seq 2: 20 + 30 = 50 (the padding 40 is masked and has index -1)
    assert sequence_sums(values, mask, index, 3).tolist() == [2.0, 7.0, 50.0]


def test_nll_is_token_mean_of_the_whole_step_however_split():
    lp = T([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = T([[False, True, True], [False, True, False]])
    # 3 target tokens: (2 + 3 + 5) / 3 = 10 / 3
    whole = nll_loss(lp, mask, 3)
    parts = nll_loss(lp[:1], mask[:1], 3) + nll_loss(lp[1:], mask[1:], 3)
    assert whole.item() == pytest.approx(10 / 3) and parts.item() == pytest.approx(10 / 3)
    # the naive per-micro-batch mean would give (2.5 + 5) / 2 = 3.75
    naive = (nll_loss(lp[:1], mask[:1], 2) + nll_loss(lp[1:], mask[1:], 1)) / 2
    assert naive.item() == pytest.approx(3.75)


def test_nll_seq_mean_token_mean_by_hand_padded_and_packed():
    lp = T([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = T([[False, True, True], [False, True, False]])
    seq = T([[0, 0, 0], [1, 1, -1]])  # padded: one sequence a row, the last slot of row 1 padding
    # sequence 0: (2 + 3) / 2 = 2.5; sequence 1: 5 / 1 = 5; mean over 2 sequences = 3.75 (token mean: 10 / 3)
    assert nll_loss_seq_mean(lp, mask, seq, 2, 2).item() == pytest.approx(3.75)
    # split into micro-batches with the step's sequence count: the same sum
    parts = nll_loss_seq_mean(lp[:1], mask[:1], seq[:1], 1, 2) + nll_loss_seq_mean(lp[1:], mask[1:], seq[1:] - 1, 1, 2)
    assert parts.item() == pytest.approx(3.75)
    # packed: both sequences in one row, [-1, -2, -3 | -4, -5], same targets
    packed = nll_loss_seq_mean(T([[-1.0, -2.0, -3.0, -4.0, -5.0]]), T([[False, True, True, False, True]]),
                               T([[0, 0, 0, 1, 1]]), 2, 2)
    assert packed.item() == pytest.approx(3.75)
    # a sequence without targets adds 0 (and the step counts only sequences with targets)
    assert nll_loss_seq_mean(lp, T([[False, True, True], [False, False, False]]), seq, 2, 1).item() == pytest.approx(2.5)


def test_nll_gradient_is_independent_of_the_split():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 5, requires_grad=True)
    ids = torch.randint(0, 5, (4, 6))
    mask = torch.rand(4, 6) > 0.3
    mask[:, 0] = False
    n = int(mask.sum())
    nll_loss(token_logprobs(logits, ids), mask, n).backward()
    whole = logits.grad.clone()
    logits.grad = None
    for rows in ([0], [1, 2], [3]):
        nll_loss(token_logprobs(logits[rows], ids[rows]), mask[rows], n).backward()
    assert torch.allclose(logits.grad, whole, atol=1e-7)


def test_rm_losses_by_hand():
    chosen, rejected = T([2.0, 0.0]), T([1.0, 1.0])
    # d = [1, -1]: -log sigmoid(1) = log(1 + e^-1) = 0.3132617; -log sigmoid(-1) = log(1 + e) = 1.3132617
    want = [math.log1p(math.exp(-1)), math.log1p(math.exp(1))]
    assert sigmoid_loss(chosen, rejected).tolist() == pytest.approx(want, abs=1e-6)
    assert logexp_loss(chosen, rejected).tolist() == pytest.approx(want, abs=1e-6)
    # margin 1 on the first pair: d = 0 -> log 2
    assert sigmoid_loss(chosen, rejected, T([1.0, 0.0]))[0].item() == pytest.approx(math.log(2), abs=1e-6)
    assert pair_accuracy(chosen, rejected).tolist() == [1.0, 0.0]
    assert set(RM_LOSSES) == {"sigmoid", "logexp"}


def test_logexp_does_not_overflow():
    assert logexp_loss(T([0.0]), T([1000.0])).item() == pytest.approx(1000.0)


def test_dpo_cdpo_ipo_by_hand():
    pc, pr, rc, rr = T([-1.0]), T([-3.0]), T([-2.0]), T([-2.0])
    # h = (-1 + 2) - (-3 + 2) = 2; beta 0.5: z = 1 -> DPO = log(1 + e^-1)
    assert dpo_loss(pc, pr, rc, rr, 0.5).item() == pytest.approx(math.log1p(math.exp(-1)), abs=1e-6)
    # cDPO eps 0.1: 0.9 log(1 + e^-1) + 0.1 log(1 + e)
    cdpo = 0.9 * math.log1p(math.exp(-1)) + 0.1 * math.log1p(math.exp(1))
    assert dpo_loss(pc, pr, rc, rr, 0.5, 0.1).item() == pytest.approx(cdpo, abs=1e-6)
    # IPO beta 0.5: (2 - 1 / (2 * 0.5))^2 = 1
    assert ipo_loss(pc, pr, rc, rr, 0.5).item() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ipo_loss(pc, pr, rc, rr, 0.5, 0.1)
    # equal log-ratios: h = 0 -> log 2 whatever beta
    assert dpo_loss(T([-1.0]), T([-1.0]), T([-1.0]), T([-1.0]), 3.0).item() == pytest.approx(math.log(2))
    assert implicit_reward(pc, rc, 0.5).item() == pytest.approx(0.5)
    assert PREFERENCE_LOSSES["sigmoid"] is dpo_loss and PREFERENCE_LOSSES["ipo"] is ipo_loss


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    pc, pr = T([-2.0], requires_grad=True), T([-2.0], requires_grad=True)
    dpo_loss(pc, pr, T([-2.0]), T([-2.0]), 0.1).sum().backward()
    # d/dpc = -beta sigmoid(-beta h) = -0.1 * 0.5 at h = 0
    assert pc.grad.item() == pytest.approx(-0.05) and pr.grad.item() == pytest.approx(0.05)


def test_kto_by_hand():
    policy, ref = T([-1.0, -1.0]), T([-2.0, -2.0])  # r = 1 for both
    desirable = T([True, False])
    # z0 = 0.5, beta = 1: desirable 1 - sigmoid(0.5) = 0.3775407; undesirable 2 * (1 - sigmoid(-0.5)) = 1.2449186
    got = kto_loss(policy, ref, desirable, 0.5, 1.0, 1.0, 2.0)
    sig = 1 / (1 + math.exp(-0.5))
    assert got.tolist() == pytest.approx([1 - sig, 2 * sig], abs=1e-6)


def test_kto_kl_baseline_is_clamped_mean_and_detached():
    pk = T([-1.0, -3.0], requires_grad=True)
    # mean(pk - rk) = ((-1 + 2) + (-3 + 2)) / 2 = 0; with rk = -4: (3 + 1) / 2 = 2
    assert kto_kl_baseline(pk, T([-2.0, -2.0])).item() == 0.0
    z = kto_kl_baseline(pk, T([-4.0, -4.0]))
    assert z.item() == 2.0 and not z.requires_grad
    assert kto_kl_baseline(T([-5.0]), T([-1.0])).item() == 0.0  # negative estimate clamps to 0


def test_compiled_chunks_fall_back_to_eager_when_compiling_fails(monkeypatch):
    """On CUDA the chunk functions go through torch.compile; where that fails (no Triton, no
    compiler) the same math runs eagerly from then on, and compiling is not tried again."""
    from treadle.trainer.ops import logprobs as lp

    tries = []

    def failing_compile(fn, **kw):
        def run(*args):
            tries.append(fn.__name__)
            raise RuntimeError("no triton")
        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    fused = lp._Fused(lp._pick)
    x, ids = torch.randn(4, 7), torch.tensor([0, 3, 6, 2])
    want = lp._pick(x, ids, 0.5)
    for _ in range(3):
        got = fused(x, ids, 0.5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert tries == ["_pick"] and fused.compiled is None


def test_sft_trainer_seq_mean_loss_and_units():
    from types import SimpleNamespace

    import numpy as np

    from treadle.trainer.data.batching import pad_batch
    from treadle.trainer.data.samples import Sample, TokenSeq
    from treadle.trainer.models.actor import Actor
    from treadle.trainer.trainers.sft import SFTTrainer

    table = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
    model = lambda input_ids, **_: SimpleNamespace(logits=table[input_ids])  # noqa: E731  a bigram "model"
    samples = [Sample(seqs=(TokenSeq(ids=np.array(ids), target=np.array(t, dtype=bool)),), index=k)
               for k, (ids, t) in enumerate([([1, 2, 3, 4], [0, 1, 1, 1]), ([5, 1], [0, 1])])]
    batch = pad_batch(samples, 0)
    lp = token_logprobs(table[batch.input_ids], batch.input_ids)
    for seq_mean, units, want in ((False, [3, 1], -(lp[0, 1:].sum() + lp[1, 1]) / 4),
                                  (True, [1.0, 1.0], -(lp[0, 1:].mean() + lp[1, 1]) / 2)):
        trainer = object.__new__(SFTTrainer)  # the loss only: no engine, no data
        trainer.actor, trainer.seq_mean = Actor(model), seq_mean
        assert [trainer.unit(s) for s in samples] == units
        loss, _ = trainer.micro_loss(batch, samples, sum(units))
        assert loss.item() == pytest.approx(want.item(), abs=1e-6)
