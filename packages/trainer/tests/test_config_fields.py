"""Every field of the training commands' typed config is read somewhere: no flag is accepted and
then ignored. And the flags that do nothing in treadle are refused at parse time, naming themselves.

The walk visits each field of each command's config tree (``COMMANDS``, nested groups
included) and looks for its name as an attribute access (``x.name``, or ``getattr(x, "name")``
with a literal name) in the Python sources of ``packages/*/src`` and ``integration/``, outside
``treadle/trainer/config/`` (validation reading a field is not a use of it). Accesses are found
with ``ast``, so a name in a comment, a docstring or a string does not count. A property of a
config class read outside config/ (``cfg.actor.clip_low_high``) counts as reading the fields
its body reads (``self.eps_clip``, ``self.eps_clip_low_high``).

The check is by name: a field passes when any attribute of that name is read, so it cannot
tell ``--ref.offload`` from ``--reward.offload``; fields shadowed that way have tests of their
own effect (``test_flag_effects.py``). A field that is refused by validation whenever it is set,
or honoured by construction, goes on ``ALLOWED`` with the reason; refused ones also appear in
``REFUSED`` below, which checks that they are.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from treadle.common.config import ConfigError
from treadle.trainer.config import COMMANDS, parse_command

ROOT = Path(__file__).resolve().parents[3]
CONFIG_DIR = ROOT / "packages" / "trainer" / "src" / "treadle" / "trainer" / "config"

ALLOWED: dict[str, str] = {
    # refused by validation whenever set (REFUSED below checks each):
    "MuonConfig.nesterov": "refused when changed (config/optim.py): DeepSpeed's Muon always uses Nesterov momentum",
    "MuonConfig.ns_steps": "refused when changed (config/optim.py): DeepSpeed's Muon always runs 5 Newton-Schulz steps",
    "VLLMConfig.sync_with_ray": "refused (config/rollout.py): weights never go through Ray's object store",
    # honoured by construction (nothing to read: every run does what they ask):
    "RLTrainConfig.colocate_actor_ref": "the reference runs in the trainer's ranks beside the actor (or in a "
                                        "daemon the user serves, --ref.remote_url); commands._check_placements "
                                        "refuses a placement of its own",
    "RLTrainConfig.colocate_critic_reward": "the critic and the reward model run in the trainer's ranks (unless "
                                            "served apart: --critic.remote_url refuses the switch); "
                                            "commands._check_placements refuses placements of their own",
    "RMModelConfig.compute_fp32_loss_enable": "losses.rm computes the pairwise loss in fp32 always",
    # OpenRLHF's spellings of another field (read in config/ when set):
    "AdvantageConfig.is_correction_enable": "OpenRLHF's switch: sets is_correction_level / mode (config/algo.py)",
    "AdvantageConfig.is_correction_type": "OpenRLHF's scheme: sets is_correction_level / mode (config/algo.py)",
}
"""``Class.field`` (the class that declares it) -> why it may go unread outside config/."""

REFUSED: list[tuple[str, list[str], str]] = [
    ("sft", ["--optim", "muon", "--muon.ns_steps", "3"], r"--muon\.ns_steps 3: DeepSpeed's Muon always runs 5"),
    ("ppo", ["--actor.optim", "muon", "--actor.max_norm", "0", "--actor.muon.no_nesterov"],
     r"--actor\.muon\.nesterov False: DeepSpeed's Muon always uses Nesterov momentum"),
    ("ppo", ["--vllm.sync_with_ray"], r"--vllm\.sync_with_ray: sending weights through Ray's object store is not "
                                      r"implemented"),
]
"""(command, flags, message) of each flag refused whenever it is set."""

BASE = {  # the smallest valid command line of each command
    "sft": ["--actor.model_name_or_path", "m", "--data.dataset", "d"],
    "kd": ["--actor.model_name_or_path", "m", "--data.dataset", "d", "--data.output_key", "a",
           "--teacher.model_name_or_path", "t"],
    "rm": ["--actor.model_name_or_path", "m", "--data.dataset", "d"],
    "prm": ["--actor.model_name_or_path", "m", "--data.dataset", "d"],
    "dpo": ["--actor.model_name_or_path", "m", "--data.dataset", "d"],
    "kto": ["--actor.model_name_or_path", "m", "--data.dataset", "d"],
    "ppo": ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "r.py",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--actor.num_gpus_per_node", "1", "--rollout.batch_size", "8", "--train.batch_size", "8"],
    "critic": [],
}


def _strip(tp: typing.Any) -> typing.Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _owner(cls: type, name: str) -> str:
    """The class of ``cls``'s MRO that declares field ``name``."""
    return next(k.__name__ for k in cls.__mro__ if name in getattr(k, "__annotations__", {}))


def _config_fields(cls: type, prefix: str = "--") -> Iterator[tuple[str, str, str]]:
    """(flag, ``Owner.field``, field name) of every field under ``cls``, nested groups included."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        tp = _strip(hints[f.name])
        yield f"{prefix}{f.name}", f"{_owner(cls, f.name)}.{f.name}", f.name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from _config_fields(tp, f"{prefix}{f.name}.")


def _config_classes(cls: type) -> Iterator[type]:
    hints = typing.get_type_hints(cls, include_extras=True)
    yield cls
    for f in dataclasses.fields(cls):
        tp = _strip(hints[f.name])
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from _config_classes(tp)


def _sources() -> Iterator[Path]:
    for base in [*sorted((ROOT / "packages").glob("*/src")), ROOT / "integration"]:
        for path in sorted(base.rglob("*.py")):
            if CONFIG_DIR not in path.parents:
                yield path


def _names(tree: ast.AST) -> set[str]:
    """Attribute names read in ``tree``: ``x.name`` and ``getattr(x, "name"[, default])``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return names


def _read_names(path: Path) -> set[str]:
    return _names(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))


def _properties() -> dict[str, set[str]]:
    """Property name of any config class -> the attribute names its body reads."""
    out: dict[str, set[str]] = {}
    for cls, _ in COMMANDS.values():
        for klass in _config_classes(cls):
            for k in klass.__mro__:
                for name, value in vars(k).items():
                    if isinstance(value, property) and value.fget is not None:
                        body = ast.parse(textwrap.dedent(inspect.getsource(value.fget)))
                        out.setdefault(name, set()).update(_names(body))
    return out


def _read_outside_config() -> set[str]:
    read: set[str] = set()
    for path in _sources():
        read |= _read_names(path)
    props = _properties()
    pending = [p for p in props if p in read]
    while pending:  # a property read outside reads what its body reads, properties included
        for name in props.pop(pending.pop(), set()) - read:
            read.add(name)
            if name in props:
                pending.append(name)
    return read


def _dead_fields() -> dict[str, list[str]]:
    """``Owner.field`` -> the flags (over every command) whose name no source outside config/ reads."""
    read = _read_outside_config()
    dead: dict[str, list[str]] = {}
    for command, (cls, _) in COMMANDS.items():
        for flag, key, name in _config_fields(cls):
            if name not in read and key not in ALLOWED:
                dead.setdefault(key, []).append(f"{command} {flag}")
    return dead


# ---------------------------------------------------------------------------------------------
# The walk


def test_the_walk_sees_nested_groups_and_sources() -> None:
    fields = {flag: key for flag, key, _ in _config_fields(COMMANDS["ppo"][0])}
    assert fields["--actor.adam.lr"] == "AdamConfig.lr" and fields["--actor.optim"] == "OptimizerConfig.optim"
    assert {"--algo.kl.init_coef", "--ds.lora.rank", "--logger.wandb.project", "--critic.muon.ns_steps"} <= set(fields)
    files = list(_sources())
    assert any(p.name == "ppo_build.py" for p in files)
    assert not any(CONFIG_DIR in p.parents for p in files)
    assert any(p.is_relative_to(ROOT / "integration") for p in files)


def test_names_come_from_code_not_comments(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text('"""cfg.in_docstring"""\n# cfg.in_comment\nx = cfg.train.read_one\ny = getattr(cfg, "by_name")\n'
                   'z = getattr(cfg, name)\ns = "cfg.in_string"\n')
    assert _read_names(src) == {"train", "read_one", "by_name"}


def test_a_property_read_outside_reads_its_fields() -> None:
    props = _properties()
    assert {"eps_clip", "eps_clip_low_high"} <= props["clip_low_high"]
    assert "is_correction_threshold" in props["is_band"]


def test_allow_list_names_real_fields_and_refused_ones_are_refused() -> None:
    every = {key for cls, _ in COMMANDS.values() for _, key, _ in _config_fields(cls)}
    assert set(ALLOWED) <= every, f"ALLOWED names no config field: {sorted(set(ALLOWED) - every)}"
    refused = {key for key, why in ALLOWED.items() if why.startswith("refused")}
    flags = {flag.split(".")[-1].removeprefix("--").removeprefix("no_") for _, extra, _ in REFUSED
             for flag in extra if flag.startswith("--")}
    assert {key.split(".")[1] for key in refused} <= flags, "a refused field has no REFUSED case"


def test_every_config_field_is_read_outside_config() -> None:
    dead = _dead_fields()
    listing = "\n".join(f"  {key}: {', '.join(flags)}" for key, flags in sorted(dead.items()))
    assert not dead, ("config fields read nowhere outside treadle/trainer/config/ (implement them, refuse them in "
                      f"validation, or allow-list them in this test with the reason):\n{listing}")


# ---------------------------------------------------------------------------------------------
# Refused at parse time, naming the flag; their defaults parse


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_defaults_of_refused_flags_parse(command: str) -> None:
    parse_command(command, BASE[command])


@pytest.mark.parametrize(("command", "extra", "message"), REFUSED)
def test_dead_flags_are_refused(command: str, extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_command(command, [*BASE[command], *extra])


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "critic"])  # critic: a server, no model flags
@pytest.mark.parametrize(("flag", "message"), [
    ("--data.image_key", "vision-language models are not supported"),
    ("--data.max_images_per_prompt", "vision-language models are not supported"),
    ("--actor.freeze_visual_encoder", "vision-language models are not supported"),
    ("--use_ms", "ModelScope is not supported"),
])
def test_vision_and_modelscope_flags_are_refused_by_name(command: str, flag: str, message: str) -> None:
    # tyro alone said "Unrecognized options"; any spelling tyro accepts is caught
    for spelled in ([flag, "2"], [f"{flag}=2"], [flag.replace("_", "-")]):
        with pytest.raises(ConfigError, match=f"^{spelled[0].split('=')[0]}: {message}"):
            parse_command(command, [*BASE[command], *spelled])


PPO = BASE["ppo"]


@pytest.mark.parametrize(("extra", "message"), [
    # were refused in trainers/ppo_build.py after the process group started, some after models loaded
    (["--ds.enable_sleep", "--train.colocate_all", "--vllm.num_engines", "1"],
     r"--ds\.enable_sleep offloads ZeRO-3 states .* needs --ds\.zero_stage 3, got 2"),
    (["--train.batch_size", "12"], r"= 32 samples per rollout must be a multiple of --train\.batch_size 12"),
    (["--reward.remote_url", "a.py,http://h/get_reward", "--reward.remote_reduce", "spread"],
     r"--reward\.remote_reduce spread deals samples across replicas .* 'a\.py' is a function file"),
    (["--reward.remote_reduce", "mean"], r"--reward\.remote_reduce mean combines several --reward\.remote_url "
                                         r"sources; 1 given"),
    (["--reward.remote_url", "None", "--reward.model_name_or_path", "rm1,rm2"],
     r"--reward\.model_name_or_path lists 2 models; this trainer scores with one .* list them in --reward\.remote_url"),
    (["--vllm.sync_backend", "cuda_ipc", "--vllm.num_engines", "2"], r"cuda_ipc .* puts its 2 engine GPUs"),
    # placements of their own were silently the trainer's ranks
    (["--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "4"],
     r"--ref\.num_gpus_per_node 4: the reference runs in the trainer's ranks beside the actor"),
    (["--reward.num_nodes", "2"], r"--reward\.num_nodes 2: the reward model runs in the trainer's ranks"),
    # a reference served by a daemon of its own: what the ranks would not read
    (["--algo.kl.init_coef", "0", "--ref.remote_url", "tcp://127.0.0.1:5571"], r"--ref\.remote_url tcp://127\.0\.0\.1:5571: no reference is used"),
    (["--algo.kl.init_coef", "0.01", "--ref.remote_url", "tcp://127.0.0.1:5571", "--ref.offload"],
     r"--ref\.offload with --ref\.remote_url .* serves its own model"),
    (["--algo.kl.init_coef", "0.01", "--ref.remote_url", "tcp://10.0.0.7:5571"], r"give the client keys with --ref\.curve_dir"),
    (["--algo.kl.init_coef", "0.01", "--ref.remote_url", "http://h:1"], r"a rollout daemon's ZeroMQ address"),
    (["--ref.curve_dir", "k"], r"--ref\.curve_dir are keys for --ref\.remote_url, which is not set"),
    (["--critic.num_gpus_per_node", "8"], r"--critic\.num_gpus_per_node 8: the critic runs in the trainer's ranks"
                                          r".*give --critic\.remote_url"),
    # a critic trained apart by a critic server: only where there is a critic, not on the trainer's GPUs
    (["--critic.remote_url", "tcp://127.0.0.1:5590"], r"--critic\.remote_url tcp://127\.0\.0\.1:5590: no critic is used "
                                                      r"\(--algo\.advantage\.estimator group_norm"),
    (["--algo.advantage.estimator", "gae", "--rollout.n_samples_per_prompt", "1", "--critic.remote_url",
      "tcp://127.0.0.1:5590", "--train.colocate_all", "--vllm.num_engines", "1"],
     r"--critic\.remote_url tcp://127\.0\.0\.1:5590 with --train\.colocate_all: the critic trains apart"),
    (["--critic.remote_url", "tcp://10.0.0.7:5590"], r"give the client keys with --critic\.curve_dir"),
    (["--critic.remote_url", "http://h:1"], r"a critic server's ZeroMQ address"),
    (["--critic.curve_dir", "k"], r"--critic\.curve_dir are keys for --critic\.remote_url, which is not set"),
    # over-sampling beyond what the staleness bound lets a round be trained within
    (["--train.async_enable", "--rollout.vllm_generate_batch_size", "17"],
     r"--rollout\.vllm_generate_batch_size 17 > \(--train\.async_queue_size 1 \+ 1\) x --rollout\.batch_size 8"),
    # the critic export would fail after training
    (["--algo.advantage.estimator", "gae", "--critic.model_name_or_path", "c", "--critic.save_value_network",
      "--ds.zero_stage", "3", "--ds.lora.rank", "8"], r"--critic\.save_value_network: exporting a value model with LoRA"),
])
def test_combinations_are_refused_at_parse_time(extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_command("ppo", [*PPO, *extra])


def test_placements_equal_to_the_actors_and_colocation_switches_parse() -> None:
    cfg = parse_command("ppo", [*PPO, "--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "1",
                                "--ref.num_nodes", "1", "--reward.num_gpus_per_node", "1",
                                "--train.colocate_actor_ref", "--vllm.sync_backend", "nccl"])
    assert cfg.ref.num_gpus_per_node == 1 and cfg.critic.num_gpus_per_node is None
    assert cfg.train.colocate_actor_ref and cfg.vllm.sync_backend == "nccl"
    over = parse_command("ppo", [*PPO, "--train.async_enable", "--rollout.vllm_generate_batch_size", "16"])
    assert over.rollout.generate_batch_size == 16
    gae = parse_command("ppo", [*PPO, "--algo.advantage.estimator", "gae", "--critic.model_name_or_path", "c",
                                "--critic.save_value_network", "--ckpt.output_dir", "out/final/"])
    assert gae.critic_output_dir == "out/final_critic"


def test_colocate_all_with_async_runs_with_the_engines_on_gpus_of_their_own() -> None:
    # OpenRLHF's train_ppo_ray: a warning ("only colocates DeepSpeed models"), the engines outside
    # the shared placement group, and no engines-equal-actor-GPUs assertion; treadle did refuse
    from treadle.trainer.trainers.ppo_build import sync_route

    cfg = parse_command("ppo", [*PPO, "--train.colocate_all", "--train.async_enable", "--vllm.num_engines", "2"])
    assert cfg.train.colocate_all and cfg.train.async_enable and not cfg.engines_colocated
    assert sync_route(cfg, cuda=True) == ("collective", "nccl")  # engines apart: NCCL holds them
    parse_command("ppo", [*PPO, "--train.colocate_all", "--train.async_enable", "--vllm.sync_backend", "nccl"])
    assert parse_command("ppo", [*PPO, "--train.colocate_all", "--vllm.num_engines", "1"]).engines_colocated
    with pytest.raises(ConfigError, match=r"--vllm\.num_engines x --vllm\.tensor_parallel_size \(2\) must equal"):
        parse_command("ppo", [*PPO, "--train.colocate_all", "--vllm.num_engines", "2"])
    with pytest.raises(ConfigError, match=r"--train\.async_enable generates while training: engines cannot sleep"):
        parse_command("ppo", [*PPO, "--train.colocate_all", "--train.async_enable", "--vllm.enable_sleep"])


def test_reward_source_lists_parse_with_their_reduction() -> None:
    cfg = parse_command("ppo", [*PPO, "--reward.remote_url", "a.py, http://h:1/get_reward,tcp://127.0.0.1:5555"])
    assert cfg.reward.remote_urls == ("a.py", "http://h:1/get_reward", "tcp://127.0.0.1:5555")
    assert cfg.reward.remote_reduce == "sum"  # OpenRLHF's reward_fn
    mean = parse_command("ppo", [*PPO, "--reward.remote_url", "a.py,b.py", "--reward.remote_reduce", "mean"])
    assert mean.reward.remote_reduce == "mean"
    spread = parse_command("ppo", [*PPO, "--reward.remote_url", "http://a/get_reward,http://b/get_reward",
                                   "--reward.remote_reduce", "spread"])
    assert spread.reward.remote_reduce == "spread"
