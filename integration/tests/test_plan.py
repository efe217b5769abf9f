"""The launcher's command line and plan, without starting anything: sections, derived flags,
wiring, conflicts, placement bundles."""

from __future__ import annotations

import sys

import pytest

from treadle.common.config import ConfigError
from treadle.integration.config import parse_launch, split_sections
from treadle.integration.plan import (
    Addresses,
    bind,
    bundles_of,
    flag_value,
    make_plan,
    merge,
    trainer_argv,
)

PPO = ["--actor.model_name_or_path", "M", "--data.prompt_dataset", "p.jsonl", "--algo.advantage.estimator",
       "group_norm", "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2", "--train.batch_size", "8",
       "--rollout.max_new_tokens", "8", "--data.prompt_max_len", "32", "--actor.num_gpus_per_node", "1",
       "--vllm.num_engines", "2", "--ds.param_dtype", "bf16"]
RULE = ["--reward.remote_url", "math"]  # a reward source when no reward daemon is launched


def plan_of(*argv: str):
    return make_plan(parse_launch(list(argv)))


def test_sections_split_at_component_names_and_keep_flags_verbatim():
    own, sections = split_sections(["--backend", "ray", "--", "rollout", "--backend", "hf", "--no-cpu-bind",
                                    "--", "ppo", "--a.b=1", "x"])
    assert own == ["--backend", "ray"]
    assert sections == {"rollout": ["--backend", "hf", "--no-cpu-bind"], "ppo": ["--a.b=1", "x"]}


@pytest.mark.parametrize("argv, message", [
    (["--", "vllm"], "a section must name one of"),
    (["--", "rollout", "--", "rollout"], "given twice"),
    (["--", "ppo", "--", "sft"], "one trainer per launch"),
])
def test_bad_sections_are_named(argv, message):
    with pytest.raises(ConfigError, match=message):
        split_sections(argv)


def test_launch_config_from_flags_and_sections():
    cfg = parse_launch(["--backend", "ray", "--trainer.ranks", "2", "--run_dir", "r", "--", "rewards",
                        "--functions", "math", "--", "ppo", *PPO])
    assert cfg.backend == "ray" and cfg.run_dir == "r" and cfg.trainer.ranks == 2
    assert cfg.trainer.command == "ppo" and cfg.trainer.args == tuple(PPO)
    assert cfg.rewards.args == ("--functions", "math") and cfg.rollout.args is None
    assert cfg.daemons == ("rewards",)


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to launch"),
    (["--rollout.num_gpus", "2", "--", "rollout", "--model", "M"], "reserve Ray GPUs"),
    (["--", "agents", "--model", "M"], "generates with a rollout daemon"),
    (["--trainer.ranks", "0", "--", "ppo"], "--trainer.ranks must be >= 1"),
])
def test_invalid_launches_fail_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_launch(argv)


def test_merge_keeps_user_flags_and_drops_derived_twins():
    derived = ["--model", "M", "--engines", "2", "--engine.enable_prefix_caching", "--engine.seed", "3"]
    user = ["--engines=4", "--engine.no-enable-prefix-caching"]
    assert merge(derived, user) == ["--model", "M", "--engine.seed", "3", "--engines=4",
                                    "--engine.no-enable-prefix-caching"]
    assert flag_value(["--a", "1", "--b=2", "--a", "3"], "--a") == "3"
    assert flag_value(["--a", "1", "--b=2"], "--b") == "2"


def test_rollout_flags_are_derived_from_the_ppo_flags():
    plan = plan_of("--", "rollout", "--backend", "hf", "--", "ppo", *PPO, *RULE)
    d = plan.daemon("rollout")
    args = list(d.args)
    assert args[0] == "serve" and d.port_flags == ("--endpoint",)
    assert flag_value(args[1:], "--model") == "M" and flag_value(args[1:], "--engines") == "2"
    assert flag_value(args[1:], "--engine.dtype") == "bfloat16"
    assert flag_value(args[1:], "--engine.max_model_len") == "40"  # prompt 32 + 8 new tokens
    assert flag_value(args[1:], "--backend") == "hf"  # the user's, not the derived "vllm"
    assert args.count("--backend") == 1


def _without(args: list[str], flag: str) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def test_trainer_gets_the_daemons_addresses_and_torchrun_for_ranks():
    ppo = _without(PPO, "--actor.num_gpus_per_node")
    plan = plan_of("--trainer.ranks", "2", "--", "rollout", "--", "rewards", "--functions", "math", "--", "ppo", *ppo)
    addresses = Addresses(rollout="tcp://127.0.0.1:7001", rewards="tcp://127.0.0.1:7002")
    argv = trainer_argv(plan.cfg, addresses, python="py")
    assert argv[:6] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"]
    assert argv[6:8] == ["treadle.trainer.cli", "ppo"]
    # the trainer's own rank count (default 8, ranks it would start itself) follows --trainer.ranks
    assert flag_value(argv[8:], "--actor.num_gpus_per_node") == "2"
    assert plan.trainer_cfg.actor.num_gpus_per_node == 2
    assert flag_value(argv[8:], "--vllm.endpoint") == "tcp://127.0.0.1:7001"
    assert flag_value(argv[8:], "--reward.remote_url") == "tcp://127.0.0.1:7002"
    assert plan.trainer_cfg.reward.remote_url.startswith("tcp://")  # checked with the wiring in place


def test_one_launched_rank_pins_the_trainers_rank_count_and_a_different_one_is_refused():
    plan = plan_of("--", "ppo", *_without(PPO, "--actor.num_gpus_per_node"), *RULE)
    assert flag_value(trainer_argv(plan.cfg, Addresses(), python="py")[4:], "--actor.num_gpus_per_node") == "1"
    with pytest.raises(ConfigError, match=r"--actor.num_gpus_per_node 1 but --trainer.ranks 2"):
        plan_of("--trainer.ranks", "2", "--", "ppo", *PPO, *RULE)


@pytest.mark.parametrize("section, flag", [("rollout", "--vllm.endpoint"), ("rewards", "--reward.remote_url")])
def test_a_trainer_flag_the_launcher_provides_is_a_conflict(section, flag):
    extra = ["--functions", "math"] if section == "rewards" else []
    reward = [] if section == "rewards" else RULE
    with pytest.raises(ConfigError, match=f"the launched {section} daemon provides it"):
        plan_of("--", section, *extra, "--", "ppo", *PPO, *reward, flag, "tcp://127.0.0.1:9")


def test_section_flags_are_checked_by_the_component_config():
    with pytest.raises(ConfigError, match="-- rollout.*--engines must be >= 1"):
        plan_of("--", "rollout", "--engines", "0", "--", "ppo", *PPO, *RULE)
    with pytest.raises(ConfigError, match="-- rewards.*nothing to serve"):
        plan_of("--", "rewards", "--", "ppo", *PPO)
    with pytest.raises(ConfigError, match="-- ppo.*--actor.model_name_or_path"):
        plan_of("--", "rollout", "--", "ppo", "--data.prompt_dataset", "p.jsonl")


def test_bind_fills_ports_and_wires_the_gateway_to_the_rollout_daemon():
    plan = plan_of("--", "rollout", "--model", "M", "--", "rewards", "--functions", "math", "--", "agents",
                   "--model", "M")
    roll, rew, agents = plan.daemons
    argv, a1 = bind(roll, "127.0.0.1", [7001], Addresses())
    assert argv[-2:] == ["--endpoint", "tcp://127.0.0.1:7001"] and a1.rollout == "tcp://127.0.0.1:7001"
    argv, a2 = bind(rew, "127.0.0.1", [7002, 7003], a1)
    assert flag_value(argv[1:], "--zmq.endpoint") == "tcp://127.0.0.1:7002"
    assert a2.rewards_http == "http://127.0.0.1:7003"
    argv, a3 = bind(agents, "127.0.0.1", [7004], a1)
    assert flag_value(argv[1:], "--rollout") == "tcp://127.0.0.1:7001" and a3.agents == "http://127.0.0.1:7004"


def test_a_fixed_address_in_a_section_is_used_as_given():
    plan = plan_of("--", "rollout", "--model", "M", "--endpoint", "tcp://127.0.0.1:6000")
    d = plan.daemon("rollout")
    assert d.ports_needed == 0
    argv, a = bind(d, "127.0.0.1", [], Addresses())
    assert a.rollout == "tcp://127.0.0.1:6000" and argv.count("--endpoint") == 1
    with pytest.raises(ConfigError, match="port 0"):
        plan_of("--", "rollout", "--model", "M", "--endpoint", "tcp://127.0.0.1:0")


def test_bundles_colocate_the_rollout_daemon_with_the_trainer():
    apart = plan_of("--backend", "ray", "--trainer.ranks", "2", "--trainer.num_gpus_per_rank", "1",
                    "--rollout.num_gpus", "2", "--", "rollout", "--", "ppo", *_without(PPO, "--actor.num_gpus_per_node"),
                    *RULE)
    bundles, index, need = bundles_of(apart)
    assert bundles == [{"CPU": 2.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 2.0}]
    assert index == {"trainer": 0, "rollout": 1}
    together = plan_of("--backend", "ray", "--trainer.ranks", "2", "--trainer.num_gpus_per_rank", "1",
                       "--rollout.num_gpus", "2", "--", "rollout", "--", "ppo", *PPO, *RULE,
                       "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--train.colocate_all")
    bundles, index, need = bundles_of(together)
    assert together.colocate and bundles == [{"CPU": 3.0, "GPU": 2.0}]
    assert index == {"trainer": 0, "rollout": 0} and need["rollout"] == {"CPU": 1.0, "GPU": 0.0}


def test_rollout_gpus_must_match_its_engines():
    with pytest.raises(ConfigError, match="2 engines x 1 GPUs"):
        plan_of("--backend", "ray", "--rollout.num_gpus", "3", "--", "rollout", "--", "ppo", *PPO, *RULE)


def test_help_lists_the_launch_flags(capsys):
    with pytest.raises(SystemExit) as e:
        parse_launch(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--backend", "--run_dir", "--trainer.ranks", "--rollout.num_gpus", "--ray.address"):
        assert flag in out


def test_the_launcher_runs_no_torch_before_the_trainer_starts():
    import subprocess

    code = ("import sys; from treadle.integration.config import parse_launch; from treadle.integration.plan import "
            f"make_plan; make_plan(parse_launch({['--', 'rollout', '--', 'ppo', *PPO, *RULE]!r})); "
            "print('torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_the_resolved_launch_round_trips_through_yaml(tmp_path):
    from treadle.common.config import dump_yaml

    cfg = parse_launch(["--backend", "ray", "--trainer.ranks", "2", "--", "rollout", "--backend", "hf", "--",
                        "ppo", *PPO, *RULE])
    dump_yaml(cfg, tmp_path / "launch.yaml")
    assert parse_launch(["--config", str(tmp_path / "launch.yaml")]) == cfg
