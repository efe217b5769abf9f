"""QLoRA (``--ds.load_in_4bit --ds.lora.rank R``) on CPU through bitsandbytes' CPU backend: the
base stays 4-bit, the adapters learn, and what leaves the trainer (HF export, weight sync) is the
dequantized base plus the adapters' delta at full precision, in the model's ordinary shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("bitsandbytes")


def _ds(**kw):
    from treadle.trainer.config.deepspeed import DeepSpeedConfig, LoraConfig

    return DeepSpeedConfig(load_in_4bit=True, lora=LoraConfig(rank=4, alpha=8), param_dtype="bf16", **kw)


def test_plan_sends_dequantized_base_plus_lora_delta(tiny):
    from bitsandbytes.functional import dequantize_4bit

    from treadle.trainer.models.loading import load_causal_lm
    from treadle.trainer.weights.plan import is_4bit, plan

    model = load_causal_lm(str(tiny), _ds(), trainable=True)
    assert is_4bit(model)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    torch.manual_seed(0)
    with torch.no_grad():
        q.lora_B["default"].weight.normal_(0, 0.5)  # a trained-looking adapter (B starts at zero)
    items = {it.name: it for it in plan(model)}
    it = items["model.layers.0.self_attn.q_proj.weight"]
    base = q.base_layer.weight
    assert base.dtype == torch.uint8 and it.shape == (64, 64) and it.dtype == torch.bfloat16
    want = dequantize_4bit(base.data, base.quant_state).float() \
        + q.scaling["default"] * (q.lora_B["default"].weight.float() @ q.lora_A["default"].weight.float())
    got = it.value()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # a 4-bit weight without adapters (none here: all-linear) and full-precision ones pass as they are
    emb = items["model.embed_tokens.weight"]
    assert emb.shape == (512, 64) and torch.equal(emb.value(), model.base_model.model.model.embed_tokens.weight)


def test_qlora_sft_run_learns_and_exports_a_plain_model(tiny, tmp_path, helpers):
    rows = [{"q": f"{a} plus {a}", "a": f"is {2 * a}"} for a in range(32)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(
        [sys.executable, "-m", "treadle.trainer.cli", "sft", "--actor.model_name_or_path", str(tiny),
         "--data.dataset", str(data), "--data.input_key", "q", "--data.output_key", "a", "--data.max_len", "32",
         "--train.batch_size", "8", "--train.micro_batch_size", "8", "--train.max_epochs", "4",
         "--adam.lr", "1e-2", "--ds.load_in_4bit", "--ds.lora.rank", "8", "--ds.param_dtype", "bf16",
         "--ckpt.path", str(tmp_path / "ck"), "--ckpt.output_dir", str(tmp_path / "out")],
        env=helpers.child_env(), capture_output=True, text=True, timeout=300, cwd=helpers.root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.2, losses

    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM

    from treadle.trainer.models.loading import load_causal_lm

    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    w = out.model.layers[0].self_attn.q_proj.weight.detach()
    assert w.shape == (64, 64) and w.dtype == torch.bfloat16
    # the export is the (deterministically) quantized base, dequantized, plus a rank <= 8 delta
    q = load_causal_lm(str(tiny), _ds(), trainable=False).model.layers[0].self_attn.q_proj.weight
    delta = w.float() - dequantize_4bit(q.data, q.quant_state).float()
    s = torch.linalg.svdvals(delta)
    assert s[0] > 0.05 and s[8] < 0.03 * s[0], s[:10]  # learned, and low-rank up to bf16 rounding
