"""``treadle-train critic``: what the server refuses, before any model loads, and that it goes on
serving after each refusal. A real server (2 gloo ranks under torchrun) and the trainer's own
client (``models.remote_critic``); the training itself is tested end to end in test_ppo.py."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from treadle_testing import critic_server

from treadle.common.config import ConfigError
from treadle.common.errors import BadRequest
from treadle.common.records import CriticCheckpoint, CriticSetup, CriticTrainRequest
from treadle.trainer.config import dump_yaml, parse_command
from treadle.trainer.models.remote_critic import RemoteCritic, expected_world, split_values

PPO = ["--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "r.py", "--algo.advantage.estimator", "gae",
       "--rollout.n_samples_per_prompt", "1", "--rollout.batch_size", "8", "--train.batch_size", "8",
       "--train.micro_batch_size", "4", "--actor.num_gpus_per_node", "1"]


@pytest.fixture(scope="module")
def server(helpers) -> Iterator[str]:
    with critic_server(helpers.child_env(), helpers.root, ranks=2) as endpoint:
        yield endpoint


@pytest.fixture
def critic(server) -> Iterator[RemoteCritic]:
    client = RemoteCritic(server)
    client.wait_ready(timeout=120)
    try:
        yield client
    finally:
        client.close()


def ppo(tiny, *extra: str):
    return parse_command("ppo", ["--actor.model_name_or_path", str(tiny), *PPO, *extra])


def test_flags_the_critic_ranks_cannot_run_are_refused_and_it_goes_on_serving(critic, tiny):
    # one trainer rank takes 8 samples in micro-batches of 4; the server's 2 ranks would need 8 = 4 x 2 x k
    with pytest.raises(ConfigError, match=r"refused check: .*--train\.batch_size 8"):
        critic.check(ppo(tiny, "--train.micro_batch_size", "8"), total_opt_steps=4, pad_id=0)
    group_norm = ppo(tiny, "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4")
    with pytest.raises(ConfigError, match=r"refused check: the run has no critic \(--algo\.advantage\.estimator group_norm\)"):
        critic.check(group_norm, total_opt_steps=4, pad_id=0)
    with pytest.raises(ConfigError, match=r"--critic\.num_gpus_per_node = 3 ranks, but the critic server .* runs 2"):
        critic.check(ppo(tiny, "--critic.num_gpus_per_node", "3", "--critic.remote_url", critic.url),
                     total_opt_steps=4, pad_id=0)
    # the flags of a run it can serve pass (nothing is loaded by check)
    critic.check(ppo(tiny, "--critic.num_gpus_per_node", "2", "--critic.remote_url", critic.url), total_opt_steps=4,
                 pad_id=0)


def test_requests_out_of_order_or_malformed_are_refused_by_name(critic, tiny):
    client = critic._client
    with pytest.raises(BadRequest, match="no critic yet: the trainer sends setup first"):
        client.call("train", CriticTrainRequest(step=1, uids=["a"], returns=np.zeros(3, np.float32)))
    with pytest.raises(BadRequest, match="values takes a CriticValuesRequest, got CriticCheckpoint"):
        client.call("values", CriticCheckpoint(path="/x"))
    with pytest.raises(BadRequest, match="not valid YAML"):
        client.call("check", CriticSetup(config="a: [\n", total_opt_steps=1, pad_id=0))
    assert client.call("health") is not None  # still serving


def test_the_server_reads_and_writes_only_the_runs_own_folders(critic, tiny, tmp_path):
    """save / load / export name folders on the server's filesystem: only under the run's
    --ckpt.path (and its critic export folder); DeepSpeed's torch.load never sees another file."""
    cfg = ppo(tiny, "--critic.num_gpus_per_node", "2", "--critic.remote_url", critic.url, "--ckpt.path",
              str(tmp_path / "ckpt"), "--ckpt.output_dir", str(tmp_path / "out"), "--ds.zero_stage", "3")
    ready = critic.setup_async(critic.check(cfg, total_opt_steps=4, pad_id=0)).result(timeout=300)
    assert ready.world == 2 and ready.trained_steps == 0
    for call, path in ((critic.save, tmp_path / "elsewhere"), (critic.load, tmp_path / "ckpt" / ".." / "x"),
                       (critic.export, tmp_path / "out")):
        with pytest.raises(ConfigError, match=r"is not inside the run's --"):
            call(str(path))
    with pytest.raises(ConfigError, match=r"holds no critic state"):
        critic.load(str(tmp_path / "ckpt" / "step_00000001"))
    critic.save(str(tmp_path / "ckpt" / ".tmp-step_00000001"))
    assert sorted(p.name for p in (tmp_path / "ckpt" / ".tmp-step_00000001" / "critic").glob("*model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]  # ZeRO-3, 2 ranks
    critic.load(str(tmp_path / "ckpt" / ".tmp-step_00000001"))


def test_the_last_trainer_to_set_up_owns_the_server(critic, server, tiny, tmp_path):
    """A second trainer's setup takes the server over (a restarted trainer is a new client); the
    first one's later requests are refused by name, not interleaved with the new run's."""
    cfg = ppo(tiny, "--critic.num_gpus_per_node", "2", "--critic.remote_url", server, "--ckpt.path",
              str(tmp_path / "ckpt"), "--ds.zero_stage", "3")
    critic.setup_async(critic.check(cfg, total_opt_steps=4, pad_id=0)).result(timeout=300)
    other = RemoteCritic(server)
    try:
        other.setup_async(other.check(cfg, total_opt_steps=4, pad_id=0)).result(timeout=300)
        with pytest.raises(ConfigError, match="serves another trainer's run now"):
            critic.save(str(tmp_path / "ckpt" / "x"))
        other.save(str(tmp_path / "ckpt" / "x"))
    finally:
        other.close()


def test_expected_world_and_split_values_are_pure(tiny):
    assert expected_world(ppo(tiny)) is None
    assert expected_world(ppo(tiny, "--critic.num_gpus_per_node", "4", "--critic.remote_url", "tcp://127.0.0.1:1")) == 4
    from treadle.common.records import CriticValues

    parts = split_values(CriticValues(values=np.arange(5, dtype=np.float32)), [2, 0, 3])
    assert [p.tolist() for p in parts] == [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
    with pytest.raises(ValueError, match="sent 5 values for 4 action tokens"):
        split_values(CriticValues(values=np.arange(5, dtype=np.float32)), [4])
    assert "critic:" in dump_yaml(ppo(tiny))
