"""``--train.enable_ema`` / ``--train.ema_beta``: an EMA of the actor's weights, exported instead of
the actor (issue 29; ``models.ema``).

- the update formula, worked by hand;
- the flags' validation (beta's range, beta without the EMA, LoRA refused);
- on 2 gloo ranks (``ema_scenario.py``), ZeRO-3 (with and without parameter offload) and ZeRO-2:
  the export equals ``ema_t = beta ema_{t-1} + (1 - beta) theta_t`` over the engine's real steps,
  each rank keeps half of it, and a checkpoint's save / load gives it back;
- ``treadle-train ppo`` end to end (ZeRO-3, the vLLM CPU daemon): every step's HF checkpoint
  and the final model are the EMA of the actor's weights (read from the DeepSpeed checkpoints), a
  run resumed from the last checkpoint exports that EMA again (not the actor), the run without
  the flag exports the actor and trains the same, and resumed from it with the flag (no EMA
  slices to load) the average restarts from the actor's weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treadle.common.config import ConfigError
from treadle.trainer.config import parse_command
from treadle.trainer.models.ema import ema_update_

HERE = Path(__file__).resolve().parent
PPO_BASE = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "r.py",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--actor.num_gpus_per_node", "1", "--rollout.batch_size", "8", "--train.batch_size", "8"]


def test_update_is_beta_times_the_average_plus_the_rest_times_the_weights():
    ema = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    params = [torch.tensor([3.0, -2.0], dtype=torch.bfloat16), torch.tensor([[0.0]])]
    ema_update_(ema, params, 0.75)
    # 0.75 * 1 + 0.25 * 3 = 1.5; 0.75 * 2 + 0.25 * -2 = 1.0; 0.75 * 4 + 0.25 * 0 = 3.0
    assert ema[0].tolist() == [1.5, 1.0] and ema[0].dtype == torch.float32
    assert ema[1].tolist() == [[3.0]]
    ema_update_(ema, params, 0.0)  # beta 0: the weights themselves
    assert ema[0].tolist() == [3.0, -2.0] and ema[1].tolist() == [[0.0]]
    ema_update_(ema, [torch.tensor([9.0, 9.0]), torch.tensor([[9.0]])], 1.0)  # beta 1: stays
    assert ema[0].tolist() == [3.0, -2.0]


def test_flags_parse_and_bad_combinations_are_refused():
    cfg = parse_command("ppo", [*PPO_BASE, "--train.enable_ema", "--train.ema_beta", "0.5"])
    assert cfg.train.enable_ema and cfg.train.ema_beta == 0.5
    assert parse_command("ppo", PPO_BASE).train.ema_beta == 0.992  # OpenRLHF's default
    cases = [
        (["--train.ema_beta", "0.5"], r"--train\.ema_beta 0\.5 is the decay of --train\.enable_ema's average, which is off"),
        (["--train.enable_ema", "--train.ema_beta", "1.5"], r"--train\.ema_beta must be in \[0, 1\], got 1\.5"),
        (["--train.enable_ema", "--ds.lora.rank", "8"], r"--train\.enable_ema with --ds\.lora\.rank 8"),
    ]
    for flags, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_command("ppo", [*PPO_BASE, *flags])


def expected_ema(weights: list[dict[str, torch.Tensor]], beta: float) -> dict[str, torch.Tensor]:
    """ema_0 = theta_0; ema_t = beta ema_{t-1} + (1 - beta) theta_t, in float64."""
    ema = {k: v.double() for k, v in weights[0].items()}
    for w in weights[1:]:
        ema = {k: beta * ema[k] + (1 - beta) * w[k].double() for k in ema}
    return ema


@pytest.fixture(scope="module")
def scenario(tiny, tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("ema")
    run_torchrun([str(HERE / "ema_scenario.py"), "--model", str(tiny), "--out", str(out)])
    return torch.load(out / "results.pt")


@pytest.mark.parametrize("variant", ["zero3", "zero3_offload", "zero2"])
def test_export_is_the_average_of_the_engine_steps_and_each_rank_keeps_half(scenario, variant):
    r = scenario[variant]
    weights, export = r["weights"], r["export"]
    ema = expected_ema(weights, 0.5)
    moved = 0
    for name, value in ema.items():
        assert torch.allclose(export[name].double(), value, rtol=1e-5, atol=1e-6), name
        moved += not torch.equal(weights[-1][name], weights[0][name])
        # the average is neither the start nor the end
    assert moved > len(ema) // 2
    name = max(ema, key=lambda n: (weights[-1][n] - weights[0][n]).abs().max())
    assert not torch.allclose(export[name], weights[-1][name]) and not torch.allclose(export[name], weights[0][name])
    assert r["shard_numel"] <= r["total_numel"] // 2 + len(ema)  # half of every tensor (+ padding)
    assert r["shard_dtype"] == "torch.float32"
    assert r["loaded"] and all(torch.equal(r["reloaded"][n], export[n]) for n in ema)


# -- end to end --------------------------------------------------------------------------------

REWARD = '''
import torch

def reward_func(queries, prompts, labels):
    out = []
    for q, p in zip(queries, prompts):
        text = q[len(p):] if q.startswith(p) else q
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / max(1, len(chars)))
    r = torch.tensor(out, dtype=torch.float32)
    return {"rewards": r, "scores": r}
'''


def _ppo(tiny: Path, root: Path, out: Path, helpers, *extra: str) -> list[dict]:
    args = ["ppo", "--actor.model_name_or_path", str(tiny), "--data.prompt_dataset", str(root / "prompts.jsonl"),
            "--data.input_key", "prompt", "--reward.remote_url", str(root / "reward.py"),
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--rollout.batch_size", "4", "--train.batch_size", "16", "--train.micro_batch_size", "16",
            "--rollout.micro_batch_size", "16", "--rollout.max_new_tokens", "8", "--data.prompt_max_len", "32",
            "--data.max_samples", "12", "--actor.adam.lr", "3e-3", "--actor.lr_warmup_ratio", "0",
            "--actor.num_gpus_per_node", "1", "--ds.param_dtype", "fp32", "--ds.zero_stage", "3",
            "--vllm.backend", "hf", "--ckpt.save_steps", "1", "--ckpt.save_hf", "--ckpt.max_num", "10",
            "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"), *extra]
    proc = subprocess.run([sys.executable, "-m", "treadle.trainer.cli", *args], env=helpers.child_env(),
                          capture_output=True, text=True, timeout=900, cwd=helpers.root)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(line) for line in (out / "ckpt" / "metrics.jsonl").read_text().splitlines()]


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _actor(step_dir: Path) -> dict[str, torch.Tensor]:
    """The actor's fp32 weights in a checkpoint's DeepSpeed state (ZeRO-3 master weights)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag="ds"))


def test_ppo_exports_the_ema_of_the_actor_and_without_the_flag_the_actor(tiny, helpers, tmp_path):
    root = tmp_path / "task"
    root.mkdir()
    words = ["apple", "banana", "cherry", "delta"]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"numbers for {words[i % 4]}:"}) + "\n"
                                                for i in range(12)))
    (root / "reward.py").write_text(REWARD)
    beta = 0.5
    on = _ppo(tiny, root, tmp_path / "on", helpers, "--train.enable_ema", "--train.ema_beta", str(beta))
    off = _ppo(tiny, root, tmp_path / "off", helpers)
    assert [r["step"] for r in on] == [1, 2, 3]
    start = _safetensors(tiny)
    names = [n for n in _actor(tmp_path / "on" / "ckpt" / "step_00000001") if n in start]
    assert len(names) == len(start)  # every weight is trained (the tied LM head is the embedding)
    thetas = [{n: start[n] for n in names}]
    for step in (1, 2, 3):
        step_dir = tmp_path / "on" / "ckpt" / f"step_{step:08d}"
        thetas.append({n: v for n, v in _actor(step_dir).items() if n in start})
        ema = expected_ema(thetas, beta)
        saved = _safetensors(step_dir / "hf")  # --ckpt.save_hf's copy is the EMA too, as OpenRLHF's
        for n in names:
            assert torch.allclose(saved[n].double(), ema[n], rtol=1e-5, atol=1e-6), (step, n)
    final = _safetensors(tmp_path / "on" / "model")
    assert all(torch.equal(final[n], saved[n]) for n in names)
    far = max(names, key=lambda n: (thetas[-1][n] - thetas[0][n]).abs().max())
    assert not torch.allclose(final[far], thetas[-1][far])  # not the actor
    # Resumed from the last checkpoint (nothing left to train), the run exports the saved average.
    _ppo(tiny, root, tmp_path / "on", helpers, "--train.enable_ema", "--train.ema_beta", str(beta),
         "--ckpt.load_enable", "--ckpt.output_dir", str(tmp_path / "resumed"))
    resumed = _safetensors(tmp_path / "resumed")
    assert all(torch.equal(resumed[n], final[n]) for n in names)
    # Without the flag: the actor itself is exported, and the EMA never changed the training.
    actor = {n: v for n, v in _actor(tmp_path / "off" / "ckpt" / "step_00000003").items() if n in start}
    final_off = _safetensors(tmp_path / "off" / "model")
    assert all(torch.equal(final_off[n], actor[n]) for n in names)
    for a, b in zip(on, off, strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["actor/policy_loss"] == pytest.approx(b["actor/policy_loss"])
    # Resumed with the flag from a checkpoint without EMA slices: the average restarts from the actor.
    _ppo(tiny, root, tmp_path / "off", helpers, "--train.enable_ema", "--ckpt.load_enable",
         "--ckpt.output_dir", str(tmp_path / "off_resumed"))
    restarted = _safetensors(tmp_path / "off_resumed")
    assert all(torch.equal(restarted[n], actor[n]) for n in names)
