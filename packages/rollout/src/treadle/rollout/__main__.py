"""``python -m treadle.rollout ...``: the same as the ``treadle-rollout`` command."""

from treadle.rollout.cli import main

main()
