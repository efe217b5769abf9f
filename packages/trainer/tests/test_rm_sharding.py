"""The PPO trainer's reward-model scoring is sharded like the reference's and the critic's: each
data-parallel rank scores its share of the batch, then every rank holds every score. Two gloo
ranks must give exactly the rewards one rank gives (``rm_share_scenario.py`` under torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_two_ranks_score_with_the_reward_model_exactly_as_one(tiny, helpers, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    for n in (1, 2):
        helpers.torchrun([str(HERE / "rm_share_scenario.py"), "--model", str(tiny), "--out", str(tmp_path),
                          "--prompts", str(prompts)], nproc=n)
    one = json.loads((tmp_path / "rewards_1.json").read_text())
    two = json.loads((tmp_path / "rewards_2.json").read_text())
    assert two["ranks_agree"]  # every rank holds every score after the gather
    # 10 samples in micro-batches of 3 (--rollout.micro_batch_size): [3, 3, 3, 1] on one rank, shared out on two
    assert one["scored"] == [[3, 3, 3, 1]] and two["scored"] == [[3, 3], [3, 1]]
    assert len(set(one["rewards"])) == len(one["rewards"]) == 10  # distinct: a shuffled gather would show
    assert two["rewards"] == one["rewards"]  # bit for bit
    assert two["reward_mean"] == one["reward_mean"]
