"""``python -m treadle.rewards serve ...`` (same as ``treadle-rewards``)."""

from treadle.rewards.cli import main

main()
