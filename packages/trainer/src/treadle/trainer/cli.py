"""``treadle-train {sft,kd,rm,prm,dpo,kto,ppo} [FLAGS...]``: parse, build, run, clean up.

Runs as one process, or one process per rank under a launcher::

    treadle-train sft --actor.model_name_or_path M --data.dataset d.jsonl ...
    torchrun --nproc_per_node 2 -m treadle.trainer.cli sft ...
    deepspeed --module treadle.trainer.cli sft ...
    treadle-train ppo --actor.num_gpus_per_node 2 ...   # starts its 2 ranks itself (``ranks``)

An invalid flag or a malformed data row prints one line naming it and exits with status 2.
"""

from __future__ import annotations

import importlib
import sys

from treadle.common.config import ConfigError
from treadle.common.log import setup_logging
from treadle.trainer.trainers import RECIPES


def _fail(command: str, error: ConfigError) -> int:
    print(f"treadle-train {command}: error: {error}", file=sys.stderr)
    return 2


def _command_first(args: list[str]) -> list[str]:
    """The deepspeed launcher puts ``--local_rank=N`` before the command: move it after."""
    lead = []
    while args and args[0].startswith("--local_rank"):
        lead.append(args.pop(0))
        if lead[-1] == "--local_rank" and args:
            lead.append(args.pop(0))
    return args[:1] + lead + args[1:]


def _import_recipe(command: str) -> object | None:
    """The recipe module, or None (after one line naming the missing extra) without torch & co."""
    try:
        return importlib.import_module(RECIPES[command])
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("torch", "deepspeed", "transformers", "peft", "safetensors"):
            print(f"treadle-train {command}: error: training needs {e.name!r}: pip install 'treadle-trainer[train]'",
                  file=sys.stderr)
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    args = _command_first(list(sys.argv[1:] if argv is None else argv))
    if not args or args[0] not in RECIPES:
        print(f"usage: treadle-train {{{','.join(RECIPES)}}} [FLAGS...]  ('treadle-train sft --help' lists the flags)",
              file=sys.stderr)
        return 2
    command = args[0]
    from treadle.trainer.config import parse_command  # noqa: PLC0415  (no torch before the flags are known good)

    try:
        cfg = parse_command(command, args[1:])
    except ConfigError as e:
        return _fail(command, e)
    recipe = _import_recipe(command)
    if recipe is None:
        return 2
    from treadle.trainer import ranks  # noqa: PLC0415

    try:
        nproc = ranks.plan(cfg)
    except ConfigError as e:
        return _fail(command, e)
    if nproc:
        setup_logging()
        return ranks.run_local_ranks(nproc, args, stopped_status=0 if command == "critic" else None)
    from treadle.trainer.strategy.deepspeed import shutdown_distributed  # noqa: PLC0415

    try:
        setup_logging()
        recipe.run(cfg)
    except ConfigError as e:  # also DataError: a malformed dataset or row
        return _fail(command, e)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
