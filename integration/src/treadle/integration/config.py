"""Typed configuration of ``treadle-launch`` and the split of its command line into sections.

The command line has the launcher's own flags, then one section per component, each opened by
``--`` and the component's name and holding that component's own flags, untouched::

    treadle-launch --backend local --run_dir runs/x --trainer.ranks 2 \\
        -- rollout --backend hf --engine.dtype float32 \\
        -- rewards --functions reward.py \\
        -- ppo --actor.model_name_or_path M --data.prompt_dataset p.jsonl ...

A section starts that component: ``rollout`` (``treadle-rollout serve``), ``reference`` (a
rollout daemon scoring ppo's reference), ``critic`` (``treadle-train critic``, ppo's critic on
ranks of its own), ``rewards`` (``treadle-rewards serve``), ``agents`` (``treadle-agents serve``), and at most one trainer
section named after its ``treadle-train`` command (``ppo``, ``sft``, ``rm``, ``dpo``, ``kto``).
An empty section (``-- rollout``) starts the component with the flags the launcher derives.
In a ``--config`` YAML file the sections are lists: ``rollout: {args: [--backend, hf]}`` and
``trainer: {command: ppo, args: [...]}``.

On Ray, a trainer across nodes is ``--trainer.nodes N --trainer.ranks K`` (K per node), and
``--trainer.node_labels`` / ``--rollout.node_labels`` / ``--rewards.node_labels`` /
``--agents.node_labels`` (KEY=VALUE, matched against ``ray start --labels``) say which nodes may
host each component (``label_selector``).

Not here: what the launcher derives from the sections (``plan``) or starting anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from treadle.common.config import ConfigError, configclass, label_selector, parse, validate

Backend = Literal["local", "ray"]
TrainerCommand = Literal["ppo", "sft", "rm", "dpo", "kto"]
TRAINER_COMMANDS: tuple[str, ...] = ("ppo", "sft", "rm", "dpo", "kto")
DAEMONS: tuple[str, ...] = ("rollout", "reference", "critic", "rewards", "agents")
SECTIONS: tuple[str, ...] = DAEMONS + TRAINER_COMMANDS


def _check_resources(cpus: float, gpus: int) -> None:
    if not cpus > 0:
        raise ConfigError(f"--num_cpus must be > 0, got {cpus}")
    if gpus < 0:
        raise ConfigError(f"--num_gpus must be >= 0, got {gpus}")


def _check_ranks(part: TrainerLaunch | CriticLaunch) -> None:
    """A process group's launch: ranks and nodes >= 1, a GPU per rank at most, its labels."""
    _check_resources(part.num_cpus_per_rank, part.num_gpus_per_rank)
    label_selector(part.node_labels)
    if part.ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {part.ranks}")
    if part.nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {part.nodes}")
    if part.num_gpus_per_rank > 1:
        raise ConfigError(f"--num_gpus_per_rank must be 0 or 1 (one GPU per rank), got {part.num_gpus_per_rank}")


@configclass
class RolloutLaunch:
    """The rollout daemon (``treadle-rollout serve``)."""

    args: tuple[str, ...] | None = None
    """Its flags (the ``-- rollout ...`` section); None: no rollout daemon."""
    num_gpus: int = 0
    """ray: GPUs reserved for its engines (engines x tensor x pipeline parallel); 0: CPU engines."""
    num_cpus: float = 1.0
    """ray: CPUs reserved for it."""

    node_labels: tuple[str, ...] = ()
    """ray: KEY=VALUE labels a node must have to host it (nodes get them from `ray start --labels`);
    empty: any node."""

    def __post_init__(self) -> None:
        _check_resources(self.num_cpus, self.num_gpus)
        label_selector(self.node_labels)


@configclass
class ReferenceLaunch:
    """A rollout daemon serving ppo's reference on devices of its own (``treadle-rollout serve
    --backend hf --model REF``): it scores the sampled tokens for the trainer (``--ref.remote_url``)."""

    args: tuple[str, ...] | None = None
    """Its flags (the ``-- reference ...`` section; made by the launcher from ``--ref.num_gpus_per_node``
    unlike the actor's); None: the reference (if any) runs in the trainer's ranks."""
    num_gpus: int = 0
    """ray: GPUs reserved for its engines (one each); 0: CPU engines."""
    num_cpus: float = 1.0
    """ray: CPUs reserved for it."""
    node_labels: tuple[str, ...] = ()
    """ray: KEY=VALUE labels a node must have to host it (`ray start --labels`); empty: any node."""

    def __post_init__(self) -> None:
        _check_resources(self.num_cpus, self.num_gpus)
        label_selector(self.node_labels)


@configclass
class CriticLaunch:
    """A critic server training ppo's critic on devices of its own (``treadle-train critic``; made by
    the launcher from ``--critic.num_gpus_per_node`` / ``--critic.num_nodes`` unlike the actor's):
    ``ranks`` processes per node under torchrun, on ``nodes`` nodes (ray), one DeepSpeed world."""

    args: tuple[str, ...] | None = None
    """Its flags (the ``-- critic ...`` section: ``--endpoint``, ``--curve_dir``); None: the critic (if
    any) trains in the trainer's ranks."""
    ranks: int = 1
    """Critic processes per node (torchrun --nproc_per_node when > 1)."""
    nodes: int = 1
    """ray: nodes the critic spans, ``ranks`` on each (one torchrun per node)."""
    num_gpus_per_rank: int = 0
    """ray: GPUs per rank (0 or 1); 0: CPU ranks."""
    num_cpus_per_rank: float = 1.0
    """ray: CPUs reserved per rank."""
    node_labels: tuple[str, ...] = ()
    """ray: KEY=VALUE labels each critic node must have (`ray start --labels`); empty: any node."""

    def __post_init__(self) -> None:
        _check_ranks(self)


@configclass
class RewardsLaunch:
    """The reward daemon (``treadle-rewards serve``)."""

    args: tuple[str, ...] | None = None
    """Its flags (the ``-- rewards ...`` section); None: no reward daemon."""
    num_gpus: int = 0
    """ray: GPUs reserved for its reward model (on each node)."""
    num_cpus: float = 1.0
    """ray: CPUs reserved for it (on each node)."""
    nodes: int = 1
    """ray: replicas, one reward daemon on each of this many nodes (``rewards``, ``rewards.1``, ...);
    the trainer deals its samples over them (--reward.remote_reduce spread)."""

    node_labels: tuple[str, ...] = ()
    """ray: KEY=VALUE labels a node must have to host it (nodes get them from `ray start --labels`);
    empty: any node."""

    def __post_init__(self) -> None:
        _check_resources(self.num_cpus, self.num_gpus)
        label_selector(self.node_labels)
        if self.nodes < 1:
            raise ConfigError(f"--rewards.nodes must be >= 1, got {self.nodes}")


@configclass
class AgentsLaunch:
    """The OpenAI-compatible agent gateway (``treadle-agents serve``)."""

    args: tuple[str, ...] | None = None
    """Its flags (the ``-- agents ...`` section); None: no gateway."""
    num_cpus: float = 1.0
    """ray: CPUs reserved for it."""

    node_labels: tuple[str, ...] = ()
    """ray: KEY=VALUE labels a node must have to host it (nodes get them from `ray start --labels`);
    empty: any node."""

    def __post_init__(self) -> None:
        _check_resources(self.num_cpus, 0)
        label_selector(self.node_labels)


@configclass
class TrainerLaunch:
    """The trainer (``treadle-train COMMAND``): one process, or ``ranks`` under torchrun."""

    command: TrainerCommand | None = None
    """The treadle-train command (the section's name); None: no trainer (daemons only)."""
    args: tuple[str, ...] = ()
    """Its flags (the ``-- ppo ...`` section)."""
    ranks: int = 1
    """Trainer processes per node (torchrun --nproc_per_node when > 1)."""
    nodes: int = 1
    """ray: nodes the trainer spans, --ranks on each (torchrun --nnodes, one torchrun per node);
    with ppo it is --actor.num_nodes."""
    num_gpus_per_rank: int = 0
    """ray: GPUs per rank (0 or 1); 0: CPU ranks."""
    num_cpus_per_rank: float = 1.0
    """ray: CPUs reserved per rank."""
    node_labels: tuple[str, ...] = ()
    """ray: KEY=VALUE labels each trainer node must have (`ray start --labels`); empty: any node."""

    def __post_init__(self) -> None:
        _check_ranks(self)


@configclass
class RayLaunch:
    """Where the Ray backend runs."""

    address: str | None = None
    """ray.init address: None: Ray's own choice (RAY_ADDRESS, else a running local cluster, else a
    new one); "local": always a new local cluster; "auto" or host:port: that cluster."""
    temp_dir: str = ""
    """Temp/session folder of a new local cluster; empty: <TREADLE_CACHE_DIR or ./.cache>/ray, or
    <system temp>/treadle-ray-<uid> where that is too deep for Ray's 107-byte socket paths."""
    num_cpus: int | None = None
    """Logical CPUs of a new local cluster; None: the machine's cores (at least what the plan needs)."""
    placement_timeout_s: float = 120.0
    """How long to wait for the placement group's resources."""

    def __post_init__(self) -> None:
        if not self.placement_timeout_s > 0:
            raise ConfigError(f"--placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"--num_cpus must be >= 1 (or None), got {self.num_cpus}")


@configclass
class LaunchConfig:
    """treadle-launch: start rollout, reward, agent daemons and the trainer together (Ray or local processes).

    Components come from sections after the launcher's flags: `-- rollout FLAGS`, `-- reference FLAGS`,
    `-- critic FLAGS`, `-- rewards FLAGS`, `-- agents FLAGS`, `-- ppo FLAGS` (or sft, rm, dpo, kto), each with that command's
    own flags.
    """

    backend: Backend = "local"
    """local: subprocesses of this launcher; ray: Ray actors on a Ray cluster."""
    run_dir: str = ""
    """Folder of every component's log and run.json; empty: <TREADLE_RUN_DIR>/launch-<UTC time>."""
    rollout: RolloutLaunch = RolloutLaunch()
    reference: ReferenceLaunch = ReferenceLaunch()
    critic: CriticLaunch = CriticLaunch()
    rewards: RewardsLaunch = RewardsLaunch()
    agents: AgentsLaunch = AgentsLaunch()
    trainer: TrainerLaunch = TrainerLaunch()
    ray: RayLaunch = RayLaunch()
    start_timeout_s: float = 900.0
    """How long a daemon may take to answer its health check."""
    stop_timeout_s: float = 30.0
    """At teardown: seconds between SIGTERM and SIGKILL."""
    max_restarts: int = 0
    """Restarts from the trainer's last checkpoint (--ckpt.load_enable), up to this many: the
    trainer alone when it failed (its process or node) and the daemons run on; else everything is
    torn down and the whole run started again. Not after Ctrl-C / SIGTERM, the trainer's config
    error, or without a new checkpoint. 0: a failure ends the launch."""
    restart_backoff_s: float = 5.0
    """Seconds between an attempt's teardown and the next attempt's start (--max_restarts)."""

    def __post_init__(self) -> None:
        if not (self.start_timeout_s > 0 and self.stop_timeout_s > 0):
            raise ConfigError("--start_timeout_s and --stop_timeout_s must be > 0")
        if self.max_restarts < 0:
            raise ConfigError(f"--max_restarts must be >= 0, got {self.max_restarts}")
        if self.restart_backoff_s < 0:
            raise ConfigError(f"--restart_backoff_s must be >= 0, got {self.restart_backoff_s}")
        if self.max_restarts and self.trainer.command is None:
            raise ConfigError(f"--max_restarts {self.max_restarts} restarts a run from the trainer's checkpoint: "
                              "add a trainer section (`-- ppo ...`); daemons alone are not restarted")
        if self.trainer.command is None and not self.daemons:
            raise ConfigError("nothing to launch: add sections such as `-- rollout ...`, `-- rewards ...`, `-- ppo ...`")
        if self.trainer.command is None and self.trainer.args:
            raise ConfigError("--trainer.args without --trainer.command: name the treadle-train command")
        if self.backend == "local":
            gpus = {"--rollout.num_gpus": self.rollout.num_gpus, "--reference.num_gpus": self.reference.num_gpus,
                    "--rewards.num_gpus": self.rewards.num_gpus, "--critic.num_gpus_per_rank": self.critic.num_gpus_per_rank,
                    "--trainer.num_gpus_per_rank": self.trainer.num_gpus_per_rank}
            used = [k for k, v in gpus.items() if v]
            for part in ("trainer", "critic", "rewards"):
                if getattr(self, part).nodes > 1:
                    raise ConfigError(f"--{part}.nodes {getattr(self, part).nodes}: the local backend runs on this "
                                      f"machine; use --backend ray for a {part} across nodes")
            labelled = [f"--{n}.node_labels" for n in ("rollout", "reference", "critic", "rewards", "agents", "trainer")
                        if getattr(self, n).node_labels]
            if labelled:
                raise ConfigError(f"{', '.join(labelled)} place components on Ray nodes: use --backend ray")
            if used:
                raise ConfigError(f"{', '.join(used)} reserve Ray GPUs: use --backend ray, or for local processes "
                                  "give the daemons' own --gpu_ids / --rm.device flags and CUDA_VISIBLE_DEVICES")
        if self.agents.args is not None and self.rollout.args is None and not _has_flag(self.agents.args, "--rollout"):
            raise ConfigError("the agent gateway generates with a rollout daemon: add a `-- rollout ...` section "
                              "or give the gateway's --rollout endpoint")

    @property
    def daemons(self) -> tuple[str, ...]:
        """Names of the daemons this launch starts, in start order."""
        return tuple(name for name in DAEMONS if getattr(self, name).args is not None)


def flag_name(token: str) -> str | None:
    """``--a.b-c=1`` -> ``--a.b_c``; None for a value (tyro accepts dashes and underscores alike)."""
    if not token.startswith("--") or len(token) == 2:
        return None
    return "--" + token[2:].split("=", 1)[0].replace("-", "_")


def _has_flag(args: Sequence[str], name: str) -> bool:
    return any(flag_name(a) == name for a in args)


def split_sections(argv: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(the launcher's flags, {section name: its flags}); a section is ``-- NAME FLAGS...``.

    The launcher's flags end at the first ``--``; each later ``--`` followed by a section name
    opens a new section, so a component's own ``--`` (if it had one) would need to be avoided.
    """
    args = list(argv)
    cut = args.index("--") if "--" in args else len(args)
    own, rest = args[:cut], args[cut:]
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    i = 0
    while i < len(rest):
        if rest[i] == "--":
            name = rest[i + 1] if i + 1 < len(rest) else ""
            if name not in SECTIONS:
                raise ConfigError(f"`-- {name}`: a section must name one of {', '.join(SECTIONS)}")
            if name in sections:
                raise ConfigError(f"section `-- {name}` given twice")
            current = sections[name] = []
            i += 2
            continue
        assert current is not None
        current.append(rest[i])
        i += 1
    trainers = [s for s in sections if s in TRAINER_COMMANDS]
    if len(trainers) > 1:
        raise ConfigError(f"one trainer per launch: got sections {', '.join(trainers)}")
    return own, sections


def with_sections(cfg: LaunchConfig, sections: dict[str, list[str]]) -> LaunchConfig:
    """``cfg`` with the sections' flags filled in; a component given both ways is an error."""
    changes: dict[str, object] = {}
    for name, args in sections.items():
        if name in DAEMONS:
            group = getattr(cfg, name)
            if group.args is not None:
                raise ConfigError(f"the {name} flags are given twice (--{name}.args / --config and `-- {name}`)")
            changes[name] = dataclasses.replace(group, args=tuple(args))
        else:
            if cfg.trainer.command is not None:
                raise ConfigError(f"the trainer is given twice (--trainer.command {cfg.trainer.command} and `-- {name}`)")
            changes["trainer"] = dataclasses.replace(cfg.trainer, command=name, args=tuple(args))
    return dataclasses.replace(cfg, **changes)


def parse_launch(argv: Sequence[str]) -> LaunchConfig:
    """The validated ``LaunchConfig`` of a ``treadle-launch`` command line (``--help`` exits 0)."""
    own, sections = split_sections(argv)
    from treadle.common.config import deferred_validation  # noqa: PLC0415

    with deferred_validation():
        cfg = parse(LaunchConfig, own, prog="treadle-launch")
        cfg = with_sections(cfg, sections)
    return validate(cfg)
