"""Knowledge distillation: the loss by hand, the config's refusals, and ``treadle-train kd`` on two
ZeRO-2 ranks moving a tiny student's token distributions toward a different-seed teacher's
(KL(teacher || student) on the training answers falls, measured here on the exported model)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from treadle_testing import load_tool

from treadle.common.config import ConfigError
from treadle.trainer.config import parse_kd
from treadle.trainer.losses.kd import kd_kl, kd_loss, mixed_kd_loss


def test_kd_loss_by_hand():
    # one position, V = 2. teacher logits (0, 0): p_T = (1/2, 1/2); student logits (0, ln 3): p_S = (1/4, 3/4)
    student, teacher = torch.tensor([[0.0, math.log(3.0)]]), torch.zeros(1, 2)
    # KD = -(1/2 ln 1/4 + 1/2 ln 3/4) = (ln 4 + ln 4 - ln 3) / 2 = 1.386294 - 0.549306 = 0.836988; over N = 2 tokens: 0.418494
    torch.testing.assert_close(kd_loss(student, teacher, 2.0), torch.tensor(0.418494), atol=1e-6, rtol=0)
    # KL = 1/2 ln(2) + 1/2 ln(2/3) = 0.346574 - 0.202733 = 0.143841 = KD - H(p_T) = 0.836988 - ln 2
    torch.testing.assert_close(kd_kl(student, teacher), torch.tensor([0.143841]), atol=1e-6, rtol=0)
    # (1 - 0.4) * 2 + 0.4 * 1 = 1.6
    assert mixed_kd_loss(torch.tensor(2.0), torch.tensor(1.0), 0.4).item() == pytest.approx(1.6)


def test_kd_loss_gradient_is_the_forward_kls_and_ignores_masked_entries():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 5, generator=g, requires_grad=True), torch.randn(3, 5, generator=g)
    kd_loss(student, teacher, 3.0).backward()
    grad_kd = student.grad.clone()
    student.grad = None
    kd_kl(student, teacher).sum().div(3.0).backward()
    torch.testing.assert_close(grad_kd, student.grad)  # the teacher's entropy is a constant of the student
    # d/dz_S of -sum p_T log softmax(z_S) = softmax(z_S) - p_T
    torch.testing.assert_close(grad_kd, (torch.softmax(student, -1) - torch.softmax(teacher, -1)).detach() / 3.0)
    masked = torch.tensor([[0.0, -math.inf, 1.0]])
    assert torch.isfinite(kd_loss(masked, torch.zeros(1, 3), 1.0))


def _base(tiny):
    return ["--actor.model_name_or_path", str(tiny), "--data.dataset", "d.jsonl", "--data.input_key", "question",
            "--data.output_key", "response"]


@pytest.mark.parametrize(("extra", "message"), [
    ([], "--teacher.model_name_or_path is required"),
    (["--teacher.model_name_or_path", "t", "--teacher.kd_coef", "1.5"], "--teacher.kd_coef must be in [0, 1], got 1.5"),
    (["--teacher.model_name_or_path", "t", "--ds.packing_samples", "--ds.ring_attn_size", "2"], "--ds.ring_attn_size 2"),
])
def test_kd_refusals(tiny, extra, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_kd([*_base(tiny), *extra])


def test_openrlhfs_flags_name_their_replacements(tiny):
    for old, new in [("--teacher_model", "--teacher.model_name_or_path"), ("--teacher_offload", "--teacher.offload"),
                     ("--kd_coef", "--teacher.kd_coef")]:
        with pytest.raises(ConfigError, match=f"{old} was renamed: use {new} instead"):
            parse_kd([*_base(tiny), "--teacher.model_name_or_path", "t", old, "1"])
    cfg = parse_kd([*_base(tiny), "--teacher.model_name_or_path", "t", "--teacher.offload", "--teacher.kd_coef", "0.7"])
    assert (cfg.teacher.model_name_or_path, cfg.teacher.offload, cfg.teacher.kd_coef) == ("t", True, 0.7)


def _mean_kl(student_path, teacher_path, rows, tokenizer):
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            prompt = tokenizer(row["question"])["input_ids"]
            ids = torch.tensor([prompt + tokenizer(row["response"])["input_ids"]])
            cut = slice(len(prompt) - 1, ids.shape[1] - 1)  # logits predicting the answer's tokens
            kl = kd_kl(student(ids).logits[0, cut], teacher(ids).logits[0, cut])
            total, count = total + float(kl.sum()), count + kl.numel()
    return total / count


@pytest.mark.slow
def test_kd_run_moves_the_student_toward_the_teacher(tiny, tokenizer, data, tmp_path, run_torchrun):
    teacher = load_tool("tiny_model").build("tiny", tmp_path / "teacher", seed=1).out
    out = tmp_path / "run"
    run_torchrun(["-m", "treadle.trainer.cli", "kd", "--actor.model_name_or_path", str(tiny),
                  "--teacher.model_name_or_path", str(teacher), "--teacher.kd_coef", "1.0",
                  "--data.dataset", str(data.sft), "--data.input_key", "question", "--data.output_key", "response",
                  "--data.max_samples", "32", "--train.batch_size", "8", "--train.micro_batch_size", "2",
                  "--ds.zero_stage", "2", "--ds.param_dtype", "fp32", "--adam.lr", "3e-3", "--train.max_epochs", "2",
                  "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model")])
    rows = [json.loads(line) for line in data.sft.read_text().splitlines()[:32]]
    before = _mean_kl(tiny, teacher, rows, tokenizer)
    after = _mean_kl(out / "model", teacher, rows, tokenizer)
    print(f"KL(teacher || student) per answer token: {before:.4f} -> {after:.4f}")
    assert after < 0.5 * before, (before, after)
    logged = [json.loads(line) for line in (out / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["kl"] for r in logged if "kl" in r]
    assert len(kls) == 8 and kls[-1] < kls[0], kls
