"""``python -m treadle.trainer.config``: inspect the training command lines without training.

``--dump-flags [COMMAND...]`` prints each command's sorted flag set under a ``[command]``
header (regenerates ``packages/trainer/tests/config_flags.txt``); ``COMMAND ARGS...`` parses a
command line and prints the resolved config as YAML (secrets nulled); ``COMMAND --help`` shows
every flag with its documentation.
"""

from __future__ import annotations

import sys

from treadle.trainer.config import COMMANDS, ConfigError, dump_yaml, flags_snapshot, parse_command


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--dump-flags":
        unknown = [n for n in args[1:] if n not in COMMANDS]
        if unknown:
            print(f"unknown command(s) {unknown}; known: {list(COMMANDS)}", file=sys.stderr)
            return 2
        sys.stdout.write(flags_snapshot(args[1:] or None))
        return 0
    if not args or args[0] not in COMMANDS:
        print(f"usage: python -m treadle.trainer.config {{--dump-flags,{','.join(COMMANDS)}}} [ARGS...]",
              file=sys.stderr)
        return 2
    try:
        cfg = parse_command(args[0], args[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_yaml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
