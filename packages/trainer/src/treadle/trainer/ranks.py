"""The trainer's ranks from its placement flags: started here when no launcher started them.

OpenRLHF's ``train_ppo_ray`` starts ``--actor.num_nodes x --actor.num_gpus_per_node`` ranks
itself, so ``treadle-train ppo --actor.num_gpus_per_node 2`` starts two. Run as a plain process
(no torchrun, no deepspeed launcher: ``treadle-launch`` and ``train_ppo_ray`` use torchrun for
several ranks), this process becomes torchrun's elastic agent for this host through the API
torchrun itself calls (``torch.distributed.launcher.elastic_launch``: a c10d rendezvous on a free
loopback port, as ``torchrun --standalone``; RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set for each child; no restarts) and runs the same command line in
every rank; a failing rank stops the others and its exit status is the command's. Under a
launcher its world is used as today, and must be the one the flags ask for.

Checked before anything loads (``plan``): a launcher's world that differs from the flags, ranks
across hosts without a launcher (``--actor.num_nodes > 1`` needs torchrun on every node), more
ranks than visible GPUs. Only ``ppo`` has placement flags; the other commands run one process
unless launched. Not here: the ranks' own work (``strategy.deepspeed.init_distributed``).
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any

from treadle.common.config import ConfigError


def wanted_ranks(cfg: Any) -> int | None:
    """Ranks the flags ask for (``--actor.num_nodes x --actor.num_gpus_per_node``; the critic
    server's ``--ranks``), or None for a command without placement flags (sft, rm, dpo, kto: as
    many as the launcher started)."""
    if hasattr(cfg, "ranks"):
        return cfg.ranks
    actor = getattr(cfg, "actor", None)
    if actor is None or not hasattr(actor, "num_gpus_per_node"):
        return None
    return actor.num_nodes * actor.num_gpus_per_node


def launcher_world(cfg: Any) -> int | None:
    """WORLD_SIZE of the launcher that started this process (torchrun, or the deepspeed launcher,
    which passes ``--local_rank``), None when none did."""
    import torch.distributed  # noqa: PLC0415

    if not (torch.distributed.is_torchelastic_launched() or getattr(cfg, "local_rank", -1) >= 0):
        return None
    # the launcher's rendezvous variable, read as DeepSpeed and torch read it (not a treadle knob)
    return int(os.environ.get("WORLD_SIZE", "1"))


def _flags(cfg: Any) -> str:
    if hasattr(cfg, "ranks"):
        return f"--ranks {cfg.ranks}"
    a = cfg.actor
    return f"--actor.num_nodes {a.num_nodes} x --actor.num_gpus_per_node {a.num_gpus_per_node}"


def plan(cfg: Any) -> int:
    """Processes to start here: 0 to run in this process (one rank asked for, or a launcher
    started the ranks), else that many local ranks. ConfigError for what cannot run."""
    import torch  # noqa: PLC0415

    wanted, world = wanted_ranks(cfg), launcher_world(cfg)
    if wanted is None:
        return 0
    if world is not None:
        if world != wanted:
            raise ConfigError(
                f"{_flags(cfg)} = {wanted} ranks, but the launcher started {world} (torchrun --nnodes x "
                f"--nproc_per_node, or treadle-launch --trainer.ranks): make them agree, or run without a launcher "
                f"and treadle-train starts the {wanted} ranks itself")
        return 0
    if getattr(cfg, "actor", None) is not None and cfg.actor.num_nodes > 1:
        raise ConfigError(
            f"{_flags(cfg)}: ranks on {cfg.actor.num_nodes} hosts need a launcher on each (torchrun --nnodes "
            f"{cfg.actor.num_nodes} --nproc_per_node {cfg.actor.num_gpus_per_node} --rdzv_endpoint HOST:PORT -m "
            "treadle.trainer.cli ppo ...); treadle-train starts the ranks of one host only")
    if wanted == 1:
        return 0
    if torch.cuda.is_available() and torch.cuda.device_count() < wanted:
        raise ConfigError(f"{_flags(cfg)}: one rank per GPU, but this host shows "
                          f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)")
    return wanted


def run_local_ranks(nproc: int, argv: list[str], *, stopped_status: int | None = None) -> int:
    """``python -m treadle.trainer.cli ARGV`` in ``nproc`` local ranks, as ``torchrun --standalone
    --nproc_per_node NPROC`` runs it; the exit status (a failed rank's, else 0). A SIGTERM / SIGINT
    here stops every rank; then ``stopped_status`` is the status (a server stopped on request),
    or, when None, the signal is raised on (torchrun's own exit 1)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1)
    try:
        elastic_launch(config, sys.executable)("-m", "treadle.trainer.cli", *argv)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException:
        if stopped_status is None:
            raise
        return stopped_status
    return 0
