"""``treadle-train``: bad flags and malformed rows end with one line naming them (status 2); an
SFT run under ``torchrun -m treadle.trainer.cli`` (chat conversations, packing, dynamic batches,
evaluation, best checkpoint, TensorBoard) leaves metrics, curves, checkpoints and an HF export
that transformers and vLLM's CPU build load with the same log-probs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treadle.trainer.cli import main


def test_usage_and_bad_flags_exit_2(capsys):
    assert main([]) == 2 and "usage: treadle-train" in capsys.readouterr().err
    assert main(["sft", "--data.dataset", "d.jsonl"]) == 2
    assert "--actor.model_name_or_path is required" in capsys.readouterr().err
    assert main(["dpo", "--actor.model_name_or_path", "m", "--data.dataset", "d", "--beta", "0.2"]) == 2
    assert "--beta was renamed: use --actor.beta" in capsys.readouterr().err
    assert main(["kto", "--actor.model_name_or_path", "m", "--data.dataset", "d", "--train.dynamic_batch_enable"]) == 2
    assert "--train.dynamic_batch_enable needs --ds.packing_samples" in capsys.readouterr().err
    # the deepspeed launcher passes --local_rank=N before the command
    assert main(["--local_rank=1", "rm", "--data.dataset", "d.jsonl"]) == 2
    assert "treadle-train rm: error: --actor.model_name_or_path is required" in capsys.readouterr().err


def test_single_process_run_names_a_malformed_row(tiny, tmp_path, helpers):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "response": "r"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "treadle.trainer.cli", "sft", "--actor.model_name_or_path", str(tiny),
         "--data.dataset", str(bad), "--data.input_key", "question", "--data.output_key", "response",
         "--ds.param_dtype", "fp32", "--ckpt.path", str(tmp_path / "ck"), "--ckpt.output_dir", str(tmp_path / "out")],
        env=helpers.child_env(), capture_output=True, text=True, timeout=300, cwd=helpers.root)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{bad} row 1: key 'response': missing or null" in proc.stderr


@pytest.fixture(scope="module")
def sft_run(tiny, data, tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("cli_sft")
    run_torchrun(["-m", "treadle.trainer.cli", "sft", "--actor.model_name_or_path", str(tiny),
                  "--data.dataset", str(data.chat), "--data.input_key", "messages", "--data.apply_chat_template",
                  "--data.multiturn", "--data.max_samples", "48", "--eval.dataset", str(data.chat),
                  "--eval.steps", "2", "--train.batch_size", "8", "--train.micro_batch_size", "2",
                  "--ds.packing_samples", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "200",
                  "--ds.zero_stage", "2", "--ds.param_dtype", "fp32", "--adam.lr", "2e-3", "--train.max_epochs", "1",
                  "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"), "--ckpt.save_steps", "3",
                  "--ckpt.max_num", "1", "--ckpt.save_hf", "--logger.tensorboard_dir", str(out / "tb")])
    return out


def test_run_leaves_metrics_curves_checkpoints_and_tensorboard(sft_run):
    rows = [json.loads(line) for line in (sft_run / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]
    assert (sft_run / "ckpt" / "curves.png").stat().st_size > 1000
    assert (sft_run / "ckpt" / "config.yaml").read_text().count("apply_chat_template: true") == 1
    steps = sorted(p.name for p in (sft_run / "ckpt").glob("step_*"))
    best = min((r["eval_loss"], r["step"]) for r in rows if "eval_loss" in r)[1]
    assert steps == sorted({f"step_{best:08d}", "step_00000006"})  # the last one (max_num 1) and the best
    state = json.loads((sft_run / "ckpt" / "step_00000006" / "state.json").read_text())
    assert state["global_step"] == 6 and state["epoch"] == 1 and state["best_step"] == best
    assert not list((sft_run / "ckpt").glob(".tmp-*"))
    assert (sft_run / "ckpt" / "step_00000006" / "hf" / "model.safetensors").is_file()  # --ckpt.save_hf
    assert any((sft_run / "tb").iterdir())


def _hf_prompt_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


VLLM_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[3])
import vllm_cpu
vllm_cpu.apply_env()
if __name__ == "__main__":
    from vllm import SamplingParams, TokensPrompt
    llm = vllm_cpu.start_llm(sys.argv[1])
    ids = json.loads(sys.argv[2])
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    print(json.dumps([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]))
    vllm_cpu.stop_llm(llm)
"""


def test_export_loads_in_transformers_and_vllm_with_the_same_logprobs(sft_run, tokenizer, tmp_path, helpers):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    model_dir = sft_run / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "repeat fox golf"}, {"role": "assistant", "content": "fox golf"}],
                                  tokenize=True, return_dict=False)
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "repeat fox golf"},
                                                 {"role": "assistant", "content": "fox golf"}], tokenize=True, return_dict=False)
    hf = _hf_prompt_logprobs(model_dir, ids)
    script = tmp_path / "vllm_logprobs.py"
    script.write_text(VLLM_SCRIPT)
    env = helpers.child_env()
    env.update(VLLM_CACHE_ROOT=str(helpers.root / ".cache" / "vllm"), TREADLE_CACHE_DIR=str(helpers.root / ".cache"))
    proc = subprocess.run([sys.executable, str(script), str(model_dir), json.dumps(ids), str(helpers.root / "tools")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == pytest.approx(hf, abs=1e-4)
