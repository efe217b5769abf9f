"""``treadle-train ppo --actor.num_gpus_per_node N`` without a launcher starts N ranks (issue 34
item 3), as OpenRLHF's train_ppo_ray starts its ranks from its placement flags; under torchrun
the launcher's world is kept and must agree with the flags (refused before anything loads).

- ``plan``: what runs here for each combination of flags and launcher (env of torchrun faked);
- the command line with ``--actor.num_gpus_per_node 2`` and no torchrun trains a step on 2 gloo
  ranks of the tiny model (each rank writes its own ZeRO optimizer shard);
- a mismatch under a launcher is refused (status 2); a failing rank's status is the command's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PPO = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "math",
       "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
       "--rollout.batch_size", "16", "--train.batch_size", "16", "--rollout.micro_batch_size", "8"]


def cfg_of(*extra: str):
    from treadle.trainer.config import parse_command

    return parse_command("ppo", [*PPO, *extra])


def test_plan_by_flags_and_launcher(monkeypatch) -> None:
    from treadle.common.config import ConfigError
    from treadle.trainer import ranks

    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert ranks.plan(cfg_of("--actor.num_gpus_per_node", "1")) == 0  # one rank: this process
    assert ranks.plan(cfg_of("--actor.num_gpus_per_node", "2")) == 2  # two: started here
    assert ranks.plan(cfg_of()) == 8  # OpenRLHF's default, 8 per node
    with pytest.raises(ConfigError, match=r"ranks on 2 hosts need a launcher on each \(torchrun --nnodes 2"):
        ranks.plan(cfg_of("--actor.num_nodes", "2", "--actor.num_gpus_per_node", "1"))
    # under torchrun (TORCHELASTIC_RUN_ID set): its world, which must be the flags'
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert ranks.plan(cfg_of("--actor.num_gpus_per_node", "2")) == 0
    assert ranks.plan(cfg_of("--actor.num_nodes", "2", "--actor.num_gpus_per_node", "1")) == 0
    with pytest.raises(ConfigError, match=r"--actor.num_nodes 1 x --actor.num_gpus_per_node 8 = 8 ranks, but the "
                                          r"launcher started 2"):
        ranks.plan(cfg_of())
    # commands without placement flags run as launched
    from treadle.trainer.config import parse_command

    sft = parse_command("sft", ["--actor.model_name_or_path", "m", "--data.dataset", "d.jsonl"])
    assert ranks.wanted_ranks(sft) is None and ranks.plan(sft) == 0


def run_cli(args: list[str], helpers, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treadle.trainer.cli", *args], env={**helpers.child_env(), **env},
                          capture_output=True, text=True, timeout=timeout, cwd=helpers.root)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ranks") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(8)))
    return path


def ppo_args(tiny: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["ppo", "--actor.model_name_or_path", str(tiny), "--data.prompt_dataset", str(prompts),
            "--data.input_key", "prompt", "--data.label_key", "label", "--reward.remote_url", "math",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--rollout.batch_size", "4", "--train.batch_size", "16", "--train.micro_batch_size", "8",
            "--rollout.micro_batch_size", "8", "--rollout.max_new_tokens", "6", "--data.prompt_max_len", "16",
            "--data.max_samples", "4", "--ds.param_dtype", "fp32", "--ds.zero_stage", "2",
            "--algo.kl.init_coef", "0", "--vllm.backend", "hf", "--vllm.bucket_mb", "1",
            "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model"), *extra]


def test_two_ranks_from_one_command_train_a_step(tiny, prompts, helpers, tmp_path) -> None:
    proc = run_cli(ppo_args(tiny, prompts, tmp_path, "--actor.num_gpus_per_node", "2", "--ckpt.save_steps", "1"),
                   helpers)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["samples"] == 16
    # ZeRO-2 shards the optimizer over the data-parallel ranks: one shard file per rank
    shards = sorted(p.name for p in (tmp_path / "ckpt").rglob("*optim_states.pt"))
    assert [s.split("_mp_rank")[0] for s in shards] == ["zero_pp_rank_0", "zero_pp_rank_1"], shards


def test_a_mismatch_under_torchrun_is_refused_before_anything_loads(tiny, prompts, helpers, tmp_path) -> None:
    proc = run_cli(ppo_args(tiny, prompts, tmp_path, "--actor.num_gpus_per_node", "2"), helpers,
                   TORCHELASTIC_RUN_ID="t", WORLD_SIZE="3", RANK="0", LOCAL_RANK="0")
    assert proc.returncode == 2
    assert "--actor.num_gpus_per_node 2 = 2 ranks, but the launcher started 3" in proc.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_a_failing_rank_gives_the_command_its_status(tiny, helpers, tmp_path) -> None:
    # both ranks start and fail on the missing dataset: the command fails with their status
    proc = run_cli(ppo_args(tiny, tmp_path / "missing.jsonl", tmp_path, "--actor.num_gpus_per_node", "2"), helpers,
                   timeout=300)
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr  # a rank's status: a data error is 2
