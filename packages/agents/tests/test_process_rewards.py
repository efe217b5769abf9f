"""Per-token (process) rewards from an environment: ``StepResult.token_rewards`` land on the
turn's tokens of the Trajectory (``EpisodeBuilder.reward_last_turn``), 0 elsewhere; a wrong count
or a non-finite value is refused where it is given. The rollout path through a real daemon is
the trainer's ``test_agent_process_rewards``."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.agents.api import StepResult
from treadle.agents.builder import EpisodeBuilder
from treadle.agents.openrlhf.loader import from_openrlhf, to_openrlhf


def test_turn_rewards_land_on_the_turn_tokens() -> None:
    b = EpisodeBuilder([10, 11])
    b.add_turn([20, 21], None, [0])
    b.reward_last_turn([0.5, -1.0])
    b.add_observation([30, 31, 32])
    b.add_turn([40], None, [0])  # a turn without any: zeros there
    b.add_turn([50, 51], None, [0])
    b.reward_last_turn(np.array([2.0, 3.0]))
    t = b.build(reward=1.0)
    assert t.token_rewards.tolist() == [0.5, -1.0, 0, 0, 0, 0, 2.0, 3.0]
    assert t.token_rewards.dtype == np.float32
    plain = EpisodeBuilder([1])
    plain.add_turn([2], None, [0])
    assert plain.build().token_rewards is None  # none given: no array at all


def test_a_wrong_count_or_a_non_finite_reward_is_refused() -> None:
    b = EpisodeBuilder([1])
    with pytest.raises(ValueError, match="before any turn"):
        b.reward_last_turn([1.0])
    b.add_turn([2, 3, 4], None, [0])
    with pytest.raises(ValueError, match="2 values for a turn of 3 tokens"):
        b.reward_last_turn([1.0, 2.0])
    with pytest.raises(ValueError, match="token_rewards must be finite"):
        StepResult(token_rewards=[0.0, float("inf")])


def test_openrlhf_dicts_carry_them_per_observation_token() -> None:
    b = EpisodeBuilder([10, 11])
    b.add_turn([20, 21], None, [0])
    b.reward_last_turn([0.25, 0.75])
    b.add_observation([30])
    t = b.build(reward=1.0, uid="u")
    out = to_openrlhf(t, "p", None)
    assert out["token_rewards"] == [0.0, 0.0, 0.25, 0.75, 0.0]  # the prompt's entries too, like rollout_log_probs
    back = from_openrlhf(out, [], uid="u", group_id="", info={})
    assert back.token_rewards.tolist() == t.token_rewards.tolist()
    del out["token_rewards"]
    assert from_openrlhf(out, [], uid="u", group_id="", info={}).token_rewards is None
