"""What a launch runs: each component's command line, derived from the ``LaunchConfig`` (pure).

``make_plan(cfg)`` checks every section with its component's own typed config (so a bad flag
fails before anything starts) and fills in what the launcher derives, only for flags the user
did not give (a user's flag is never rewritten):

- rollout: ``--model --engines --backend --tensor_parallel_size --engine.dtype
  --engine.max_model_len --engine.seed ...`` from the ppo flags (``--actor.model_name_or_path``,
  ``--vllm.*``, ``--ds.param_dtype``), exactly as the trainer would start its own daemon;
- agents: ``--model`` from ``--actor.model_name_or_path``, ``--rollout`` from the rollout daemon;
- trainer: ``--vllm.endpoint`` (the rollout daemon) and ``--reward.remote_url`` (the reward
  daemon's ZeroMQ endpoint); giving those yourself next to the section that provides them is an
  error.

Addresses are the launcher's to choose (free ports, picked where the daemon runs); ``bind``
turns a daemon's plan plus its host and ports into its final flags and addresses. A daemon bound
off loopback (on a Ray node's address) is given the run's CURVE keys (``--curve_dir``,
``--zmq.curve_dir``) and, for HTTP, a bearer-token file (``Keys``); the trainer then gets the
client side (``--vllm.curve_dir``, ``--reward.curve_dir``) and ``--vllm.sync_host`` (its rank 0's
node address, where the engines join the weight group). Loopback binds get none of it.

Trainer across nodes (``--trainer.nodes N``, ppo's ``--actor.num_nodes``): one torchrun per node
(``trainer``, ``trainer.1``, ...; ``trainer_groups``), each ``--nnodes N --node_rank i
--master_addr <node 0> --master_port <a free port there> --nproc_per_node K``.

Not here: starting processes or actors (``local``, ``ray_backend``), readiness (``health``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.common.config import ConfigError, label_selector, parse
from treadle.integration.config import LaunchConfig, flag_name

MODULES = {"rollout": "treadle.rollout.cli", "reference": "treadle.rollout.cli", "critic": "treadle.trainer.cli",
           "rewards": "treadle.rewards.cli", "agents": "treadle.agents.cli", "trainer": "treadle.trainer.cli"}
"""Component -> module whose ``main(argv)`` runs it (the same code as its console script)."""
EXIT_CODES = {"trainer": 10, "rollout": 11, "rewards": 12, "agents": 13, "reference": 14, "critic": 15}
"""Launcher exit status when that component fails (exits non-zero, dies, or never gets ready)."""
EXIT_INTERRUPTED = 130
"""Launcher exit status after Ctrl-C / SIGTERM."""
EXIT_LAUNCH_ERROR = 1
"""Launcher exit status when the launcher itself fails (placement, ports, ...)."""
_PLACEHOLDER = "tcp://127.0.0.1:1"  # stands in for an address while checking flags


@dataclass(frozen=True, slots=True, kw_only=True)
class Addresses:
    """Where the launched daemons listen."""

    rollout: str | None = None
    """The rollout daemon's ZeroMQ endpoint (tcp://host:port)."""
    reference: str | None = None
    """The reference daemon's ZeroMQ endpoint (a rollout daemon serving ppo's reference)."""
    critic: str | None = None
    """The critic server's ZeroMQ endpoint (``treadle-train critic``, ppo's critic apart)."""
    rewards: str | None = None
    """The reward daemon's ZeroMQ endpoint."""
    rewards_http: str | None = None
    """The reward daemon's HTTP base URL (OpenRLHF's /get_reward lives under it)."""
    agents: str | None = None
    """The agent gateway's base URL (OpenAI-compatible /v1/chat/completions)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Keys:
    """The security material of a run whose daemons bind off loopback (made by the launcher)."""

    curve_dir: str
    """A ``treadle-keys generate`` folder: the daemons' server pair and allow-list, the clients' pair."""
    token_file: str
    """The bearer token of the HTTP servers off loopback (reward daemon, agent gateway)."""


def off_loopback_host(host: str) -> bool:
    """Whether a bind on ``host`` is reachable from other machines (so it needs keys / a token)."""
    from treadle.common.rpc.transport import is_loopback  # noqa: PLC0415

    return not is_loopback(host)


def _off_loopback(address: str | None) -> bool:
    """A tcp:// or http:// address whose host is not loopback."""
    if not address or not address.startswith(("tcp://", "http://")):
        return False
    return off_loopback_host(address.split("://", 1)[1].rsplit(":", 1)[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonPlan:
    """One daemon's command line, minus the addresses the launcher picks."""

    name: str
    """rollout, rewards or agents."""
    args: tuple[str, ...]
    """``serve`` and its flags: derived ones first, then the user's."""
    port_flags: tuple[str, ...]
    """Flags the launcher fills with free ports (those the user did not give)."""
    given: Addresses = Addresses()
    """Addresses the user fixed in the section."""
    num_gpus: int = 0
    num_cpus: float = 1.0
    ray_engines: bool = False
    """rollout with ``--engine_placement ray``: its engines are Ray actors with bundles of their own,
    so the daemon's bundle holds the front end only (CPU) and it gets no ``--gpu_ids``."""
    engines: int = 1
    """rollout: its engines (``--engines``)."""
    ranks_per_engine: int = 1
    """rollout: workers (GPUs) per engine (tensor x pipeline parallel)."""
    ranks: int = 1
    """critic: processes per node (under torchrun when the world has more than one)."""
    nodes: int = 1
    """critic: nodes of its one world (one part each: ``critic``, ``critic.1``, ...; ``parts``);
    rewards: replicas, one reward daemon per node, each with its own addresses."""

    @property
    def module(self) -> str:
        return MODULES[self.name]

    @property
    def ports_needed(self) -> int:
        return len(self.port_flags)

    @property
    def parts(self) -> tuple[str, ...]:
        """Its per-node parts: the daemon itself, and for a critic over several nodes ``critic.1``, ..."""
        return (self.name, *(f"{self.name}.{i}" for i in range(1, self.nodes)))

    def command(self, argv: Sequence[str], python: str = sys.executable, *,
                rendezvous: Rendezvous | None = None) -> list[str]:
        """Its full command line on one node: ``python -m MODULE ARGV``; a critic over several
        nodes under torchrun, joined at ``rendezvous`` (on one node it starts its ``--ranks`` itself,
        and a SIGTERM stops it with status 0, where torchrun's own status would be 1)."""
        head = torchrun_head(self.nodes, self.ranks, rendezvous) if self.name == "critic" and self.nodes > 1 else []
        return [python, *head, "-m", self.module, *argv]

    def part_ports(self, part: str) -> int:
        """Free ports part ``part`` needs where it runs: a reward replica its own addresses; the
        critic's first part its endpoint and, over several nodes, torchrun's rendezvous."""
        if self.name == "critic":
            return self.ports_needed + (self.nodes > 1) if part == self.name else 0
        return self.ports_needed


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything a backend starts."""

    cfg: LaunchConfig
    daemons: tuple[DaemonPlan, ...]
    trainer_cfg: Any = None
    """The trainer's parsed config (PPOConfig, ...); None without a trainer."""
    colocate: bool = False
    """Trainer and rollout engines share devices (ppo --train.colocate_all)."""

    def daemon(self, name: str) -> DaemonPlan | None:
        return next((d for d in self.daemons if d.name == name), None)


# ---------------------------------------------------------------------------------------------
# flag lists


def flag_items(args: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``[--a, 1, --b, --c, x, y]`` -> ``[(--a, [1]), (--b, []), (--c, [x, y])]`` (values follow their flag)."""
    items: list[tuple[str, list[str]]] = []
    for token in args:
        name = flag_name(token)
        if name is None:
            if not items:
                raise ConfigError(f"{token!r} is not a flag (flags start with --)")
            items[-1][1].append(token)
        else:
            items.append((token, []))
    return items


def _twins(name: str) -> set[str]:
    """A flag name and its boolean twin (``--g.x`` <-> ``--g.no_x``)."""
    head, _, leaf = name[2:].rpartition(".")
    prefix = f"--{head}." if head else "--"
    other = leaf[3:] if leaf.startswith("no_") else f"no_{leaf}"
    return {name, prefix + other}


def given_names(args: Sequence[str]) -> set[str]:
    return {n for n in (flag_name(a) for a in args) if n is not None}


def gives_flag(args: Sequence[str], name: str) -> bool:
    """Whether ``args`` give flag ``name`` or its boolean twin."""
    return bool(_twins(name) & given_names(args))


def merge(derived: Sequence[str], user: Sequence[str]) -> list[str]:
    """The derived flags the user did not give (nor their boolean twins), then the user's flags."""
    mine = given_names(user)
    out: list[str] = []
    for flag, values in flag_items(derived):
        if not _twins(flag_name(flag) or flag) & mine:
            out += [flag, *values]
    return out + list(user)


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The (last) value given to flag ``name`` in ``args``; None when absent."""
    value = None
    for flag, values in flag_items(args) if args else []:
        if flag_name(flag) == name:
            value = flag.split("=", 1)[1] if "=" in flag else (values[0] if values else "")
    return value


def _fixed_port(flag: str, value: str, where: str) -> None:
    if value.rsplit(":", 1)[-1] == "0":
        raise ConfigError(f"`-- {where}` {flag} {value}: port 0 leaves the address unknown to the launcher; "
                          "give a fixed port or leave the flag to the launcher")


def _check(cls: type, args: Sequence[str], where: str) -> Any:
    """``args`` parsed with ``cls`` (the component's own config); invalid flags name the section."""
    try:
        return parse(cls, list(args), prog=f"treadle-launch -- {where}")
    except ConfigError as e:
        raise ConfigError(f"`-- {where}`: {e}") from None


# ---------------------------------------------------------------------------------------------
# components


def _serve_flags(spec: Any) -> list[str]:
    """``treadle-rollout serve`` flags of a ``DaemonSpec`` but its endpoint (the launcher picks it)."""
    from treadle.trainer.daemon import serve_args  # noqa: PLC0415  (no torch)

    items = flag_items(serve_args(spec, _PLACEHOLDER))
    return [t for flag, values in items if flag != "--endpoint" for t in (flag, *values)]


def rollout_flags_from(ppo: Any) -> list[str]:
    """``treadle-rollout serve`` flags for a ppo run's engines, as the trainer's own daemon gets them."""
    from treadle.trainer.daemon import daemon_spec  # noqa: PLC0415  (no torch)

    return _serve_flags(daemon_spec(ppo))


def reference_flags_from(ppo: Any) -> list[str]:
    """``treadle-rollout serve`` flags for the daemon scoring a ppo run's reference: the actor's
    starting weights (``--model`` of a ``-- reference`` section names another), the hf backend (it
    scores at the sampling temperature), the trainer's dtype and length."""
    from treadle.trainer.daemon import daemon_spec  # noqa: PLC0415  (no torch)

    return _serve_flags(dataclasses.replace(daemon_spec(ppo), engines=1, backend="hf", enable_sleep=False,
                                            max_lora_rank=0))


def _serve_plan(name: str, derived: list[str], launch: Any) -> tuple[DaemonPlan, Any]:
    """The plan of a ``treadle-rollout serve`` daemon (``rollout`` or ``reference``): ``derived``
    flags under the section's own, checked with the daemon's config; and that config."""
    from treadle.rollout.config import ServeConfig  # noqa: PLC0415

    user = launch.args or ()
    args = merge(derived, user)
    endpoint = flag_value(user, "--endpoint")
    checked = _check(ServeConfig, [*args, *(() if endpoint else ("--endpoint", _PLACEHOLDER))], name)
    if endpoint:
        _fixed_port("--endpoint", endpoint, name)
    gpus = launch.num_gpus
    ray_engines = checked.engine_placement == "ray"
    if gpus and ray_engines:
        raise ConfigError(f"--{name}.num_gpus {gpus} with `-- {name} --engine_placement ray`: each engine reserves "
                          f"its own GPUs in a placement group of its own (--ray.num_gpus_per_rank); drop --{name}.num_gpus")
    if gpus and gpus != checked.engines * checked.ranks_per_engine:
        raise ConfigError(f"--{name}.num_gpus {gpus}: the {name} daemon runs {checked.engines} engines x "
                          f"{checked.ranks_per_engine} GPUs (--engines x --tensor_parallel_size x --pipeline_parallel_size)")
    plan = DaemonPlan(name=name, args=("serve", *args), port_flags=() if endpoint else ("--endpoint",),
                      given=Addresses(**{name: endpoint}), num_gpus=gpus, num_cpus=launch.num_cpus,
                      ray_engines=ray_engines, engines=checked.engines, ranks_per_engine=checked.ranks_per_engine)
    return plan, checked


def rollout_plan(cfg: LaunchConfig, ppo: Any) -> DaemonPlan:
    return _serve_plan("rollout", rollout_flags_from(ppo) if ppo is not None else [], cfg.rollout)[0]


def reference_plan(cfg: LaunchConfig, ppo: Any) -> DaemonPlan:
    plan, checked = _serve_plan("reference", reference_flags_from(ppo) if ppo is not None else [], cfg.reference)
    if ppo is not None and checked.backend != "hf" and ppo.rollout.temperature != 1.0:
        raise ConfigError(f"`-- reference --backend {checked.backend}` scores prompts from raw logits, and the trainer "
                          f"samples at --rollout.temperature {ppo.rollout.temperature}: serve the reference with "
                          "--backend hf")
    return plan


def critic_plan(cfg: LaunchConfig, ppo: Any) -> DaemonPlan:
    """The critic server's plan: ``treadle-train critic`` with the section's flags (its endpoint
    the launcher's to pick), ``--critic.ranks`` per node on ``--critic.nodes``; ConfigError when the
    ppo run has no critic, or its ``--critic.num_nodes`` x ``--critic.num_gpus_per_node`` differ."""
    from treadle.trainer.config.critic import CriticServeConfig  # noqa: PLC0415  (no torch)
    from treadle.trainer.models.remote_critic import expected_world  # noqa: PLC0415

    c = cfg.critic
    user = list(c.args or ())
    endpoint = flag_value(user, "--endpoint")
    _check(CriticServeConfig, [*user, *(() if endpoint else ("--endpoint", _PLACEHOLDER))], "critic")
    if endpoint:
        _fixed_port("--endpoint", endpoint, "critic")
    if ppo is not None:
        want = expected_world(ppo)
        if want is not None and want != c.nodes * c.ranks:
            raise ConfigError(f"`-- ppo` --critic.num_nodes x --critic.num_gpus_per_node = {want} ranks, but the critic "
                              f"server runs --critic.nodes {c.nodes} x --critic.ranks {c.ranks}: give the same numbers")
    if flag_value(user, "--ranks") is not None:
        raise ConfigError("`-- critic` --ranks: the launcher starts the critic's ranks from --critic.ranks "
                          "(and --critic.nodes); drop the flag")
    if c.nodes == 1:
        user += ["--ranks", str(c.ranks)]
    return DaemonPlan(name="critic", args=("critic", *user), port_flags=() if endpoint else ("--endpoint",),
                      given=Addresses(critic=endpoint), num_gpus=c.ranks * c.num_gpus_per_rank,
                      num_cpus=c.ranks * c.num_cpus_per_rank, ranks=c.ranks, nodes=c.nodes)


def colocated_places(engines: int, ranks_per_engine: int, nodes: int, ranks_per_node: int) -> list[tuple[int, range]]:
    """Where ``--train.colocate_all`` over ``nodes`` trainer nodes puts each engine: (the trainer
    bundle, i.e. node, it shares; the local ranks there whose GPUs its workers take), filling node
    0's ranks first, as OpenRLHF's engines take the bundles of its shared placement group in order.
    ConfigError when the engines' workers are not exactly the trainer's ranks, or one would span two nodes."""
    if engines * ranks_per_engine != nodes * ranks_per_node:
        raise ConfigError(f"--train.colocate_all: {engines} engines x {ranks_per_engine} workers must be the trainer's "
                          f"{nodes} nodes x {ranks_per_node} ranks, one engine worker beside each rank")
    if ranks_per_node % ranks_per_engine:
        raise ConfigError(f"--train.colocate_all: an engine of {ranks_per_engine} workers (--vllm.tensor_parallel_size) "
                          f"would span two of the trainer's nodes of {ranks_per_node} ranks; give a size that divides it")
    out = []
    for k in range(engines):
        first = k * ranks_per_engine
        out.append((first // ranks_per_node, range(first % ranks_per_node, first % ranks_per_node + ranks_per_engine)))
    return out


def rewards_plan(cfg: LaunchConfig) -> DaemonPlan:
    from treadle.rewards.config import ServeConfig  # noqa: PLC0415

    user = list(cfg.rewards.args or ())
    zmq, port = flag_value(user, "--zmq.endpoint"), flag_value(user, "--http.port")
    checked = _check(ServeConfig, [*user, *(() if zmq else ("--zmq.endpoint", _PLACEHOLDER)),
                                   *(() if port else ("--http.port", "1"))], "rewards")
    for flag, value in (("--zmq.endpoint", zmq), ("--http.port", port)):
        if value:
            _fixed_port(flag, value, "rewards")
    if zmq is not None and checked.zmq.endpoint is None:
        raise ConfigError("`-- rewards` --zmq.endpoint None: the trainer reaches the reward daemon over ZeroMQ")
    http = f"http://{checked.http.host}:{checked.http.port}" if port and checked.http.port is not None else None
    if cfg.rewards.nodes > 1 and (zmq or port):
        raise ConfigError(f"--rewards.nodes {cfg.rewards.nodes} starts a reward daemon on each node, each on ports the "
                          "launcher picks: drop `-- rewards` --zmq.endpoint / --http.port")
    return DaemonPlan(name="rewards", args=("serve", *user),
                      port_flags=tuple(f for f, v in (("--zmq.endpoint", zmq), ("--http.port", port)) if not v),
                      given=Addresses(rewards=zmq, rewards_http=http), num_gpus=cfg.rewards.num_gpus,
                      num_cpus=cfg.rewards.num_cpus, nodes=cfg.rewards.nodes)


def agents_plan(cfg: LaunchConfig, ppo: Any) -> DaemonPlan:
    from treadle.agents.gateway.config import GatewayConfig  # noqa: PLC0415

    user = list(cfg.agents.args or ())
    derived = ["--model", ppo.actor.model_name_or_path] if ppo is not None else []
    if cfg.rollout.args is not None and flag_value(user, "--rollout") is not None:
        raise ConfigError("`-- agents` --rollout: the gateway uses the launched rollout daemon; drop the flag")
    args = merge(derived, user)
    port = flag_value(user, "--port")
    checked = _check(GatewayConfig, [*args, *(() if port else ("--port", "1")),
                                     *(("--rollout", _PLACEHOLDER) if cfg.rollout.args is not None else ())], "agents")
    if port:
        _fixed_port("--port", port, "agents")
    given = Addresses(agents=f"http://{checked.host}:{checked.port}" if port else None)
    return DaemonPlan(name="agents", args=("serve", *args), port_flags=() if port else ("--port",), given=given,
                      num_cpus=cfg.agents.num_cpus)


def _wired(cfg: LaunchConfig) -> dict[str, str]:
    """Trainer flags the launcher provides (flag -> the daemon that provides it)."""
    wired = {}
    if cfg.trainer.command == "ppo":
        if cfg.rollout.args is not None:
            wired["--vllm.endpoint"] = "rollout"
        if cfg.rewards.args is not None:
            wired["--reward.remote_url"] = "rewards"
        if cfg.reference.args is not None:
            wired["--ref.remote_url"] = "reference"
        if cfg.critic.args is not None:
            wired["--critic.remote_url"] = "critic"
    return wired


_PLACEMENT_FLAGS = {"--actor.num_gpus_per_node": ("ranks", "--trainer.ranks", "ranks per node"),
                    "--actor.num_nodes": ("nodes", "--trainer.nodes", "nodes")}
"""ppo flag -> (TrainerLaunch field, launcher flag it must agree with, what that counts)."""


def _ranks_flag(cfg: LaunchConfig) -> list[str]:
    """``-- ppo`` without ``--actor.num_gpus_per_node`` / ``--actor.num_nodes``: those set to
    ``--trainer.ranks`` / ``--trainer.nodes`` (the ranks' default, 8, would have the trainer start
    ranks of its own beside the launcher's)."""
    t = cfg.trainer
    if t.command != "ppo":
        return []
    return [tok for flag, (field, _, _) in _PLACEMENT_FLAGS.items() if flag_value(list(t.args), flag) is None
            for tok in (flag, str(getattr(t, field)))]


def _spread_flag(cfg: LaunchConfig) -> list[str]:
    """Reward daemons on several nodes (``--rewards.nodes``) are replicas: the trainer deals its
    samples over them (``--reward.remote_reduce spread``), unless its flags say otherwise."""
    t = cfg.trainer
    if t.command != "ppo" or cfg.rewards.args is None or cfg.rewards.nodes < 2 or \
            flag_value(t.args, "--reward.remote_reduce") is not None:
        return []
    return ["--reward.remote_reduce", "spread"]


def trainer_groups(cfg: LaunchConfig) -> tuple[str, ...]:
    """Names of the trainer's per-node parts: ``trainer`` (node rank 0: rank 0), ``trainer.1``, ..."""
    if cfg.trainer.command is None:
        return ()
    return ("trainer", *(f"trainer.{i}" for i in range(1, cfg.trainer.nodes)))


def trainer_config(cfg: LaunchConfig) -> Any:
    """The trainer section parsed with treadle-train's own config (wired flags as placeholders)."""
    command = cfg.trainer.command
    if command is None:
        return None
    if command != "ppo" and cfg.daemons:
        raise ConfigError(f"`-- {command}` trains without daemons; `-- {' / -- '.join(cfg.daemons)}` serve ppo runs")
    from treadle.trainer.config import parse_command  # noqa: PLC0415  (no torch)

    args = [*cfg.trainer.args, *_ranks_flag(cfg)]
    for flag, (field, launcher_flag, what) in _PLACEMENT_FLAGS.items() if command == "ppo" else ():
        given, mine = flag_value(args, flag), getattr(cfg.trainer, field)
        if given is not None and given != str(mine):
            raise ConfigError(f"`-- ppo` {flag} {given} but {launcher_flag} {mine}: the launcher starts the trainer "
                              f"on {launcher_flag} {what}; give the same number to both (or only {launcher_flag})")
    for flag, daemon in _wired(cfg).items():
        if flag_value(args, flag) is not None:
            raise ConfigError(f"`-- ppo` {flag}: the launched {daemon} daemon provides it; drop the flag "
                              f"(or the `-- {daemon}` section)")
        args += [flag, _PLACEHOLDER if daemon != "rewards" else
                 ",".join(f"tcp://127.0.0.1:{i + 1}" for i in range(cfg.rewards.nodes))]
    args += _spread_flag(cfg)
    try:
        return parse_command(command, args)
    except ConfigError as e:
        raise ConfigError(f"`-- {command}`: {e}") from None


REWARD_PLACEMENT = ("--reward.num_nodes", "--reward.num_gpus_per_node")
"""ppo flags that, without --train.colocate_critic_reward / --train.colocate_all, put the reward
model on devices of its own (OpenRLHF's meaning): the launcher serves it in a reward daemon."""


def without_flags(args: Sequence[str], names: Sequence[str]) -> list[str]:
    """``args`` less every flag named in ``names`` (and its values)."""
    return [t for flag, values in flag_items(args) if flag_name(flag) not in names for t in (flag, *values)]


def place_reward_model(cfg: LaunchConfig) -> LaunchConfig:
    """``-- ppo --reward.model_name_or_path RM --reward.num_gpus_per_node G`` (or ``--reward.num_nodes``)
    other than the actor's, without ``--train.colocate_critic_reward`` / ``--train.colocate_all``:
    the reward model on GPUs of its own, as OpenRLHF places it. (Counts equal to the actor's keep
    it in the trainer's ranks, treadle's default, where OpenRLHF would still give it devices of its
    own: a command that ran before runs the same.) The launcher does it with a reward daemon serving RM
    (``treadle-rewards serve --rm.path RM --rm.replicas G``, its dtype and normalisation from the ppo
    flags) on ``G`` GPUs of its own under ``--backend ray`` (CPU processes on a CPU-only cluster, or with
    the local backend), and the trainer scores through it (``--reward.remote_url``, wired as for a
    ``-- rewards`` section). The critic still starts from RM (``--critic.model_name_or_path``) when
    it would have. Anything else is returned unchanged (colocated, the reward model runs in the
    trainer's ranks; so does a PRM). A daemon serves the model on each of the N nodes, a copy per
    GPU there (``--rm.replicas G``, each scoring its own batches at once), and the trainer deals its
    samples over the N daemons (``--reward.remote_reduce spread``); N > 1 needs the Ray backend, and
    a ``-- rewards`` section of the user's own is refused.

    Scoring differs in one way from the trainer's own: the daemon scores the decoded text, which it
    tokenises again (as OpenRLHF's remote reward models do), where the ranks score token ids.
    """
    t = cfg.trainer
    if t.command != "ppo" or not given_names(t.args) & set(REWARD_PLACEMENT):
        return cfg

    from treadle.integration.config import RewardsLaunch  # noqa: PLC0415

    stripped = without_flags(t.args, REWARD_PLACEMENT)
    # Parsed without the placement flags and without a `-- rewards` section (its wired remote_url
    # would clash with the model path): what remains says whether the model goes apart.
    ppo = trainer_config(dataclasses.replace(cfg, rewards=RewardsLaunch(),
                                             trainer=dataclasses.replace(t, args=tuple(stripped))))
    r, train = ppo.reward, ppo.train
    counts = {f: flag_value(t.args, f) for f in REWARD_PLACEMENT}
    actor = {"--reward.num_nodes": str(ppo.actor.num_nodes), "--reward.num_gpus_per_node": str(ppo.actor.num_gpus_per_node)}
    same = all(v is None or v == actor[f] for f, v in counts.items())
    if same or train.colocate_all or train.colocate_critic_reward or not r.model_name_or_path:
        return cfg  # in the trainer's ranks: the trainer's own check of the counts applies
    try:
        nodes, per_node = (int(counts[f] or actor[f]) for f in REWARD_PLACEMENT)
    except ValueError:
        raise ConfigError(f"`-- ppo` {', '.join(f'{f} {v}' for f, v in counts.items() if v)}: counts") from None
    where = ", ".join(f"{f} {v}" for f, v in counts.items() if v is not None)
    if nodes > 1 and cfg.backend != "ray":
        raise ConfigError(f"`-- ppo` {where}: a reward model placed apart over several nodes is a reward daemon on each "
                          "(Ray nodes): use --backend ray, or --reward.num_nodes 1 (or --train.colocate_critic_reward "
                          "to score in the trainer's ranks)")
    if cfg.rewards.args is not None:
        raise ConfigError(f"`-- ppo` {where}: the launcher would serve the reward model in a reward daemon, but there "
                          "is a `-- rewards` section already: give it --rm.path there (and drop the ppo flags), or "
                          "add --train.colocate_critic_reward")
    rm = ["--rm.path", r.model_name_or_path, "--rm.dtype", ppo.ds.param_dtype, "--rm.replicas", str(per_node),
          "--rm.max_len", str(ppo.max_len), "--rm.normalize" if r.normalize_enable else "--rm.no_normalize"]
    trainer = without_flags(stripped, ("--reward.model_name_or_path", "--reward.normalize_enable",
                                       "--reward.no_normalize_enable", "--reward.offload", "--reward.no_offload"))
    if ppo.critic_origin == "--reward.model_name_or_path":  # OpenRLHF starts the critic from the RM
        trainer += ["--critic.model_name_or_path", r.model_name_or_path]
    gpus_per_rank = cfg.trainer.num_gpus_per_rank
    rewards = RewardsLaunch(args=tuple(rm), num_gpus=per_node if gpus_per_rank else 0, nodes=nodes,
                            num_cpus=cfg.rewards.num_cpus, node_labels=cfg.rewards.node_labels)
    return dataclasses.replace(cfg, rewards=rewards, trainer=dataclasses.replace(t, args=tuple(trainer)))



REF_PLACEMENT = ("--ref.num_nodes", "--ref.num_gpus_per_node")
"""ppo flags that, without --train.colocate_actor_ref / --train.colocate_all, put the reference on
devices of its own (OpenRLHF's meaning): the launcher serves it in a reference daemon."""


def place_reference(cfg: LaunchConfig) -> LaunchConfig:
    """``-- ppo`` with a KL term and ``--ref.num_gpus_per_node G`` (or ``--ref.num_nodes``) other
    than the actor's, without ``--train.colocate_actor_ref`` / ``--train.colocate_all``: the
    reference on devices of its own, as OpenRLHF places it. The launcher starts a reference daemon
    (``treadle-rollout serve --backend hf --model REF --engines G``, REF from ``--ref.model_name_or_path``
    or the actor's; G GPUs under ``--backend ray`` on a GPU cluster, else CPU processes), and the
    trainer scores its KL through it (``--ref.remote_url``, wired as for a ``-- reference`` section
    of the user's own). Counts equal to the actor's keep the reference in the trainer's ranks,
    treadle's default (as for the reward model). Over ``--ref.num_nodes N > 1`` (Ray backend) its
    N x G engines are Ray actors of a GPU each on any node (``--engine_placement ray``).
    ``--ref.offload`` (CPU memory in the ranks) cannot go with it. Anything else is returned unchanged.
    """
    t = cfg.trainer
    if t.command == "ppo" and cfg.reference.args is not None:
        return _reference_model_to_section(cfg)
    if t.command != "ppo" or not given_names(t.args) & set(REF_PLACEMENT):
        return cfg
    stripped = without_flags(t.args, REF_PLACEMENT)
    ppo = trainer_config(dataclasses.replace(cfg, trainer=dataclasses.replace(t, args=tuple(stripped))))
    counts = {f: flag_value(t.args, f) for f in REF_PLACEMENT}
    actor = {"--ref.num_nodes": str(ppo.actor.num_nodes), "--ref.num_gpus_per_node": str(ppo.actor.num_gpus_per_node)}
    same = all(v is None or v == actor[f] for f, v in counts.items())
    used = ppo.uses_reference or ppo.algo.kl.use_loss
    if same or ppo.train.colocate_all or ppo.train.colocate_actor_ref or not used or ppo.ref.remote_url:
        return cfg  # in the trainer's ranks (or none): the trainer's own check of the counts applies
    nodes, per_node = (int(counts[f] or actor[f]) for f in REF_PLACEMENT)
    if nodes > 1 and cfg.backend != "ray":
        raise ConfigError(f"--ref.num_nodes {nodes} spreads the reference's engines over Ray nodes: use --backend ray "
                          "(or --ref.num_nodes 1)")
    if ppo.ref.offload:
        raise ConfigError("--ref.offload keeps the reference in CPU memory in the trainer's ranks; given devices of its "
                          "own (--ref.num_gpus_per_node) it is served apart: drop one of them")
    from treadle.integration.config import ReferenceLaunch  # noqa: PLC0415

    model = ppo.ref.model_name_or_path or ppo.actor.model_name_or_path
    trainer = without_flags(stripped, ("--ref.model_name_or_path",))
    gpus = bool(t.num_gpus_per_rank)
    args: tuple[str, ...] = ("--model", model, "--engines", str(nodes * per_node))
    if nodes > 1:  # each engine a Ray actor with a GPU of its own, on any node (as the rollout's apart)
        args += ("--engine_placement", "ray", "--ray.num_gpus_per_rank", "1" if gpus else "0",
                 *(("--engine.device", "cuda") if gpus else ()))
    reference = ReferenceLaunch(args=args, num_gpus=per_node if gpus and nodes == 1 else 0,
                                num_cpus=cfg.reference.num_cpus, node_labels=cfg.reference.node_labels)
    return dataclasses.replace(cfg, reference=reference, trainer=dataclasses.replace(t, args=tuple(trainer)))


def _reference_model_to_section(cfg: LaunchConfig) -> LaunchConfig:
    """A ``-- reference`` section of the user's own: ``-- ppo --ref.model_name_or_path R`` names the
    model the daemon serves (its ``--model``), so the trainer, which then scores through it, does not
    get it; both given and different is refused."""
    t = cfg.trainer
    model = flag_value(t.args, "--ref.model_name_or_path")
    if model is None:
        return cfg
    served = flag_value(cfg.reference.args or (), "--model")
    if served is not None and served != model:
        raise ConfigError(f"`-- ppo --ref.model_name_or_path {model}` but `-- reference --model {served}`: the "
                          "reference daemon serves one model; give it once")
    args = tuple(cfg.reference.args or ()) if served else ("--model", model, *(cfg.reference.args or ()))
    trainer = without_flags(t.args, ("--ref.model_name_or_path",))
    return dataclasses.replace(cfg, reference=dataclasses.replace(cfg.reference, args=args),
                               trainer=dataclasses.replace(t, args=tuple(trainer)))


CRITIC_PLACEMENT = ("--critic.num_nodes", "--critic.num_gpus_per_node")
"""ppo flags that, with a critic and without --train.colocate_critic_reward / --train.colocate_all,
put the critic on devices of its own (OpenRLHF's meaning): the launcher starts a critic server."""


def place_critic(cfg: LaunchConfig) -> LaunchConfig:
    """``-- ppo`` with a critic (gae) and ``--critic.num_gpus_per_node G`` (or ``--critic.num_nodes
    N``) other than the actor's, without ``--train.colocate_critic_reward`` / ``--train.colocate_all``
    / ``--critic.remote_url``: the critic on devices of its own, as OpenRLHF places it. The launcher
    starts a critic server of N x G ranks (``treadle-train critic``: G per node under torchrun, one
    part per node on Ray, a GPU per rank on a GPU cluster) and wires the trainer to it
    (``--critic.remote_url``); the trainer keeps the counts and checks the server's world against
    them. Counts equal to the actor's keep the critic in the trainer's ranks, treadle's default (as
    for the reference). A ``-- critic`` section of the user's own is taken as it is."""
    t = cfg.trainer
    if t.command == "ppo" and cfg.critic.args is not None:
        from treadle.integration.config import CriticLaunch  # noqa: PLC0415

        ppo = trainer_config(dataclasses.replace(cfg, critic=CriticLaunch(), trainer=dataclasses.replace(
            t, args=tuple(without_flags(t.args, CRITIC_PLACEMENT)))))  # unwired: does the run have a critic?
        if ppo.critic_origin is None:
            raise ConfigError(f"`-- critic` trains ppo's critic, and this run has none (--algo.advantage.estimator "
                              f"{ppo.algo.advantage.estimator}; only gae has one): drop the section")
        return cfg
    if t.command != "ppo" or not given_names(t.args) & set(CRITIC_PLACEMENT):
        return cfg
    ppo = trainer_config(dataclasses.replace(cfg, trainer=dataclasses.replace(
        t, args=tuple(without_flags(t.args, CRITIC_PLACEMENT)))))
    counts = {f: flag_value(t.args, f) for f in CRITIC_PLACEMENT}
    actor = {"--critic.num_nodes": str(ppo.actor.num_nodes), "--critic.num_gpus_per_node": str(ppo.actor.num_gpus_per_node)}
    same = all(v is None or v == actor[f] for f, v in counts.items())
    shared = ppo.train.colocate_all or ppo.train.colocate_critic_reward
    if same or shared or ppo.critic_origin is None or ppo.critic.remote_url:
        return cfg  # in the trainer's ranks (or none): the trainer's own check of the counts applies
    try:
        nodes, per_node = (int(counts[f] or actor[f]) for f in CRITIC_PLACEMENT)
    except ValueError:
        raise ConfigError(f"`-- ppo` {', '.join(f'{f} {v}' for f, v in counts.items() if v)}: counts") from None
    if nodes > 1 and cfg.backend != "ray":
        raise ConfigError(f"--critic.num_nodes {nodes} spreads the critic over Ray nodes: use --backend ray "
                          "(or --critic.num_nodes 1)")
    from treadle.integration.config import CriticLaunch  # noqa: PLC0415

    critic = CriticLaunch(args=(), ranks=per_node, nodes=nodes, num_gpus_per_rank=t.num_gpus_per_rank,
                          num_cpus_per_rank=t.num_cpus_per_rank, node_labels=cfg.critic.node_labels)
    return dataclasses.replace(cfg, critic=critic)


def restarts_from_ppo(cfg: LaunchConfig) -> LaunchConfig:
    """``-- ppo --train.max_restarts N``: the launcher's ``--max_restarts N`` (the trainer, which
    could not restart itself, does not get the flag); both given and different is refused."""
    t = cfg.trainer
    value = flag_value(t.args, "--train.max_restarts") if t.command == "ppo" else None
    if value is None:
        return cfg
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"`-- ppo` --train.max_restarts {value}: a count") from None
    if cfg.max_restarts not in (0, n):
        raise ConfigError(f"`-- ppo` --train.max_restarts {n} but --max_restarts {cfg.max_restarts}: give it once")
    return dataclasses.replace(cfg, max_restarts=n, trainer=dataclasses.replace(
        t, args=tuple(without_flags(t.args, ("--train.max_restarts",)))))


def make_plan(cfg: LaunchConfig) -> Plan:
    """Check every section and derive each daemon's flags (raises ConfigError naming the section)."""
    cfg = place_critic(place_reference(place_reward_model(restarts_from_ppo(cfg))))
    tcfg = trainer_config(cfg)
    ppo = tcfg if cfg.trainer.command == "ppo" else None
    builders = {"rollout": lambda: rollout_plan(cfg, ppo), "reference": lambda: reference_plan(cfg, ppo),
                "critic": lambda: critic_plan(cfg, ppo), "rewards": lambda: rewards_plan(cfg),
                "agents": lambda: agents_plan(cfg, ppo)}
    daemons = tuple(builders[name]() for name in cfg.daemons)
    colocate = bool(ppo is not None and ppo.train.colocate_all)
    roll = next((d for d in daemons if d.name == "rollout"), None)
    if colocate and roll is not None and roll.ray_engines:
        raise ConfigError("--train.colocate_all puts the engines on the trainer's GPUs, `-- rollout --engine_placement "
                          "ray` wherever Ray finds room: drop one of them")
    if colocate and roll is not None and cfg.trainer.nodes > 1:
        _check_colocated_engines(cfg, roll)
    ckpt = getattr(tcfg, "ckpt", None)
    if cfg.max_restarts and ckpt is not None and ckpt.save_steps == -1:
        raise ConfigError(f"--max_restarts {cfg.max_restarts} resumes from the trainer's checkpoints, but `-- "
                          f"{cfg.trainer.command}` saves one only at the end (--ckpt.save_steps -1): give "
                          "--ckpt.save_steps N")
    return Plan(cfg=cfg, daemons=daemons, trainer_cfg=tcfg, colocate=colocate)


def _check_colocated_engines(cfg: LaunchConfig, roll: DaemonPlan) -> None:
    """``--train.colocate_all`` over several trainer nodes: the rollout daemon (in the first
    trainer bundle) runs its engines as Ray actors in every trainer node's bundle
    (``ray_backend.rollout_placement_flags``); checked here, before anything is placed."""
    colocated_places(roll.engines, roll.ranks_per_engine, cfg.trainer.nodes, cfg.trainer.ranks)
    from treadle.rollout.config import ServeConfig  # noqa: PLC0415

    _check(ServeConfig, [*roll.args[1:], "--endpoint", _PLACEHOLDER, "--engine_placement", "ray",
                         "--ray.colocate", *["0"] * roll.engines], "rollout")


# ---------------------------------------------------------------------------------------------
# Ray placement


def bundles_of(plan: Plan) -> tuple[list[dict[str, float]], dict[str, int], dict[str, dict[str, float]]]:
    """(placement-group bundles, component -> bundle index, component -> its actor's resources).

    Trainer: one bundle per node it spans (``trainer_groups``), each ranks x (CPUs, GPUs) per
    rank: a Ray actor holds one bundle, and the torchrun in it needs its node's ranks beside it.
    Each daemon: a bundle of its own (a critic over several nodes: one per node, ``DaemonPlan.parts``),
    except a colocated rollout daemon, which adds its CPUs to the (first) trainer bundle and takes no GPU.
    """
    cfg = plan.cfg
    bundles: list[dict[str, float]] = []
    index: dict[str, int] = {}
    need: dict[str, dict[str, float]] = {}
    t = cfg.trainer
    for name in trainer_groups(cfg):
        need[name] = {"CPU": t.ranks * t.num_cpus_per_rank, "GPU": float(t.ranks * t.num_gpus_per_rank)}
        index[name] = len(bundles)
        bundles.append(dict(need[name]))
    for d in plan.daemons:
        if d.name == "rollout" and plan.colocate and "trainer" in index:
            trainer_gpus = t.nodes * t.ranks * t.num_gpus_per_rank
            if d.num_gpus and d.num_gpus != trainer_gpus:
                raise ConfigError(f"--train.colocate_all: --rollout.num_gpus {d.num_gpus} must equal the trainer's "
                                  f"GPUs ({trainer_gpus:g} = --trainer.nodes x --trainer.ranks x "
                                  "--trainer.num_gpus_per_rank)")
            need["rollout"] = {"CPU": d.num_cpus, "GPU": 0.0}
            index["rollout"] = index["trainer"]
            bundles[index["trainer"]]["CPU"] += d.num_cpus
            continue
        for part in d.parts:  # one bundle per node it spans (a critic over several nodes)
            need[part] = {"CPU": d.num_cpus, "GPU": float(d.num_gpus)}
            index[part] = len(bundles)
            bundles.append(dict(need[part]))
    return [{k: v for k, v in b.items() if v} for b in bundles], index, need


def selectors_of(plan: Plan) -> list[dict[str, str]]:
    """The Ray label selector of each bundle of ``bundles_of`` (``--*.node_labels``; {}: any node).

    A colocated rollout daemon shares the trainer's bundle, so it takes the trainer's labels; its
    own must then be unset or the same.
    """
    _, index, _ = bundles_of(plan)
    out: list[dict[str, str]] = [{} for _ in range(max(index.values(), default=-1) + 1)]
    for name, i in index.items():
        section = name.split(".")[0]  # trainer.1, critic.1: their section's labels
        mine = label_selector(getattr(plan.cfg, section).node_labels)
        if mine and out[i] and mine != out[i]:
            raise ConfigError(f"--train.colocate_all: --{section}.node_labels {mine} differ from the trainer's "
                              f"{out[i]}, whose bundle it shares")
        out[i] = out[i] or mine
    return out


# ---------------------------------------------------------------------------------------------
# addresses -> final command lines


def bind(daemon: DaemonPlan, host: str, ports: Sequence[int], wired: Addresses,
         keys: Keys | None = None) -> tuple[list[str], Addresses]:
    """(the daemon's final argv for its module's ``main``, its addresses); ``ports`` fill ``port_flags``.

    The daemon binds ``host`` (the address of the node it runs on), which is also how the others
    reach it. Off loopback it gets ``keys``: CURVE for its ZeroMQ server, the token file for its
    HTTP server, CURVE client keys for the rollout daemon it calls (the gateway); flags the user
    gave are kept as they are.
    """
    if len(ports) != daemon.ports_needed:
        raise ValueError(f"{daemon.name}: {daemon.ports_needed} ports needed, got {len(ports)}")
    off = off_loopback_host(host)
    if off and keys is None:
        raise ValueError(f"{daemon.name}: binding {host} (off loopback) needs the run's keys")
    filled = dict(zip(daemon.port_flags, ports, strict=True))
    args = list(daemon.args)
    given = given_names(args)

    def secure(flag: str, value: str) -> list[str]:
        return [flag, value] if off and flag not in given else []

    if daemon.name in ("rollout", "reference", "critic"):
        if "--endpoint" in filled:
            args += ["--endpoint", f"tcp://{host}:{filled['--endpoint']}"]
            args += secure("--curve_dir", keys.curve_dir if keys else "")
        given_at = getattr(daemon.given, daemon.name)
        return args, Addresses(**{daemon.name: given_at or f"tcp://{host}:{filled['--endpoint']}"})
    if daemon.name == "rewards":
        if "--zmq.endpoint" in filled:
            args += ["--zmq.endpoint", f"tcp://{host}:{filled['--zmq.endpoint']}"]
            args += secure("--zmq.curve_dir", keys.curve_dir if keys else "")
        if "--http.port" in filled:
            args += ["--http.port", str(filled["--http.port"])]
            if "--http.host" not in given:
                args += ["--http.host", host]
            if "--http.token" not in given:
                args += secure("--http.token_file", keys.token_file if keys else "")
        zmq = daemon.given.rewards or f"tcp://{host}:{filled['--zmq.endpoint']}"
        http = f"http://{host}:{filled['--http.port']}" if "--http.port" in filled else daemon.given.rewards_http
        return args, Addresses(rewards=zmq, rewards_http=http)
    if wired.rollout is not None:
        args += ["--rollout", wired.rollout]
        if _off_loopback(wired.rollout) and keys is not None and "--rollout_curve_dir" not in given:
            args += ["--rollout_curve_dir", keys.curve_dir]
    if "--port" in filled:
        args += ["--port", str(filled["--port"])]
        if "--host" not in given:
            args += ["--host", host]
        if "--token" not in given:
            args += secure("--token_file", keys.token_file if keys else "")
    return args, Addresses(agents=daemon.given.agents or f"http://{host}:{filled['--port']}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """Where the trainer's nodes meet (torchrun's static rendezvous, hosted by node rank 0)."""

    node_rank: int
    master_addr: str
    master_port: int


def torchrun_head(nodes: int, ranks: int, rendezvous: Rendezvous | None) -> list[str]:
    """What runs a command in ``ranks`` processes on each of ``nodes`` nodes: nothing for one, else
    torchrun, ``--standalone`` on one node or joined at ``rendezvous`` (node rank, node 0's address)."""
    if nodes > 1:
        if rendezvous is None:
            raise ValueError(f"{nodes} nodes: each node's command needs its rendezvous")
        return ["-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={rendezvous.node_rank}",
                f"--master_addr={rendezvous.master_addr}", f"--master_port={rendezvous.master_port}",
                f"--nproc_per_node={ranks}"]
    if ranks > 1:
        return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return []


def trainer_argv(cfg: LaunchConfig, addresses: Addresses, python: str = sys.executable, *,
                 rendezvous: Rendezvous | None = None, keys: Keys | None = None,
                 sync_host: str | None = None) -> list[str]:
    """The trainer's full command on one node: ``python -m treadle.trainer.cli CMD ...``, under
    torchrun for ranks > 1 (``--standalone`` on one node; ``rendezvous`` across ``--trainer.nodes``).

    With daemons off loopback the ppo flags get their client keys (``keys``) and
    ``--vllm.sync_host`` (``sync_host``: rank 0's node address), unless the user gave them.
    """
    t = cfg.trainer
    assert t.command is not None
    args = [*t.args, *_ranks_flag(cfg)]
    for flag, daemon in _wired(cfg).items():
        args += [flag, getattr(addresses, daemon)]
    args += _spread_flag(cfg)
    given = given_names(t.args)
    if t.command == "ppo":
        rollout_off = "--vllm.endpoint" in _wired(cfg) and _off_loopback(addresses.rollout)
        extra = {"--vllm.curve_dir": keys.curve_dir if keys and rollout_off else None,
                 "--ref.curve_dir": keys.curve_dir if keys and "--ref.remote_url" in _wired(cfg)
                 and _off_loopback(addresses.reference) else None,
                 "--reward.curve_dir": keys.curve_dir if keys and "--reward.remote_url" in _wired(cfg)
                 and _off_loopback(addresses.rewards) else None,
                 "--critic.curve_dir": keys.curve_dir if keys and "--critic.remote_url" in _wired(cfg)
                 and _off_loopback(addresses.critic) else None,
                 "--vllm.sync_host": sync_host if rollout_off else None}
        args += [tok for flag, value in extra.items() if value and flag not in given for tok in (flag, value)]
    return [python, *torchrun_head(t.nodes, t.ranks, rendezvous), "-m", MODULES["trainer"], t.command, *args]


def merge_addresses(*parts: Addresses) -> Addresses:
    """The addresses known across ``parts`` (later ones fill what earlier ones lack)."""
    out: dict[str, str | None] = {}
    for part in parts:
        for name in Addresses.__slots__:
            value = getattr(part, name)
            if value is not None:
                out[name] = value
    return Addresses(**out)
