"""OpenRLHF's entry point, treadle's way: ``python -m treadle.integration.train_ppo_ray <PPO flags>``.

Takes exactly ``treadle-train ppo``'s flags (OpenRLHF's vocabulary: ``--actor.num_gpus_per_node``,
``--vllm.num_engines``, ``--vllm.tensor_parallel_size``, ``--train.colocate_all``, ...) and runs
the job on Ray through the launcher's Ray backend, so it works directly and as a Ray job::

    ray start --head
    ray job submit --address http://127.0.0.1:8265 -- python -m treadle.integration.train_ppo_ray \\
        --actor.model_name_or_path M --actor.num_gpus_per_node 8 --vllm.num_engines 4 \\
        --vllm.tensor_parallel_size 2 --train.colocate_all ...

What it starts: a rollout daemon actor with ``--vllm.num_engines`` engines (unless
``--vllm.endpoint`` names a running one): colocated (``--train.colocate_all``) on the trainer's
GPUs, else each engine a Ray actor with a placement group of its own on whichever node has room
(``treadle-rollout serve --engine_placement ray``), so engines spread over nodes as OpenRLHF's do
and a lost node's engines are replaced in place; and one trainer actor per node (``--actor.num_nodes``),
each running ``--actor.num_gpus_per_node`` ranks under torchrun (one torchrun per node, joined by
torchrun's rendezvous on the first one's node). On a cluster with GPUs each rank gets one and the
engines get ``num_engines x tensor_parallel_size`` (the trainer's own with
``--train.colocate_all``); on a CPU-only cluster the same numbers are CPU processes. Rewards come
from the trainer's own flags (``--reward.model_name_or_path`` in the trainer ranks,
``--reward.remote_url`` a file, a daemon or a URL). A critic (gae) given other counts than the
actor's (``--critic.num_nodes`` x ``--critic.num_gpus_per_node``), without
``--train.colocate_critic_reward`` / ``--train.colocate_all``, trains in a critic server of those
ranks (``plan.place_critic``: one torchrun part per node, a GPU per rank). A reward model given other counts than the actor's (1 node x G GPUs), without
``--train.colocate_critic_reward`` / ``--train.colocate_all``, is served apart by a reward daemon
(``plan.place_reward_model``); a reference given other counts (1 node x G), without
``--train.colocate_actor_ref`` / ``--train.colocate_all``, by a reference daemon of G engines
(``plan.place_reference``).

Logs and run.json go to ``<TREADLE_RUN_DIR>/launch-<UTC time>`` (printed at start; on a
filesystem every node sees). Exit status as ``treadle-launch``'s. Placement by node labels
(``treadle-launch --trainer.node_labels``) is the launcher's; here Ray's PACK places everything.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

from treadle.common.config import ConfigError
from treadle.common.log import setup_logging
from treadle.integration.config import LaunchConfig, RolloutLaunch, TrainerLaunch


def launch_config(args: Sequence[str], ppo: Any, *, gpus: bool) -> LaunchConfig:
    """The launch of a PPO run given its parsed flags; ``gpus``: the cluster has GPUs to place on."""
    actor, vllm = ppo.actor, ppo.vllm
    ranks = actor.num_gpus_per_node
    rollout = RolloutLaunch()
    if vllm.endpoint is None and ppo.engines_colocated:  # the engines on the trainer's GPUs (its node's)
        rollout = RolloutLaunch(args=(), num_gpus=vllm.num_engines * vllm.tensor_parallel_size if gpus else 0)
    elif vllm.endpoint is None:  # each engine a Ray actor with GPUs of its own, on any node (as OpenRLHF's)
        rollout = RolloutLaunch(args=("--engine_placement", "ray", "--ray.num_gpus_per_rank", "1" if gpus else "0"))
    return LaunchConfig(backend="ray", rollout=rollout,
                        trainer=TrainerLaunch(command="ppo", args=tuple(args), ranks=ranks, nodes=actor.num_nodes,
                                              num_gpus_per_rank=1 if gpus else 0))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    from treadle.integration.cli import install_stop_handlers, launch, report, run_dir_of  # noqa: PLC0415
    from treadle.integration.plan import (  # noqa: PLC0415
        CRITIC_PLACEMENT,
        REF_PLACEMENT,
        REWARD_PLACEMENT,
        make_plan,
        without_flags,
    )
    from treadle.trainer.config import parse_ppo  # noqa: PLC0415

    try:
        # a reward model, reference or critic apart: the plan serves them (placement flags unlike the actor's)
        ppo = parse_ppo(without_flags(args, (*REWARD_PLACEMENT, *REF_PLACEMENT, *CRITIC_PLACEMENT)))
        cpu_plan = make_plan(launch_config(args, ppo, gpus=False))
    except ConfigError as e:
        print(f"train_ppo_ray: error: {e}", file=sys.stderr)
        return 2
    import ray  # noqa: PLC0415

    from treadle.integration.ray_backend import bundles_of, connect  # noqa: PLC0415

    connect(cpu_plan.cfg.ray, sum(b.get("CPU", 0) for b in bundles_of(cpu_plan)[0]))
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    plan = make_plan(launch_config(args, ppo, gpus=True)) if gpus else cpu_plan
    run_dir = run_dir_of(plan.cfg)
    print(f"train_ppo_ray: run directory {run_dir}", flush=True)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        outcome = launch(plan, run_dir, stop)
    except ConfigError as e:
        print(f"train_ppo_ray: error: {e}", file=sys.stderr)
        return 2
    print(report(outcome, run_dir), file=sys.stderr if outcome.exit_code else sys.stdout, flush=True)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
