"""--optim muon: the parameter split, one optimizer step worked out by hand, the refusals at parse
time, real SFT runs on the tiny model (2-rank ZeRO-2 against 1-rank stage 0; a resumed run)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from treadle.common.config import ConfigError
from treadle.trainer.config import parse_command
from treadle.trainer.strategy.deepspeed import build_optimizer, ds_config
from treadle.trainer.strategy.muon import split_params

SFT = ["--actor.model_name_or_path", "m", "--data.dataset", "d"]  # parsing loads nothing: "m" need not exist
PPO = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "r.py",
       "--actor.num_gpus_per_node", "1", "--rollout.batch_size", "8", "--train.batch_size", "8"]


def _names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_split_gives_muon_the_hidden_matrices_and_adamw_the_rest(tiny):
    from transformers import AutoModelForCausalLM

    from treadle.trainer.models.value_model import ValueModel

    lm = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    muon, adam = split_params(lm)
    projections = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert _names(lm, muon) == projections
    adam_names = _names(lm, adam)  # the tied LM head is embed_tokens.weight itself
    assert "model.embed_tokens.weight" in adam_names and not adam_names & projections
    assert {p.ndim for n, p in lm.named_parameters() if n in adam_names and "embed" not in n} == {1}  # norms, biases
    assert len(muon) + len(adam) == len(list(lm.parameters()))

    critic = ValueModel(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).model, "score")
    muon, adam = split_params(critic)
    assert len(muon) == 14 and critic.score.weight.shape == (1, 64)
    assert any(p is critic.score.weight for p in adam)  # a 1-row head: AdamW, as Muon's authors advise

    critic.score.weight.requires_grad_(False)
    assert all(p is not critic.score.weight for group in split_params(critic) for p in group)  # frozen: neither


def test_one_step_orthogonalizes_matrices_and_adam_steps_the_rest():
    """One step from zero momentum. Muon: the update of a matrix is lr x NS(g) x sqrt(max(1, rows/cols)),
    whose singular values Newton-Schulz (5 quintic steps) puts near 1 (in [0.5, 1.5]), whatever g's
    spectrum. AdamW, step 1: m/sqrt(v) = g/|g| after bias correction, so each entry moves by lr exactly
    (up to eps); weight decay 0.1 shrinks the Muon matrix and the embedding by lr x 0.1 x w first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    cfg = parse_command("sft", [*SFT, "--optim", "muon", "--max_norm", "0", "--muon.lr", "0.02",
                                "--adam.lr", "1e-3", "--adam.weight_decay", "0.1"])
    opt = build_optimizer(model, cfg, offload=False)
    groups = sorted((g["use_muon"], g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups)
    assert groups == [(False, 1e-3, 0.0, 3), (False, 1e-3, 0.1, 1), (True, 0.02, 0.1, 1)]
    emb, lin = model[0].weight, model[1].weight
    assert lin.use_muon and not emb.use_muon and not model[1].bias.use_muon  # the tags DeepSpeed's ZeRO reads
    # a gradient whose singular values spread over a factor 100 (Newton-Schulz lifts those above ~1e-3 of the top)
    u, _, v = torch.linalg.svd(torch.randn(16, 8), full_matrices=False)
    spectrum = torch.tensor([10.0, 5.0, 2.0, 1.0, 0.5, 0.3, 0.2, 0.1])
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    lin.grad = u @ torch.diag(spectrum) @ v
    opt.step()
    step = -(lin.detach() - before[1] * (1 - 0.02 * 0.1)) / 0.02 / 2 ** 0.5  # rows/cols = 2
    sv = torch.linalg.svdvals(step)
    assert sv.min() > 0.5 and sv.max() < 1.5, sv  # plain SGD would keep the factor 100
    emb_step = (before[0] * (1 - 1e-3 * 0.1) - emb.detach()) / 1e-3
    assert torch.allclose(emb_step, torch.sign(emb.grad), atol=1e-4)
    norm_step = (before[3] - model[2].weight.detach()) / 1e-3  # LayerNorm weight: no decay
    assert torch.allclose(norm_step, torch.sign(model[2].weight.grad), atol=1e-4)


def test_deepspeed_config_for_muon():
    cfg = parse_command("sft", [*SFT, "--optim", "muon", "--max_norm", "0", "--ds.zero_stage", "3",
                                "--ds.adam_offload"])
    out = ds_config(cfg.ds, cfg, micro_batch=1, grad_accum=1, world=1)
    assert out["zero_optimization"]["reduce_scatter"] is False  # ZeRO-3 raises on Muon with reduce-scatter
    assert out["zero_force_ds_cpu_optimizer"] is False  # Muon's AdamW half is DeepSpeed's CPU Adam
    plain = parse_command("sft", SFT)
    assert "reduce_scatter" not in ds_config(plain.ds, plain, micro_batch=1, grad_accum=1, world=1)["zero_optimization"]


@pytest.mark.parametrize(("command", "extra", "message"), [
    ("sft", ["--optim", "muon"],
     r"--optim muon with --max_norm 1\.0 under --ds\.zero_stage 2: DeepSpeed clips after Newton-Schulz.*"
     r"pass --max_norm 0"),
    ("dpo", ["--optim", "muon", "--ds.zero_stage", "3", "--max_norm", "0.5"], r"--max_norm 0\.5 under --ds\.zero_stage 3"),
    ("ppo", ["--actor.optim", "muon"], r"--actor\.optim muon with --actor\.max_norm 1\.0 under --ds\.zero_stage 2"),
    ("ppo", ["--critic.optim", "muon", "--critic.max_norm", "2"], r"--critic\.optim muon with --critic\.max_norm 2"),
    ("rm", ["--optim", "muon", "--max_norm", "0", "--ds.tensor_parallel_size", "2"],
     r"--optim muon with --ds\.tensor_parallel_size 2: each rank would orthogonalize only its shard"),
    ("kto", ["--optim", "muon", "--max_norm", "0", "--ds.deepcompile"], r"--optim muon with --ds\.deepcompile"),
    ("ppo", ["--actor.optim", "muon", "--actor.max_norm", "0", "--ds.zero_stage", "3", "--ds.enable_sleep",
             "--train.colocate_all"], r"--actor\.optim muon with --ds\.enable_sleep: .* only FusedAdam"),
    ("sft", ["--muon.lr", "0.1"], r"--muon\.lr: Muon's settings, read only with --optim muon \(this run's --optim is adam\)"),
    ("ppo", ["--critic.muon.momentum", "0.9"], r"--critic\.muon\.momentum: Muon's settings, read only with --critic\.optim"),
])
def test_refused_at_parse_time(command, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_command(command, [*(PPO if command == "ppo" else SFT), *extra])


@pytest.mark.parametrize(("command", "extra"), [
    ("sft", ["--optim", "muon", "--max_norm", "0", "--ds.zero_stage", "3", "--ds.adam_offload", "--ds.param_offload"]),
    ("sft", ["--optim", "muon", "--ds.zero_stage", "0"]),  # stage 0 clips the raw gradients: max_norm allowed
    ("rm", ["--optim", "muon", "--max_norm", "0", "--muon.lr", "1e-3", "--muon.momentum", "0.9"]),
    ("ppo", ["--actor.optim", "muon", "--actor.max_norm", "0", "--actor.muon.lr", "1e-4"]),
])
def test_accepted(command, extra):
    parse_command(command, [*(PPO if command == "ppo" else SFT), *extra])


def _one_rank(helpers, args: list[str]) -> None:
    proc = subprocess.run([sys.executable, *args], env=helpers.child_env(), capture_output=True, text=True,
                          timeout=400, cwd=helpers.root)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _sft_losses(tiny, data, out, stage: int, launch) -> list[dict]:
    launch(["-m", "treadle.trainer.cli", "sft", "--actor.model_name_or_path", str(tiny),
            "--data.dataset", str(data.sft), "--data.input_key", "question", "--data.output_key", "response",
            "--data.max_samples", "48", "--train.batch_size", "8", "--train.micro_batch_size", "2",
            "--ds.zero_stage", str(stage), "--ds.param_dtype", "fp32", "--train.max_epochs", "1",
            "--optim", "muon", "--max_norm", "0", "--muon.lr", "0.05", "--adam.lr", "2e-3",
            "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model")])
    return [json.loads(line) for line in (out / "ckpt" / "metrics.jsonl").read_text().splitlines()]


def test_sft_with_muon_trains_and_zero2_on_two_ranks_steps_like_one_rank_without_zero(tiny, data, tmp_path, helpers):
    """Under ZeRO-2 each of the 2 ranks holds part of every matrix's flat gradient; DeepSpeed
    gathers the whole matrix for Newton-Schulz, so the run follows the one-rank, stage-0 run (where
    Muon steps the unpartitioned weights), step for step. Orthogonalizing each rank's part instead
    would not. The logged grad_norm (ZeRO only) is the norm of the orthogonalized updates, which
    is why clipping is refused: sqrt(sum over matrices of ~min(m, n) x rows/cols), tens for the
    tiny model, where AdamW's raw gradients have a norm of about 2."""
    zero2 = _sft_losses(tiny, data, tmp_path / "zero2", 2, helpers.torchrun)
    stage0 = _sft_losses(tiny, data, tmp_path / "stage0", 0, lambda args: _one_rank(helpers, args))
    losses = [r["loss"] for r in zero2]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert losses == pytest.approx([r["loss"] for r in stage0], abs=1e-3)
    assert all(r["grad_norm"] > 10 for r in zero2), [r["grad_norm"] for r in zero2]


def test_a_resumed_muon_run_continues_as_if_uninterrupted(tiny, data, tmp_path, helpers):
    """The checkpoint keeps Muon's momentum (in DeepSpeed's optimizer state): resumed from step 4,
    the run's steps 5-8 log the uninterrupted run's losses. Step 6's loss already depends on the
    momentum: a fresh one would make step 5's update NS(g) instead of NS(g blended with the past)."""
    args = ["-m", "treadle.trainer.cli", "sft", "--actor.model_name_or_path", str(tiny), "--data.dataset", str(data.sft),
            "--data.input_key", "question", "--data.output_key", "response", "--data.max_samples", "32",
            "--train.batch_size", "8", "--train.micro_batch_size", "4", "--ds.param_dtype", "fp32",
            "--ds.zero_stage", "2", "--train.max_epochs", "2", "--optim", "muon", "--max_norm", "0",
            "--muon.lr", "0.05", "--adam.lr", "2e-3", "--ckpt.path", str(tmp_path / "ckpt"),
            "--ckpt.output_dir", str(tmp_path / "model")]
    _one_rank(helpers, [*args, "--ckpt.save_steps", "4"])
    shutil.rmtree(tmp_path / "ckpt" / "step_00000008")  # resume from step 4
    _one_rank(helpers, [*args, "--ckpt.load_enable"])
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8]
    assert [r["loss"] for r in rows[8:]] == pytest.approx([r["loss"] for r in rows[4:8]], abs=1e-6)
