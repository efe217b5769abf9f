"""``treadle-launch --backend local`` end to end on CPU with real components: a rollout daemon (HF
engine) on the tiny model, a reward daemon serving a reward function file, and a 2-step GRPO run
of ``treadle-train ppo`` wired to both; then the ways a launch ends badly (a component killed
mid-run, Ctrl-C, a bad flag), each of which must leave no process behind."""

from __future__ import annotations

import json
import os
import signal

ROLLOUT = ["--", "rollout", "--backend", "hf", "--no_cpu_bind"]


def daemons(task) -> list[str]:
    return [*ROLLOUT, "--", "rewards", "--functions", str(task.reward), "--workers.num_workers", "1"]


def test_local_grpo_run_with_rollout_and_reward_daemons(tiny, task, helpers, tmp_path):
    run = tmp_path / "run"
    proc = helpers.launch(["--run_dir", str(run), *daemons(task), "--", "ppo",
                           *helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf")])
    trainer = helpers.wait_for(lambda: helpers.run_json(run).get("components", {}).get("trainer"), 300, proc,
                               "the trainer to start")
    seen = helpers.descendants(proc.pid)  # daemons, their engine / reward workers, the trainer
    out = helpers.finish(proc, 300)
    assert proc.returncode == 0, out[-6000:]
    assert not helpers.survivors(seen)

    record = helpers.run_json(run)
    assert record["exit_code"] == 0 and record["failed"] is None
    comps = record["components"]
    assert {n: c["exit_code"] for n, c in comps.items()} == {"rollout": 0, "rewards": 0, "trainer": 0}
    addresses = record["addresses"]
    cmd = trainer["cmd"]
    assert cmd[cmd.index("--vllm.endpoint") + 1] == addresses["rollout"]
    assert cmd[cmd.index("--reward.remote_url") + 1] == addresses["rewards"]
    rollout_cmd = comps["rollout"]["cmd"]
    assert rollout_cmd[rollout_cmd.index("--model") + 1] == str(tiny)  # derived from --actor.model_name_or_path
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    for name in ("rollout", "rewards", "trainer"):
        assert (run / f"{name}.log").stat().st_size > 0, name
    assert "serving" in (run / "rollout.log").read_text()
    assert (run / "launch.yaml").is_file()


def test_a_component_killed_mid_run_stops_everything(tiny, task, helpers, tmp_path):
    run = tmp_path / "run"
    flags = helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf", "--data.max_samples", "32",
                              "--train.num_episodes", "8")  # far more steps than the test waits for
    proc = helpers.launch(["--run_dir", str(run), "--stop_timeout_s", "10", *daemons(task), "--", "ppo", *flags])
    record = helpers.wait_for(lambda: (r := helpers.run_json(run)) and "trainer" in r["components"] and r, 300, proc,
                              "the trainer to start")
    rollout_pid = record["components"]["rollout"]["pid"]
    helpers.wait_for(lambda: helpers.descendants(rollout_pid), 30, proc, "the rollout engine process")
    seen = helpers.descendants(proc.pid)
    os.kill(rollout_pid, signal.SIGKILL)  # its engine worker (own session) is orphaned by this
    out = helpers.finish(proc, 120)

    assert proc.returncode == 11, out[-6000:]  # 11: the rollout daemon failed
    assert "rollout failed (killed by SIGKILL)" in out
    assert not helpers.survivors(seen)
    record = helpers.run_json(run)
    assert record["failed"] == "rollout" and record["exit_code"] == 11
    assert record["components"]["rollout"]["exit_code"] == -signal.SIGKILL
    assert all(c["state"] == "exited" for c in record["components"].values())
    for name in ("rollout", "rewards", "trainer"):
        assert (run / f"{name}.log").is_file(), name


def test_ctrl_c_stops_the_daemons_cleanly(tiny, task, helpers, tmp_path):
    run = tmp_path / "run"
    proc = helpers.launch(["--run_dir", str(run), *ROLLOUT, "--model", str(tiny), "--", "rewards", "--functions",
                           str(task.reward), "--workers.num_workers", "1"])
    def ready() -> bool:
        comps = helpers.run_json(run).get("components", {})
        return len(comps) == 2 and all(c.get("state") == "ready" for c in comps.values())

    helpers.wait_for(ready, 300, proc, "both daemons to be ready")
    seen = helpers.descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    out = helpers.finish(proc, 120)

    assert proc.returncode == 130, out[-6000:]
    assert not helpers.survivors(seen)
    record = helpers.run_json(run)
    assert record["reason"] == "interrupted"
    # SIGTERM reached each daemon, which shut down on its own (status 0), nothing had to be killed.
    assert {n: c["exit_code"] for n, c in record["components"].items()} == {"rollout": 0, "rewards": 0}


def test_an_invalid_section_flag_fails_before_anything_starts(tiny, helpers, tmp_path):
    proc = helpers.launch(["--run_dir", str(tmp_path / "run"), "--", "rollout", "--model", str(tiny), "--engines", "0"])
    out = helpers.finish(proc, 120)
    assert proc.returncode == 2
    assert "`-- rollout`: --engines must be >= 1" in out
    assert not (tmp_path / "run").exists()


def test_a_launcher_killed_hard_still_stops_its_daemons(task, helpers, tmp_path):
    run = tmp_path / "run"
    proc = helpers.launch(["--run_dir", str(run), "--", "rewards", "--functions", str(task.reward),
                           "--workers.num_workers", "1"])
    helpers.wait_for(lambda: helpers.run_json(run).get("components", {}).get("rewards", {}).get("state") == "ready",
                     120, proc, "the reward daemon to be ready")
    seen = helpers.wait_for(lambda: len(d := helpers.descendants(proc.pid)) >= 2 and d, 30, proc,
                            "the daemon and its worker")
    proc.kill()  # no teardown: the components learn of it through their parent-death signal
    proc.communicate()
    helpers.wait_for(lambda: not helpers.survivors(seen), 60, what="the daemon and its worker to stop")


def test_a_reward_model_given_devices_of_its_own_is_served_by_a_reward_daemon(tiny, task, helpers, tmp_path):
    """``--reward.num_gpus_per_node 3`` beside an actor of 2 ranks, no colocation flag: the reward
    model runs apart (OpenRLHF's meaning), in a reward daemon the launcher starts with ``--rm.path``
    and a copy per device (``--rm.replicas 3``: CPU copies here); the trainer scores through it and
    trains both steps."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    rm_dir = tmp_path / "rm"  # the tiny model with a seeded value head: a reward model
    AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(rm_dir)
    run = tmp_path / "run"
    flags = helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf", "--reward.model_name_or_path", str(rm_dir),
                              "--reward.num_gpus_per_node", "3")
    values = {"--actor.num_gpus_per_node": "2", "--train.micro_batch_size": "4", "--rollout.micro_batch_size": "4"}
    flags = [values.get(flags[i - 1], f) if i else f for i, f in enumerate(flags)]
    proc = helpers.launch(["--run_dir", str(run), "--trainer.ranks", "2", *ROLLOUT, "--", "ppo", *flags])
    out = helpers.finish(proc, 400)
    assert proc.returncode == 0, out[-6000:]
    comps = helpers.run_json(run)["components"]
    assert {n: c["exit_code"] for n, c in comps.items()} == {"rollout": 0, "rewards": 0, "trainer": 0}
    rewards, trainer = comps["rewards"]["cmd"], comps["trainer"]["cmd"]
    assert rewards[rewards.index("--rm.path") + 1] == str(rm_dir) and rewards[rewards.index("--rm.replicas") + 1] == "3"
    assert "--reward.remote_url" in trainer and "--reward.model_name_or_path" not in trainer
    assert "--reward.num_gpus_per_node" not in trainer
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_failed"] == 0 for r in rows)


def test_a_reference_given_devices_of_its_own_is_served_by_a_reference_daemon(tiny, task, helpers, tmp_path):
    """``--ref.num_gpus_per_node 1`` beside an actor of 2 ranks, with a KL term and no colocation
    flag: the reference runs apart (OpenRLHF's meaning), in a hf rollout daemon of the actor's
    starting weights that the launcher starts; the trainer's ranks score the KL through it
    (``--ref.remote_url``): first-step KL ~0 (the policy is the reference), both steps trained."""
    run = tmp_path / "run"
    flags = helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf", "--reward.remote_url", str(task.reward),
                              "--ref.num_gpus_per_node", "1")
    values = {"--actor.num_gpus_per_node": "2", "--train.micro_batch_size": "4", "--rollout.micro_batch_size": "4",
              "--algo.kl.init_coef": "0.01"}
    flags = [values.get(flags[i - 1], f) if i else f for i, f in enumerate(flags)]
    proc = helpers.launch(["--run_dir", str(run), "--trainer.ranks", "2", *ROLLOUT, "--", "ppo", *flags])
    out = helpers.finish(proc, 400)
    assert proc.returncode == 0, out[-6000:]
    comps = helpers.run_json(run)["components"]
    assert {n: c["exit_code"] for n, c in comps.items()} == {"rollout": 0, "reference": 0, "trainer": 0}
    reference, trainer = comps["reference"]["cmd"], comps["trainer"]["cmd"]
    assert [reference[reference.index(f) + 1] for f in ("--backend", "--model", "--engines")] == ["hf", str(tiny), "1"]
    assert trainer[trainer.index("--ref.remote_url") + 1] == helpers.run_json(run)["addresses"]["reference"]
    assert "--ref.num_gpus_per_node" not in trainer
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and abs(rows[0]["kl"]) < 1e-6, rows


def test_a_critic_given_devices_of_its_own_trains_in_a_critic_server(tiny, task, helpers, tmp_path):
    """``--critic.num_gpus_per_node 2`` beside an actor of 1 rank (gae): the critic trains apart
    (OpenRLHF's meaning), in a critic server of 2 ranks under torchrun that the launcher starts; the
    trainer values and trains it through ``--critic.remote_url``, and keeps the counts (it checks
    the server's world against them)."""
    run = tmp_path / "run"
    flags = helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf", "--reward.remote_url", str(task.reward),
                              "--critic.num_gpus_per_node", "2")
    values = {"--algo.advantage.estimator": "gae", "--train.micro_batch_size": "4"}
    flags = [values.get(flags[i - 1], f) if i else f for i, f in enumerate(flags)]
    proc = helpers.launch(["--run_dir", str(run), *ROLLOUT, "--", "ppo", *flags])
    out = helpers.finish(proc, 400)
    assert proc.returncode == 0, out[-6000:]
    comps = helpers.run_json(run)["components"]
    assert {n: c["exit_code"] for n, c in comps.items()} == {"rollout": 0, "critic": 0, "trainer": 0}
    critic, trainer = comps["critic"]["cmd"], comps["trainer"]["cmd"]
    assert critic[1:4] == ["-m", "treadle.trainer.cli", "critic"] and critic[critic.index("--ranks") + 1] == "2"
    assert trainer[trainer.index("--critic.remote_url") + 1] == helpers.run_json(run)["addresses"]["critic"]
    assert trainer[trainer.index("--critic.num_gpus_per_node") + 1] == "2"
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["critic/loss"] > 0 for r in rows), rows
