"""Reward-model scoring in the PPO trainer's experience step, run by test_rm_sharding.py under
``torchrun --nproc_per_node N`` (gloo): ``PPOTrainer.experiences`` on the same fixed trajectories
with the tiny model as reward model (a fresh score head), each rank scoring its share. Rank 0
writes ``<out>/rewards_<N>.json``: every experience's reward, whether the ranks' copies agree,
and the sizes of the micro-batches each rank scored."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def trajectories(n: int = 10, seed: int = 0) -> list:
    from treadle.common.records import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):  # lengths differ, so micro-batches pad differently on 1 and 2 ranks
        p, r = int(rng.integers(3, 9)), int(rng.integers(2, 12))
        out.append(Trajectory(prompt_token_ids=rng.integers(3, 500, p).astype(np.int32),
                              response_token_ids=rng.integers(3, 500, r).astype(np.int32),
                              rollout_logprobs=np.full(r, -1.0, np.float32), loss_mask=np.ones(r, np.uint8),
                              reward=0.0, uid=f"{i}.0", group_id=f"g{i}"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", required=True)
    a = ap.parse_args()
    from treadle.trainer.config import parse_ppo
    from treadle.trainer.models.loading import load_tokenizer
    from treadle.trainer.ring.group import data_parallel
    from treadle.trainer.trainers import build
    from treadle.trainer.trainers.ppo import PPOTrainer
    from treadle.trainer.trainers.ppo_build import PPOParts, frozen_models

    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    cfg = parse_ppo(["--actor.model_name_or_path", a.model, "--reward.model_name_or_path", a.model,
                     "--data.prompt_dataset", a.prompts, "--data.input_key", "prompt",
                     "--actor.num_gpus_per_node", str(world), "--algo.advantage.estimator", "reinforce",
                     "--rollout.n_samples_per_prompt", "1", "--rollout.batch_size", "10", "--train.batch_size", "10",
                     "--rollout.micro_batch_size", "3", "--ds.param_dtype", "fp32", "--algo.kl.init_coef", "0",
                     "--ckpt.path", f"{a.out}/ckpt", "--ckpt.output_dir", f"{a.out}/model"])
    info = build.start(cfg)
    _, rm = frozen_models(cfg, info, None)
    parts = PPOParts(cfg=cfg, dist=info, tokenizer=load_tokenizer(a.model), prompts=[], eval_prompts=[], ring=None,
                     dp=data_parallel(info, None), actor=None, critic=None, reference=None, reward_model=rm,
                     checkpointer=None, opt_steps_per_rl_step=1)
    scored = []  # the sizes of the batches this rank scored
    plain = rm.scores
    rm.scores = lambda values, batch: scored.append(len(batch.last_index)) or plain(values, batch)
    trainer = PPOTrainer(parts)
    exps, metrics = trainer.experiences(trajectories())
    rewards = [e.reward for e in exps]
    gathered = [(rewards, scored)] * info.world
    if info.world > 1:
        dist.all_gather_object(gathered, (rewards, scored))
    if info.rank == 0:
        Path(a.out, f"rewards_{info.world}.json").write_text(json.dumps(
            {"rewards": rewards, "ranks_agree": all(g[0] == rewards for g in gathered),
             "scored": [g[1] for g in gathered], "reward_mean": metrics["reward/mean"]}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
